"""Command line: parse, dispatch, and map errors to one line and an exit code. Nothing else."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from typing import Any

from . import __version__
from .errors import SpecopsError


def _cmd_generate(args: argparse.Namespace) -> int:
    from .config import load_config
    from .generate import run_generate
    from .report_cli import print_generate_summary

    cfg = load_config(args.config)
    if args.campaign:
        cfg.campaign.dir = args.campaign
    if args.detach:
        from .campaign import Campaign
        from .runctl import spawn_detached

        camp = Campaign.create_or_open(cfg)
        argv = ["generate", str(args.config), "--no-progress", "--campaign", str(camp.root)]
        if args.retry_failed:
            argv.append("--retry-failed")
        if args.no_canary:
            argv.append("--no-canary")
        pid = spawn_detached(argv, camp)
        print(f"generate running detached: pid {pid}\n  campaign: {camp.root}\n"
              f"  follow:   specops status {camp.root} --watch\n  stop:     specops stop {camp.root}")
        return 0
    summary = run_generate(cfg, retry_failed=args.retry_failed, progress=False if args.no_progress else None,
                           canary=not args.no_canary)
    if args.json:
        print(json.dumps({"campaign": summary.campaign, "elapsed_s": summary.elapsed_s,
                          "datasets": summary.datasets}, indent=1))
    else:
        print_generate_summary(summary)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from . import status
    from .runctl import resolve_campaign_arg

    camp = resolve_campaign_arg(args.campaign)
    config = None  # a campaign.toml: judge the done phases against its settings (what a run would use)
    if args.campaign and args.campaign.endswith(".toml"):
        from .config import load_config

        config = load_config(args.campaign).to_dict()
    if args.watch:
        import time

        from rich.live import Live

        with Live(refresh_per_second=1, screen=False) as live:
            while True:
                rep = status.collect(camp.root, stall_s=args.stall_s, config=config)
                live.update(status.render(rep))
                time.sleep(args.interval)
    rep = status.collect(camp.root, stall_s=args.stall_s, config=config)
    if args.json:
        print(json.dumps(rep.to_json(), indent=1))
    else:
        from rich.console import Console

        Console().print(status.render(rep))
    return rep.exit_code


def _cmd_health(args: argparse.Namespace) -> int:
    from .auth import client_key
    from .checks.server import check_endpoint_sync
    from .errors import ConfigError

    if args.config:
        from .config import load_config
        from .models import served_name

        cfg = load_config(args.config)
        urls = [args.url] if args.url else cfg.engine.endpoints
        model = args.model or served_name(cfg.target.model, cfg.target.served_name)
        key = client_key(cfg)
    else:
        if not (args.url and args.model):
            raise ConfigError("health: give a campaign.toml, or both --url and --model")
        urls, model, key = [args.url], args.model, None
    if args.api_key_env:
        from .auth import env_key

        key = env_key("--api-key-env", args.api_key_env)
    if not urls:
        raise ConfigError("engine.endpoints: no endpoint to check (engine.kind is not 'openai')")
    # --drafter: the server must speculate; otherwise the drafter tier runs where the server shows
    # spec-decode counters (and costs its probe there) and is skipped elsewhere.
    reports = [check_endpoint_sync(u, expected_model=model, api_key=key, progress_window_s=args.window,
                                   completion_timeout_s=args.completion_timeout,
                                   drafter=True if args.drafter else None,
                                   drafter_probe_tokens=args.drafter_probe_tokens) for u in urls]
    if args.json:
        print(json.dumps([r.to_json() for r in reports], indent=1))
    else:
        from rich.console import Console

        con = Console()
        for r in reports:
            con.print(r.render())
    return max(r.exit_code for r in reports)


def _cmd_serve(args: argparse.Namespace) -> int:
    import signal

    from . import serve
    from .campaign import Campaign
    from .config import load_config

    cfg = load_config(args.config)
    if not args.stop:  # an exposed host without a key is refused before the campaign is touched
        from .auth import check_exposure

        check_exposure(cfg, features=args.features)
    camp = Campaign.create_or_open(cfg)
    if args.stop:
        print(serve.stop_recorded(camp, cfg.serve.port))
        return 0
    print(f"starting {cfg.serve.engine} for {cfg.target.model} on {cfg.serve.host}:{cfg.serve.port} "
          f"(log {camp.run_dir / f'serve-{cfg.serve.port}.log'})", file=sys.stderr, flush=True)
    features = None
    if args.features:  # the target serving EAGLE-3 features (served extract), not a drafter
        from .extract import served_features

        features = served_features(cfg, camp)
        where = f"files in {features[2]}" if cfg.serve.engine == "vllm" else "states in each /generate response"
        print(f"features: layers {features[0]} + {features[1]} (the final state), {where}",
              file=sys.stderr, flush=True)
    srv = serve.start(cfg, camp, on_poll=serve.follow_log(), features=features)
    print(f"ready in {srv.startup_s:.1f}s: {srv.url} (process group {srv.pgid})", flush=True)
    from .campaign import read_json
    from .checks.server import check_endpoint_sync

    info = read_json(camp.run_dir / f"serve-{cfg.serve.port}.json") or {}
    for k, v in (info.get("env_added") or {}).items():
        print(f"server environment: {k}={v}", file=sys.stderr, flush=True)
    if info.get("drafter"):
        d = info["drafter"]
        print(f"drafter: {d['path']} ({d['format']} format, {d['num_speculative_tokens']} speculative tokens"
              f"{', served as the model' if d['served_as_model'] else ''})", flush=True)
    # With a drafter the health check includes the drafter tier: its counters must move and accept.
    rep = check_endpoint_sync(srv.url, expected_model=srv.served_name, api_key=srv.api_key, progress_window_s=0.5,
                              drafter=cfg.serve.drafter is not None and features is None)
    from rich.console import Console

    Console(stderr=True).print(rep.render())
    tier = next((t for t in rep.tiers if t.name == "drafter"), None)
    if tier is not None:
        print(f"drafter tier {tier.status}: {tier.evidence}", flush=True)
    if args.detach:
        print(f"left running; stop with: specops serve {args.config} --stop", flush=True)
        return rep.exit_code
    stop = {"sig": None}

    def on_sig(signum, frame):
        stop["sig"] = signum

    signal.signal(signal.SIGTERM, on_sig)
    signal.signal(signal.SIGINT, on_sig)
    try:
        while stop["sig"] is None and srv.running():
            signal.pause() if hasattr(signal, "pause") else None
    finally:
        srv.stop()
    print("server stopped (whole process group)", file=sys.stderr)
    return 0


def _cmd_preflight(args: argparse.Namespace) -> int:
    from .config import load_config
    from .preflight import run_preflight

    cfg = load_config(args.config) if args.config else None
    phases = args.phases.split(",") if args.phases else ["generate", "build", "extract", "train"]
    ports = [int(p) for p in args.ports.split(",")] if args.ports else []
    rep = run_preflight(cfg, phases=phases, campaign_dir=cfg.campaign_dir() if cfg else None,
                        ports=ports, need_gpus=args.gpus)
    if args.json:
        print(json.dumps(rep.to_json(), indent=1))
    else:
        from rich.console import Console

        Console().print(rep.render())
    return rep.exit_code


def _cmd_build(args: argparse.Namespace) -> int:
    from .build import run_build
    from .config import load_config

    cfg = load_config(args.config)
    if args.campaign:
        cfg.campaign.dir = args.campaign
    t0 = time.monotonic()
    m = run_build(cfg)
    if args.json:
        print(json.dumps(m, indent=1))
    else:
        print(_build_line(m, time.monotonic() - t0))
    return 0


def _build_line(m: dict, elapsed_s: float | None = None) -> str:
    from .report_cli import build_what, duration

    return f"build done{'' if elapsed_s is None else ' in ' + duration(elapsed_s)}: {build_what(m)}"


def _rank() -> int:
    """This process's rank under torchrun (0 alone): only rank 0 locks the campaign and prints."""
    import os

    return int(os.environ.get("RANK", "0"))


