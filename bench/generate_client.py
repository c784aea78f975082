"""Benchmark `generate-client`: specops' runner vs the usual hand-written clients, same stub, same run.

Three clients send N chat requests at concurrency C to one loopback stub server
(specops.testing.fake_server, instant answers):
  openai   openai.AsyncOpenAI + asyncio.Semaphore (the usual hand-written campaign script)
  aiohttp  a bare aiohttp loop: post, read, json-decode; no bookkeeping at all
  specops  `run_generate` with its journal, stats, heartbeat and retry logic on
Reports requests/s for each and the ratios specops/openai and specops/aiohttp.

Also: peak RSS of the runner streaming a 10K- vs a 1M-prompt input (flat = streamed), and the time
to resume-scan a 1M-record journal (with and without a current stats.json).

    .venv/bin/python bench/generate_client.py [--n 20000] [--concurrency 150] [--skip-rss] [--skip-scan]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from specops.config import config_from_dict  # noqa: E402
from specops.generate import run_generate  # noqa: E402
from specops.generate.journal import Journal  # noqa: E402
from specops.testing.fake_server import start_fake_server  # noqa: E402

MESSAGES = [{"role": "user", "content": "Say something short."}]


async def bench_openai(url: str, n: int, conc: int) -> float:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
    sem = asyncio.Semaphore(conc)

    async def one(i: int) -> None:
        async with sem:
            r = await client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=16)
            assert r.choices[0].message.content

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    dt = time.perf_counter() - t0
    await client.close()
    return n / dt


async def bench_aiohttp(url: str, n: int, conc: int) -> float:
    sem = asyncio.Semaphore(conc)
    body = json.dumps({"model": "fake-model", "messages": MESSAGES, "max_tokens": 16})
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one(i: int) -> None:
            async with sem:
                async with s.post(url + "/chat/completions", data=body,
                                  headers={"Content-Type": "application/json"}) as r:
                    obj = json.loads(await r.read())
                    assert obj["choices"][0]["message"]["content"]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return n / (time.perf_counter() - t0)


def write_prompts(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            f.write('{"id": "q%d", "prompt": "Say something short, number %d."}\n' % (i, i))


def bench_specops(url: str, n: int, conc: int, work: Path) -> float:
    prompts = work / f"prompts_{n}.jsonl"
    write_prompts(prompts, n)
    camp = work / "camp_bench"
    shutil.rmtree(camp, ignore_errors=True)
    cfg = config_from_dict({
        "campaign": {"name": "bench", "dir": str(camp)},
        "target": {"served_name": "fake-model"},
        "engine": {"kind": "openai", "endpoints": [url]},
        "generate": {"concurrency": conc, "max_tokens": 16, "canary_samples": 0},
        "datasets": [{"name": "ds", "path": str(prompts)}],
    })
    t0 = time.perf_counter()
    s = run_generate(cfg, progress=False)
    dt = time.perf_counter() - t0
    assert s.datasets["ds"]["done"] == n, s.datasets
    return n / dt


def peak_rss_mb(url: str, n_prompts: int, seconds: float, work: Path) -> float:
    """Run the real CLI on an n-prompt input for `seconds`, SIGTERM it, return its peak RSS."""
    prompts = work / f"rss_{n_prompts}.jsonl"
    write_prompts(prompts, n_prompts)
    camp = work / f"camp_rss_{n_prompts}"
    shutil.rmtree(camp, ignore_errors=True)
    cfg = work / f"rss_{n_prompts}.toml"
    cfg.write_text(
        f'[campaign]\nname="rss"\ndir="{camp}"\n[target]\nserved_name="fake-model"\n'
        f'[engine]\nkind="openai"\nendpoints=["{url}"]\n[generate]\nconcurrency=150\nmax_tokens=16\ncanary_samples=0\n'
        f'[[datasets]]\nname="ds"\npath="{prompts}"\n'
    )
    code = (
        "import resource,subprocess,sys,time,signal;"
        "p=subprocess.Popen([sys.executable,'-m','specops','generate',sys.argv[1],'--no-progress'],"
        "stdout=subprocess.DEVNULL,stderr=subprocess.DEVNULL);"
        "time.sleep(float(sys.argv[2]));p.send_signal(signal.SIGTERM);p.wait();"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(cfg), str(seconds)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    return int(out.stdout.strip()) / 1024


def resume_scan_s(n: int, work: Path) -> tuple[float, float]:
    d = work / "scan"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    j = Journal(d, fsync_interval_s=3600).open()
    for i in range(n):
        j.append_record({"id": f"ds/{i:08d}", "dataset": "ds", "messages": [{"role": "user", "content": "q" * 80}],
                         "content": "a" * 200, "finish_reason": "stop",
                         "usage": {"prompt_tokens": 20, "completion_tokens": 60}, "latency_s": 1.5,
                         "finished_unix": 1.0})
    j.write_stats(n)
    j.close()
    t0 = time.perf_counter()
    j = Journal(d).open()
    fast = time.perf_counter() - t0
    assert len(j.done_ids) == n
    j.close()
    (d / "stats.json").unlink()
    t0 = time.perf_counter()
    j = Journal(d).open()
    full = time.perf_counter() - t0
    assert j.stats.done == n
    j.close()
    shutil.rmtree(d)
    return fast, full


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=2, help="alternate the clients this many times; best of")
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument("--skip-scan", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="specops-bench-"))
    res: dict[str, object] = {"n": args.n, "concurrency": args.concurrency, "machine": f"{os.cpu_count()} cores, {platform.machine()}"}
    try:
        with start_fake_server(work / "srv", model="fake-model") as srv:
            best = {"openai": 0.0, "aiohttp": 0.0, "specops": 0.0}
            for _ in range(args.rounds):
                best["openai"] = max(best["openai"], asyncio.run(bench_openai(srv.url, min(args.n, 5000), args.concurrency)))
                best["aiohttp"] = max(best["aiohttp"], asyncio.run(bench_aiohttp(srv.url, args.n, args.concurrency)))
                best["specops"] = max(best["specops"], bench_specops(srv.url, args.n, args.concurrency, work))
            res.update({f"{k}_req_per_s": round(v, 1) for k, v in best.items()})
            res["specops_over_openai"] = round(best["specops"] / best["openai"], 2)
            res["specops_over_aiohttp"] = round(best["specops"] / best["aiohttp"], 2)
            if not args.skip_rss:
                res["peak_rss_mb_10k"] = round(peak_rss_mb(srv.url, 10_000, 15, work), 1)
                res["peak_rss_mb_1m"] = round(peak_rss_mb(srv.url, 1_000_000, 15, work), 1)
        if not args.skip_scan:
            fast, full = resume_scan_s(1_000_000, work)
            res["resume_scan_1m_s"] = round(fast, 2)
            res["resume_scan_1m_no_stats_s"] = round(full, 2)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
