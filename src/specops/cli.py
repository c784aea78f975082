"""Command line: parse, dispatch, and map errors to one line and an exit code. Nothing else."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from . import __version__
from .errors import SpecopsError


def _cmd_generate(args: argparse.Namespace) -> int:
    from .config import load_config
    from .generate import run_generate
    from .report_cli import print_generate_summary

    cfg = load_config(args.config)
    if args.campaign:
        cfg.campaign.dir = args.campaign
    summary = run_generate(cfg, retry_failed=args.retry_failed, progress=False if args.no_progress else None)
    if args.json:
        print(json.dumps({"campaign": summary.campaign, "elapsed_s": summary.elapsed_s,
                          "datasets": summary.datasets}, indent=1))
    else:
        print_generate_summary(summary)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specops", description=__doc__)
    p.add_argument("--version", action="version", version=f"specops {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    g = sub.add_parser("generate", help="regenerate responses from the target (resumable)")
    g.add_argument("config", help="campaign.toml")
    g.add_argument("--campaign", help="campaign directory (default: from the config)")
    g.add_argument("--retry-failed", action="store_true", help="give parked failures another try")
    g.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    g.add_argument("--json", action="store_true", help="print the summary as JSON")
    g.set_defaults(func=_cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    for noisy in ("httpx", "urllib3", "transformers", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.func(args)
    except SpecopsError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("Interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