def _phase_config(camp):
    """The config a phase started on a campaign directory runs with: the campaign's own copy."""
    from .config import load_config
    from .errors import InputError

    if not camp.config_path.is_file():
        raise InputError(f"{camp.config_path}: not found (is {camp.root} a campaign directory?)")
    return load_config(camp.config_path)


def _cmd_extract(args: argparse.Namespace) -> int:
    """Target hidden states -> features/ (under torchrun: each rank its own shards)."""
    from .campaign import RunLock
    from .extract import run_extract

    camp = _campaign_from_arg(args.campaign)
    cfg = _phase_config(camp)
    t0 = time.monotonic()
    lock = RunLock(camp, "extract").acquire() if _rank() == 0 else None
    try:
        summary = run_extract(cfg, camp, split=args.split)
    finally:
        if lock is not None:
            lock.release()
    if _rank() == 0:
        if args.json:
            print(json.dumps(summary, indent=1))
        else:
            from .report_cli import duration, extract_what

            print(f"extract done in {duration(time.monotonic() - t0)}: {extract_what(summary)}")
    return 0


def _campaign_from_arg(arg: str):
    """A campaign.toml (its resolved config is copied into the campaign, so the phase started
    from the campaign directory sees the current settings) or a campaign directory."""
    from .runctl import resolve_campaign_arg

    if arg and arg.endswith(".toml"):
        from .campaign import Campaign
        from .config import load_config

        return Campaign.create_or_open(load_config(arg))
    return resolve_campaign_arg(arg)


