"""Tools of the reliability suite: campaigns on disk, the CLI as a subprocess, a fault-injecting TCP
proxy, a fillable disk, and the figures each item reports (RELIABILITY.md).

Everything talks to 127.0.0.1 only, and every wait is bounded in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

from specops.config import dump_toml

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
HOST = "127.0.0.1"
PROBE = "specops-health-probe"

# Environment switches (scripts/reliability.sh sets the first two).
FULL_ENV = "SPECOPS_RELIABILITY_FULL"  # 1: full trial counts
OUT_ENV = "SPECOPS_RELIABILITY_OUT"  # a JSONL file each item appends its figures to
SEED_ENV = "SPECOPS_RELIABILITY_SEED"  # seed of every random choice (kill points, delays)
STRICT_ENV = "SPECOPS_RELIABILITY_STRICT"  # 1: a known specops bug fails the test instead of xfail
NO_TMPFS_ENV = "SPECOPS_RELIABILITY_NO_TMPFS"  # 1: use the RLIMIT_FSIZE fallback for "disk full"
DEFAULT_SEED = 20240917


# ------------------------------------------------------------------------------------ figures


@dataclass
class Figures:
    """What one reliability item measured; appended as one JSON line to $SPECOPS_RELIABILITY_OUT."""

    item: str
    name: str
    nodeid: str
    full: bool
    seed: int
    trials: int = 0
    faults_injected: int = 0
    records_expected: int | None = None
    records_lost: int | None = None
    records_duplicated: int | None = None
    detection_s: list[float] = field(default_factory=list)
    detection_what: str = ""  # what detection_s measures, e.g. "stall flagged by status after"
    known_bugs: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    @property
    def command(self) -> str:
        env = f"{FULL_ENV}=1 " if self.full else ""
        return f"{env}HF_HUB_OFFLINE=1 .venv/bin/python -m pytest '{self.nodeid}'"

    def known_bug(self, ok: bool, message: str) -> None:
        """A check that specops currently fails for a known reason: recorded; `finish` turns it
        into an xfail (or a failure under SPECOPS_RELIABILITY_STRICT=1) after every other check."""
        if not ok and message not in self.known_bugs:
            self.known_bugs.append(message)

    def finish(self) -> None:
        if not self.known_bugs:
            return
        text = " | ".join(self.known_bugs)
        if os.environ.get(STRICT_ENV) == "1":
            pytest.fail(f"specops bug(s): {text}")
        pytest.xfail(f"known specops bug(s), everything else passed: {text}")

    def to_json(self, outcome: str) -> dict[str, Any]:
        det = sorted(self.detection_s)
        return {
            "item": self.item,
            "name": self.name,
            "test": self.nodeid,
            "command": self.command,
            "mode": "full" if self.full else "fast",
            "seed": self.seed,
            "outcome": outcome,
            "trials": self.trials,
            "faults_injected": self.faults_injected,
            "records_expected": self.records_expected,
            "records_lost": self.records_lost,
            "records_duplicated": self.records_duplicated,
            "detection_s": None if not det else {
                "what": self.detection_what, "n": len(det), "min": round(det[0], 2), "max": round(det[-1], 2),
                "mean": round(sum(det) / len(det), 2)},
            "known_bugs": self.known_bugs,
            "wall_s": round(time.monotonic() - self.started, 1),
            "details": self.details,
        }

    def write(self, outcome: str) -> None:
        out = os.environ.get(OUT_ENV)
        if not out:
            return
        line = json.dumps(self.to_json(outcome), default=str) + "\n"
        with open(out, "a") as f:
            f.write(line)


# ------------------------------------------------------------------------------------ campaigns


def write_prompts(path: Path, n: int, prefix: str = "q", words: int = 3) -> list[str]:
    """n prompt records with ids prefix0..; returns the sample ids (dataset 'ds')."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"{prefix}{i}", "prompt": " ".join(["tell me about", str(i)] * words)}) + "\n")
    return [f"ds/{prefix}{i}" for i in range(n)]


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def write_config(tmp: Path, url: str | None, prompts: Path, *, name: str = "rel", camp: Path | None = None,
                 datasets: list[dict[str, Any]] | None = None, **sections: dict[str, Any]) -> Path:
    """campaign.toml for an openai-engine campaign against `url` (fake-model), one dataset 'ds'."""
    base: dict[str, Any] = {
        "campaign": {"name": name, "dir": str(camp or tmp / "camp")},
        "target": {"served_name": "fake-model"},
        "engine": {"kind": "openai", "endpoints": [url] if url else [], "backoff_base_s": 0.05,
                   "backoff_max_s": 0.5},
        "generate": {"concurrency": 4, "max_tokens": 16, "heartbeat_interval_s": 0.25,
                     "fsync_interval_s": 0.0, "canary_samples": 0},
    }
    cfg = _merge(base, sections)
    cfg["datasets"] = datasets or [{"name": "ds", "path": str(prompts)}]
    path = tmp / f"{name}.toml"
    path.write_text(dump_toml(cfg))
    return path