def _cmd_train(args: argparse.Namespace) -> int:
    """features/ (or the target in process) -> drafter checkpoints (under torchrun: DDP)."""
    from .drafter.train import run_train

    camp = _campaign_from_arg(args.campaign)
    t0 = time.monotonic()
    summary = run_train(_phase_config(camp), camp, max_steps=args.max_steps, family=args.family)
    if _rank() == 0:
        if args.json:
            print(json.dumps(summary, indent=1))
        else:
            from .report_cli import duration, train_what

            what = train_what(summary.get("step"), summary.get("total_steps"), (summary.get("val") or {}).get("tau"),
                              summary.get("checkpoint"))
            if summary.get("finished"):
                print(f"train done in {duration(time.monotonic() - t0)}: {what}")
            else:
                flag = f" --drafter {args.family}" if args.family else ""
                print(f"train stopped in {duration(time.monotonic() - t0)} (--max-steps): {what}; "
                      f"`specops train {args.campaign}{flag}` resumes it")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .drafter.export import check_export, run_export

    if args.check:
        rep = check_export(args.check, target_config=args.target)
        if args.json:
            print(json.dumps(rep.to_json(), indent=1))
        else:
            from rich.console import Console

            Console().print(rep.render())
        return 0 if rep.ok else 2
    from .campaign import Campaign
    from .config import load_config
    from .errors import ConfigError

    if not args.campaign:
        raise ConfigError("export: give a campaign.toml (or --check DIR)")
    cfg = load_config(args.campaign)
    camp = Campaign.create_or_open(cfg)
    formats = tuple(args.format.split(",")) if args.format else ("vllm", "speculators")
    t0 = time.monotonic()
    out = run_export(cfg, camp, checkpoint=args.checkpoint, formats=formats, family=args.family)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        from .report_cli import duration, export_what

        print(f"export done in {duration(time.monotonic() - t0)}: {export_what(out)}")
    return 0