@dataclass
class JournalView:
    ids: list[str]  # ids of the complete, parseable lines, in order
    torn_tail: bytes  # bytes after the last newline (an interrupted write; the next run repairs it)
    bad_lines: int  # complete lines that do not parse (must be 0)
    records: dict[str, dict[str, Any]]


def read_journal(path: Path, keep: bool = False) -> JournalView:
    if not path.exists():
        return JournalView([], b"", 0, {})
    data = path.read_bytes()
    cut = data.rfind(b"\n") + 1
    ids, bad, recs = [], 0, {}
    for line in data[:cut].split(b"\n")[:-1]:
        try:
            obj = json.loads(line)
            ids.append(obj["id"])
            if keep:
                recs[obj["id"]] = obj
        except (ValueError, KeyError, TypeError):
            bad += 1
    return JournalView(ids, data[cut:], bad, recs)


def count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


# ------------------------------------------------------------------------------------ the CLI


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    src = str(REPO / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def specops(*args: str, timeout: float = 120, env: dict[str, str] | None = None,
            **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "specops", *args], capture_output=True, text=True, timeout=timeout,
                          env=env or cli_env(), **kw)


def spawn(*args: str, log: Path, env: dict[str, str] | None = None, **kw: Any) -> subprocess.Popen:
    """`python -m specops ARGS` in the background, output appended to `log`."""
    with open(log, "ab") as out:
        return subprocess.Popen([PYTHON, "-m", "specops", *args], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env or cli_env(), **kw)


def status_json(camp: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    out = specops("status", str(camp), "--json", *extra, timeout=60)
    try:
        return out.returncode, json.loads(out.stdout)
    except ValueError:
        raise AssertionError(f"status --json printed no JSON (rc {out.returncode}): {out.stderr[-2000:]}") from None


def wait_for(pred: Callable[[], Any], timeout: float, step: float = 0.05, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not met within {timeout:g} s")
        time.sleep(step)


def kill_quietly(p: subprocess.Popen | None, sig: int = signal.SIGKILL) -> None:
    if p is not None and p.poll() is None:
        with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
            p.send_signal(sig)
            p.wait(timeout=30)


def pid_gone(pid: int) -> bool:
    """Exited: no such pid, or a zombie (its launcher, a detaching parent, is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


_LOG_LINE = re.compile(r"^(\d\d:\d\d:\d\d|\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d\S*) ")


def error_lines(stderr: str) -> list[str]:
    """Lines of a CLI's stderr that are neither log records nor progress bars."""
    out = []
    for line in stderr.splitlines():
        s = line.strip()
        if not s or _LOG_LINE.match(s) or "\r" in line or "it/s]" in s or "s/it]" in s:
            continue
        out.append(s)
    return out


# ------------------------------------------------------------------------------------ sockets


def listening_addresses(port: int) -> list[str]:
    """The local addresses of the LISTEN sockets on `port` (from /proc/net/tcp{,6})."""
    out: list[str] = []
    for name, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            rows = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            parts = row.split()
            if len(parts) < 4 or parts[3] != "0A":
                continue
            ip_hex, port_hex = parts[1].split(":")
            if int(port_hex, 16) != port:
                continue
            raw = bytes.fromhex(ip_hex)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # per-word host order
            out.append(socket.inet_ntop(family, raw))
    return out


class _Conn:
    def __init__(self, client: asyncio.StreamWriter):
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.held = False  # answers withheld from now on (until reset)
        self.dropped = 0  # request bytes read and never answered (mode "hang")
        self.released = asyncio.Event()


class FaultProxy:
    """A raw TCP server on 127.0.0.1 in front of an upstream port, run on an event loop in a thread.

    Modes (`set_mode`):
      pass        relay both ways
      hang        accept and hold: a new connection is never answered (nothing goes upstream);
                  on an open connection every byte from upstream is withheld from then on
      stall_body  requests go upstream; of each answer only the status line, the headers and the
                  first STALL_BODY_BYTES of the body reach the client, then nothing more
    `reset()` aborts every client connection (as a restarted server would), `seen()` returns every
    byte clients sent (when `sniff`), `stop()` closes everything.
    """

    STALL_BODY_BYTES = 16

    def __init__(self, upstream_port: int, *, port: int = 0, sniff: bool = False):
        self.upstream_port = upstream_port
        self.mode = "pass"
        self.accepted = 0
        self._sniff = bytearray() if sniff else None
        self._conns: set[_Conn] = set()
        self._want_port = port
        self.port = 0
        self._error: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            raise RuntimeError(f"fault proxy did not start: {self._error!r}")

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._handle, HOST, self._want_port, reuse_address=True))
            self.port = self._server.sockets[0].getsockname()[1]
        except BaseException as e:  # reported to the starting thread
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def set_mode(self, mode: str) -> None:
        assert mode in ("pass", "hang", "stall_body"), mode
        self.mode = mode

    def seen(self) -> bytes:
        assert self._sniff is not None, "FaultProxy(sniff=True)"
        return asyncio.run_coroutine_threadsafe(self._copy(), self._loop).result(10)

    async def _copy(self) -> bytes:
        return bytes(self._sniff or b"")

    def reset(self) -> int:
        """Abort every client connection now; returns how many there were."""
        return asyncio.run_coroutine_threadsafe(self._reset(), self._loop).result(10)

    async def _reset(self) -> int:
        conns = list(self._conns)
        for c in conns:
            c.released.set()
            c.client.transport.abort()
            if c.upstream is not None:
                c.upstream.transport.abort()
        self._conns.clear()
        return len(conns)

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def shutdown() -> None:
            self._server.close()
            await self._reset()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        c = _Conn(writer)
        self._conns.add(c)
        self.accepted += 1
        try:
            if self.mode == "hang":
                c.held = True  # the raw hung server: read and drop requests, never answer
                while chunk := await reader.read(1 << 16):
                    c.dropped += len(chunk)
                return
            up_reader, c.upstream = await asyncio.open_connection(HOST, self.upstream_port)
            await asyncio.gather(self._to_upstream(reader, c), self._to_client(up_reader, c),
                                 return_exceptions=True)
        except OSError:  # a client or upstream that went away: this connection is done
            return
        finally:
            self._conns.discard(c)
            for w in (c.client, c.upstream):
                if w is not None:
                    w.transport.abort()

    async def _to_upstream(self, reader: asyncio.StreamReader, c: _Conn) -> None:
        assert c.upstream is not None
        while data := await reader.read(1 << 16):
            if self._sniff is not None:
                self._sniff += data
            c.upstream.write(data)
            await c.upstream.drain()
        c.released.set()  # the client went away: nothing left to hold
        c.upstream.transport.abort()

    async def _to_client(self, reader: asyncio.StreamReader, c: _Conn) -> None:
        try:
            while data := await reader.read(1 << 16):
                if c.held:
                    continue
                if self.mode == "hang":
                    c.held = True
                    continue
                if self.mode == "stall_body":
                    end = data.find(b"\r\n\r\n")
                    cut = end + 4 + self.STALL_BODY_BYTES if end >= 0 else len(data) // 2
                    c.client.write(data[:cut])
                    await c.client.drain()
                    c.held = True
                    continue
                c.client.write(data)
                await c.client.drain()
        finally:
            if c.held:
                await c.released.wait()  # the client keeps waiting for the rest until a reset
            c.client.transport.abort()


# ------------------------------------------------------------------------------------ full disks


_TMPFS_OK: bool | None = None


def tmpfs_available(scratch: Path) -> bool:
    """Whether this process may mount a tmpfs (root, mount allowed here) and the fallback is not forced."""
    global _TMPFS_OK
    if os.environ.get(NO_TMPFS_ENV) == "1":
        return False
    if _TMPFS_OK is None:
        _TMPFS_OK = False
        if os.geteuid() == 0:
            probe = scratch / ".tmpfs-probe"
            probe.mkdir(parents=True, exist_ok=True)
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
                               capture_output=True, timeout=30)
            if r.returncode == 0:
                subprocess.run(["umount", str(probe)], capture_output=True, timeout=30)
                _TMPFS_OK = True
    return _TMPFS_OK