def _cmd_reset(args: argparse.Namespace) -> int:
    from .reset import reset

    out = reset(_campaign_from_arg(args.campaign), args.phase, dataset=args.dataset, family=args.family)
    print(f"archived {', '.join(out['moved']) or 'nothing'} to {out['archived_to']}; "
          f"pending: {', '.join(out['pending'])}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from .config import load_config
    from .pipeline import phases_between, run_all

    cfg = load_config(args.config)
    phases_between(args.from_phase, args.to_phase)  # validate before anything starts
    if args.detach:
        from .campaign import Campaign
        from .runctl import spawn_detached

        camp = Campaign.create_or_open(cfg)
        argv = ["run", str(args.config), "--no-progress"]
        for flag, v in (("--from", args.from_phase), ("--to", args.to_phase)):
            if v:
                argv += [flag, v]
        if args.skip_preflight:
            argv.append("--skip-preflight")
        pid = spawn_detached(argv, camp)
        print(f"run detached: pid {pid}\n  campaign: {camp.root}\n  follow:   specops status {camp.root} --watch"
              f"\n  stop:     specops stop {camp.root}")
        return 0
    if args.no_progress:  # every phase, and the processes they start (torchrun ranks), logs plain lines
        import os

        os.environ["SPECOPS_PROGRESS"] = "plain"
    results = run_all(cfg, start=args.from_phase, stop=args.to_phase, skip_preflight=args.skip_preflight,
                      progress=False if args.no_progress else None)
    if args.json:
        print(json.dumps(results, indent=1, default=str))
    else:
        from .report_cli import run_summary

        print("\n".join(run_summary(cfg.campaign_dir(), phases_between(args.from_phase, args.to_phase),
                                     results.elapsed_s, args.config)))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from .evaluate.report import write_report
    from .evaluate.specdec import run_eval, with_workers

    camp = _campaign_from_arg(args.campaign)
    from .config import load_config

    from .report_cli import duration, eval_what, report_line, served_what

    cfg = load_config(args.campaign) if args.campaign.endswith(".toml") else load_config(camp.config_path)
    from .config import check_family
    from .errors import ConfigError

    if args.family:
        families = [check_family(args.family, "--family")]
    elif args.drafter or args.url:  # one drafter: the first family's slot
        families = [cfg.train.families[0]]
    else:
        families = list(cfg.train.families)
    if len(cfg.train.families) > 1 and (args.drafter or args.url) and not args.family:
        raise ConfigError("eval: --drafter / --url give one drafter and train.drafter lists several families; "
                          "add --family NAME (whose eval it is)")
    served_only = bool(args.served or args.url)
    lines: list[str] = []
    out: dict = {}  # --json
    verdicts: dict = {}
    for family in families:
        home = camp.drafter_home(cfg, family)
        summary: dict = {}
        fout: dict = {}
        tag = f" ({family})" if len(families) > 1 or not home.first else ""
        if not served_only:
            t0 = time.monotonic()
            summary = run_eval(with_workers(cfg, args.workers, args.batch_size), camp, drafter_dir=args.drafter,
                               family=family)
            fout["overall"] = summary.get("overall", summary)
            lines.append(f"eval{tag} done in {duration(time.monotonic() - t0)}: "
                         f"{eval_what(fout['overall'], list(summary.get('datasets') or []))}")
        if served_only or cfg.eval.served or cfg.eval.server_url:
            from .evaluate.report import verdict
            from .evaluate.report import brief
            from .serve import evaluate_served

            t0 = time.monotonic()
            result = evaluate_served(cfg, camp, url=args.url, baseline_url=args.baseline_url,
                                     concurrency=args.concurrency, interop=False if args.no_interop else None,
                                     family=family)
            b = brief(result)
            fout["served"] = b
            lines.append(f"served eval{tag} done in {duration(time.monotonic() - t0)}: {served_what(b)}")
            if result.get("interop"):
                lines.append(result["interop"]["line"])
            if not summary:
                summary = {"verdict": verdict({}, baseline_tokens_per_s=cfg.eval.baseline_tokens_per_s,
                                              min_tau=cfg.eval.min_tau, served=b)}
            else:
                summary = json.loads((home.eval_dir / "summary.json").read_text())
        verdicts[family] = summary.get("verdict") or {}
        if len(families) == 1:
            out.update(fout)
        else:
            out.setdefault("families", {})[family] = fout
    md, html = write_report(camp)
    from .evaluate.report import campaign_verdict

    # one family: its own verdict; several evaluated: the one that pays most, or none
    v = verdicts[families[0]] if len(families) == 1 and len(camp.evaluated_homes()) < 2 else campaign_verdict(camp)
    if args.json:
        print(json.dumps({**out, "verdict": v, "report": str(md), "report_html": str(html)}, indent=1, default=str))
    else:
        print("\n".join([*lines, v.get("line", ""), report_line(md.parent)]))
    return 1 if v.get("go") is False else 0  # None: nothing judged (a served eval without a baseline)


def _cmd_stop(args: argparse.Namespace) -> int:
    from .runctl import resolve_campaign_arg, stop

    print(stop(resolve_campaign_arg(args.campaign), timeout_s=args.timeout, force=args.force))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specops",
        description="Target LLM + prompt datasets -> a served EAGLE-3 drafter, with flight checks.",
    )
    p.add_argument("--version", action="version", version=f"specops {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    g = sub.add_parser("generate", help="regenerate responses from the target (resumable)")
    g.add_argument("config", help="campaign.toml")
    g.add_argument("--campaign", help="campaign directory (default: from the config)")
    g.add_argument("--retry-failed", action="store_true", help="give parked failures another try")
    g.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    g.add_argument("--json", action="store_true", help="print the summary as JSON")
    g.add_argument("--no-canary", action="store_true", help="skip the canary (recorded in the manifest)")
    g.add_argument("--detach", action="store_true", help="run in the background (own session); returns at once")
    g.set_defaults(func=_cmd_generate)

    st = sub.add_parser("status", help="progress, rates, ETA, stalls; exit 2 on trouble")
    st.add_argument("campaign", nargs="?", help="campaign directory or its campaign.toml (default: .)")
    st.add_argument("--json", action="store_true")
    st.add_argument("--watch", action="store_true", help="live view")
    st.add_argument("--interval", type=float, default=2.0, help="--watch refresh seconds")
    st.add_argument("--stall-s", type=float, default=None,
                    help="in flight with no completion for this long = stalled (default: the campaign's monitor.stall_s)")
    st.set_defaults(func=_cmd_status)

    b = sub.add_parser("build", help="merge, dedupe, shuffle, tokenize with loss masks; pick the draft vocab")
    b.add_argument("config", help="campaign.toml")
    b.add_argument("--campaign", help="campaign directory (default: from the config)")
    b.add_argument("--json", action="store_true", help="print the build manifest")
    b.set_defaults(func=_cmd_build)

    ex = sub.add_parser("extract", help="target hidden states (3 aux layers + pre-norm final) -> features/")
    ex.add_argument("campaign", help="campaign directory or its campaign.toml")
    ex.add_argument("--split", choices=("train", "val", "both"), default="both")
    ex.add_argument("--json", action="store_true", help="print the summary as JSON")
    ex.set_defaults(func=_cmd_extract)

    tr = sub.add_parser("train", help="train the drafter (resumable); --drafter FAMILY trains another beside it")
    tr.add_argument("campaign", help="campaign directory or its campaign.toml")
    tr.add_argument("--drafter", "--family", dest="family", metavar="FAMILY",
                    help="the drafter family to train (default: the first of train.drafter); another family "
                         "trains at drafters/<family>/, never touching drafter/")
    tr.add_argument("--max-steps", type=int, help="stop after this step (resumable; the schedule is unchanged)")
    tr.add_argument("--json", action="store_true", help="print the summary as JSON")
    tr.set_defaults(func=_cmd_train)

    xp = sub.add_parser("export", help="write drafters vLLM/SGLang and speculators load; --check validates any dir")
    xp.add_argument("campaign", nargs="?", help="campaign.toml")
    xp.add_argument("--checkpoint", help="a training checkpoint dir (default: the latest)")
    xp.add_argument("--family", help="the drafter family to export (default: the first of train.drafter)")
    xp.add_argument("--format", help="comma-separated: vllm,speculators (default both)")
    xp.add_argument("--check", metavar="DIR", help="validate a drafter directory (ours or third-party)")
    xp.add_argument("--target", help="target model dir or config.json, to range-check layer ids (--check)")
    xp.add_argument("--json", action="store_true", help="print the summary (or the --check report) as JSON")
    xp.set_defaults(func=_cmd_export)

    r = sub.add_parser("run", help="every phase in order with gates; done phases are skipped")
    r.add_argument("config", help="campaign.toml")
    r.add_argument("--from", dest="from_phase", help="first phase (generate build extract train export eval)")
    r.add_argument("--to", dest="to_phase", help="last phase")
    r.add_argument("--skip-preflight", action="store_true", help="no pre-flight gates (recorded in the manifest)")
    r.add_argument("--no-progress", action="store_true", help="plain log lines instead of progress bars")
    r.add_argument("--detach", action="store_true", help="run in the background (own session)")
    r.add_argument("--json", action="store_true", help="print each phase's result as JSON instead of the summary")
    r.set_defaults(func=_cmd_run)

    ev = sub.add_parser("eval", help="real speculative decoding: tau, acceptance per position, speedup; report")
    ev.add_argument("campaign", help="campaign.toml or campaign directory")
    ev.add_argument("--drafter", help="a drafter export or checkpoint dir (default: the campaign's newest)")
    ev.add_argument("--family", help="evaluate this drafter family only (default: every family of train.drafter)")
    ev.add_argument("--workers", type=int, metavar="N",
                    help="N processes share the prompts on the one device (overrides eval.workers; "
                         "tau and acceptance are exact, the speedup needs 1)")
    ev.add_argument("--batch-size", type=int, metavar="B",
                    help="B conversations per batched loop (overrides eval.batch_size; > 1: tau and acceptance "
                         "only, baseline off, one worker)")
    ev.add_argument("--served", action="store_true",
                    help="through the serving engine only: start [serve] with the drafter, then without it")
    ev.add_argument("--url", help="through this running server with the drafter (.../v1) only")
    ev.add_argument("--baseline-url", help="the same engine without the drafter (.../v1): the served speedup")
    ev.add_argument("--concurrency", type=int, metavar="N", help="the served eval's second throughput point "
                    "(overrides eval.served_concurrency)")
    ev.add_argument("--no-interop", action="store_true", help="skip the served-vs-loop interop check")
    ev.add_argument("--json", action="store_true", help="print the figures, the verdict and the report's path as JSON")
    ev.set_defaults(func=_cmd_eval)

    pf = sub.add_parser("preflight", help="can I start? every GPU, disk vs forecast, RAM, model files, ports")
    pf.add_argument("config", nargs="?", help="campaign.toml")
    pf.add_argument("--phases", help="comma-separated phases to forecast (default: generate,build,extract,train)")
    pf.add_argument("--gpus", type=int, default=0, help="GPUs the planned phases need (0: none required)")
    pf.add_argument("--ports", help="comma-separated ports that must be free")
    pf.add_argument("--json", action="store_true")
    pf.set_defaults(func=_cmd_preflight)

    h = sub.add_parser("health", help="tiered server check: tcp, /health, models, a real completion, the drafter, "
                                      "progress")
    h.add_argument("config", nargs="?", help="campaign.toml (endpoints, served model id, key variable)")
    h.add_argument("--url", help="an OpenAI base URL ending in /v1 (instead of, or overriding, the config)")
    h.add_argument("--model", help="the model id the server must list")
    h.add_argument("--api-key-env", help="NAME of the environment variable holding the API key")
    h.add_argument("--window", type=float, default=3.0, help="seconds between the two /metrics reads")
    h.add_argument("--completion-timeout", type=float, default=60.0)
    h.add_argument("--drafter", action="store_true",
                   help="the server must run a drafter: fail without spec-decode counters (default: check the "
                        "drafter where the server shows them)")
    h.add_argument("--drafter-probe-tokens", type=int, default=256,
                   help="tokens generated by the drafter tier's greedy probe")
    h.add_argument("--json", action="store_true")
    h.set_defaults(func=_cmd_health)

    sv = sub.add_parser("serve", help="launch vLLM/SGLang for the target, follow the load, stop it cleanly")
    sv.add_argument("config", help="campaign.toml ([target], [serve])")
    sv.add_argument("--detach", action="store_true", help="leave the server running once healthy")
    sv.add_argument("--stop", action="store_true", help="stop the server this campaign started")
    sv.add_argument("--features", action="store_true",
                    help="serve the target's EAGLE-3 hidden states for extract.mode = \"served\" (vLLM)")
    sv.set_defaults(func=_cmd_serve)

    rs = sub.add_parser("reset", help="archive (never delete) a phase's outputs and mark it pending")
    rs.add_argument("phase", help="generate, build, extract, train, export or eval")
    rs.add_argument("campaign", nargs="?", help="campaign directory or its campaign.toml (default: .)")
    rs.add_argument("--dataset", help="generate only: reset one dataset")
    rs.add_argument("--family", help="train, export or eval of this drafter family only (drafters/<family>/)")
    rs.set_defaults(func=_cmd_reset)

    sp = sub.add_parser("stop", help="stop a running (e.g. detached) phase gracefully")
    sp.add_argument("campaign", nargs="?", help="campaign directory or its campaign.toml (default: .)")
    sp.add_argument("--timeout", type=float, default=60.0)
    sp.add_argument("--force", action="store_true", help="SIGKILL after the timeout")
    sp.set_defaults(func=_cmd_stop)
    return p


def _sigterm_as_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


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
    # SIGTERM (`specops stop`, a scheduler, kill) stops like Ctrl-C from the first instruction on,
    # unwinding every `finally` (locks, temp files): phases that handle it themselves (generate's
    # graceful stop, serve) install their own handlers while they run and put this one back.
    # SIGINT is set too: Python leaves a SIGINT ignored at its start ignored (a shell without job
    # control ignores it for `cmd &`, and children inherit that), and Ctrl-C must still stop (130).
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return args.func(args)
    except SpecopsError as e:
        # Also into run/runner.log when a campaign log is attached (detached runs read it there).
        for h in logging.getLogger("specops").handlers:
            if isinstance(h, logging.FileHandler):
                h.handle(logging.makeLogRecord({"name": "specops", "levelno": logging.ERROR, "levelname": "ERROR",
                                                "msg": f"{type(e).__name__}: {e}"}))
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("Interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