class SmallDisk:
    """A tmpfs of `size` mounted at `path`: a real filesystem that really fills up (ENOSPC)."""

    def __init__(self, path: Path, size: str):
        self.path = path
        self.filler = path / ".filler"
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True,
                       capture_output=True, timeout=30)

    def resize(self, size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True,
                       capture_output=True, timeout=30)

    def fill(self) -> int:
        """Write a filler file until the filesystem is full (every block taken). Returns bytes written."""
        total = 0
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            for size in (1 << 20, 1 << 16, 4096, 512, 64, 8, 1):
                buf = b"\0" * size
                for _ in range(100_000):  # bounded: the disk is small
                    try:
                        total += os.write(fd, buf)
                    except OSError as e:
                        if e.errno in (errno.ENOSPC, errno.EFBIG):
                            break
                        raise
        finally:
            os.close(fd)
        return total

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        r = subprocess.run(["umount", str(self.path)], capture_output=True, timeout=30)
        if r.returncode != 0:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=30)


def rlimit_fsize(limit: int) -> Callable[[], None]:
    """preexec_fn: files of the child may not grow past `limit` bytes (EFBIG, SIGXFSZ ignored)."""

    def pre() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return pre


# ------------------------------------------------------------------------------------ extract inputs


def make_tiny_llama(path: Path, hidden: int = 128, layers: int = 8, vocab: int = 512) -> Path:
    """A random-weight Llama saved as an HF directory (big enough that a shard takes visible time)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


def make_extract_campaign(root: Path, model_dir: Path, n_samples: int = 60, seed: int = 7,
                          vocab: int = 512, **extract: Any):
    """A campaign directory with build/{train,val}.safetensors (the fixed build format) ready to extract."""
    import torch
    from safetensors.torch import save_file

    from specops.campaign import Campaign
    from specops.config import config_from_dict

    root.mkdir(parents=True, exist_ok=True)
    prompts = root.parent / f"{root.name}-prompts.jsonl"
    prompts.write_text('{"id": "q0", "prompt": "hi"}\n')
    cfg = config_from_dict({
        "campaign": {"name": root.name, "dir": str(root)},
        "target": {"model": str(model_dir)},
        "datasets": [{"name": "d", "path": str(prompts)}],
        "extract": {"shard_tokens": 800, "token_budget": 512, **extract},
    })
    camp = Campaign.create_or_open(cfg)
    g = torch.Generator().manual_seed(seed)
    lengths = {"train": torch.randint(20, 151, (n_samples,), generator=g).tolist(), "val": [5]}
    build = camp.root / "build"
    build.mkdir(exist_ok=True)
    for split, lens in lengths.items():
        total = sum(lens)
        offsets = torch.zeros(len(lens) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
        save_file({"input_ids": torch.randint(0, vocab, (total,), generator=g, dtype=torch.int32),
                   "loss_mask": (torch.rand(total, generator=g) > 0.3).to(torch.uint8), "offsets": offsets},
                  str(build / f"{split}.safetensors"))
        with open(build / f"{split}.ids.jsonl", "w") as f:
            for i, k in enumerate(lens):
                f.write(json.dumps({"id": f"d/{split}{i}", "dataset": "d", "n_tokens": k, "n_trainable": k}) + "\n")
    return camp, lengths


def digest_of(path: Path, unit: int = 64 << 20) -> str:
    """A shard's recorded digest, computed here independently: sha256 over the concatenated sha256
    digests of the file's consecutive 64 MiB pieces (extract.DIGEST_KIND)."""
    import hashlib

    parts = []
    with open(path, "rb") as f:
        while True:
            h = hashlib.sha256()
            piece = f.read(unit)
            h.update(piece)
            if piece or not parts:
                parts.append(h.digest())
            if len(piece) < unit:
                break
    return hashlib.sha256(b"".join(parts)).hexdigest()


def shard_state(split_dir: Path) -> dict[str, Any]:
    """Finished shards (final name + matching .done sidecar), final names without a valid sidecar,
    and temp files, of one features/<split> directory."""
    finished, orphans = {}, []
    for p in sorted(split_dir.glob("shard-*.safetensors")):
        done_path = split_dir / (p.name + ".done")
        try:
            done = json.loads(done_path.read_text())
        except (FileNotFoundError, ValueError):
            orphans.append(p.name)
            continue
        if done.get("bytes") != p.stat().st_size or done.get("digest") != digest_of(p):
            orphans.append(p.name)
            continue
        finished[p.name] = (done["digest"], p.stat().st_mtime_ns)
    temps = sorted(q.name for q in split_dir.glob(".*")) if split_dir.is_dir() else []
    return {"finished": finished, "orphans": orphans, "temps": temps}
