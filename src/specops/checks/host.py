"""Host pre-flight: disk vs forecast, RAM and swap, model files, ports.

Each check returns `CheckResult`s and takes its system access as a parameter (disk_usage, the
meminfo path) so tests can script a full disk or low memory without owning one.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ..target import TEXT_CONFIG_KEYS, text_config
from .result import CheckResult, fmt_bytes

DiskUsage = Callable[[str], Any]  # shutil.disk_usage's shape: .total .used .free

DISK_WARN_FRAC = 0.8  # forecast above 80 % of free space: warn
MEM_WARN_FRAC = 0.10  # MemAvailable below 10 % of MemTotal: warn
MEM_WARN_MIN = 4 * 10**9  # ... or below 4 GB
SWAP_WARN_FRAC = 0.25  # more than a quarter of swap in use: the host is already swapping

SAFETENSORS_MAX_HEADER = 100 * 2**20  # the format's own limit on the JSON header
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model", "vocab.txt")


# ============================================================================ disk


def nearest_existing(path: Path) -> Path:
    """`path` or its closest existing ancestor (outputs are created later by their phase)."""
    p = Path(os.path.abspath(path))
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    return p


def check_disk(
    outputs: Sequence[tuple[str, Path, int]], *, disk_usage: DiskUsage = shutil.disk_usage
) -> list[CheckResult]:
    """Forecast bytes vs free space, per filesystem.

    `outputs`: (phase, output directory, forecast bytes). Directories on one filesystem share its
    free space, so their forecasts are summed before comparing: no-go if the sum exceeds free
    space, warn above 80 % of it.
    """
    groups: dict[Any, list[tuple[str, Path, int, Path]]] = {}
    for phase, path, need in outputs:
        anc = nearest_existing(Path(path))
        try:
            key: Any = os.stat(anc).st_dev
        except OSError:
            key = str(anc)
        groups.setdefault(key, []).append((phase, Path(path), int(need), anc))

    results = []
    for items in groups.values():
        anc = items[0][3]
        phases = [i[0] for i in items]
        name = "disk." + "+".join(phases)
        need = sum(i[2] for i in items)
        try:
            free = int(disk_usage(str(anc)).free)
        except OSError as e:
            results.append(CheckResult(name, "nogo", f"{anc}: cannot read free space: {e}", {"path": str(anc)}))
            continue
        parts = ", ".join(f"{i[0]} {fmt_bytes(i[2])}" for i in items)
        data = {"path": str(anc), "free": free, "forecast": need, "by_phase": {i[0]: i[2] for i in items},
                "outputs": {i[0]: str(i[1]) for i in items}}
        where = f"{anc}: forecast {fmt_bytes(need)} ({parts}) vs {fmt_bytes(free)} free"
        if need > free:
            results.append(CheckResult(name, "nogo", f"{where}: does not fit, short by {fmt_bytes(need - free)}", data))
        elif need > DISK_WARN_FRAC * free:
            results.append(CheckResult(name, "warn", f"{where}: over {DISK_WARN_FRAC:.0%} of free space", data))
        else:
            results.append(CheckResult(name, "go", where, data))
    return results


# ============================================================================ memory


def read_meminfo(path: str | os.PathLike[str] = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo as bytes per key ("MemAvailable: 123 kB" -> 125952)."""
    out: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if not fields or not fields[0].isdigit():
            continue
        out[key.strip()] = int(fields[0]) * (1024 if len(fields) > 1 and fields[1].lower() == "kb" else 1)
    return out


def check_memory(meminfo: str | os.PathLike[str] = "/proc/meminfo") -> list[CheckResult]:
    """RAM available and swap in use. Low memory warns; it is not a no-go (needs vary by phase).

    MemTotal can under-report on ballooning VMs (memory grows as it is used), so "low" is a hint.
    """
    try:
        mi = read_meminfo(meminfo)
    except OSError as e:
        return [CheckResult("memory", "info", f"cannot read {meminfo}: {e}")]
    total, avail = mi.get("MemTotal"), mi.get("MemAvailable")
    swap_total, swap_free = mi.get("SwapTotal", 0), mi.get("SwapFree", 0)
    data = {"mem_total": total, "mem_available": avail, "swap_total": swap_total, "swap_free": swap_free}
    results = []
    if total is None or avail is None:
        results.append(CheckResult("memory", "info", f"{meminfo} has no MemTotal/MemAvailable", data))
    else:
        msg = f"RAM {fmt_bytes(avail)} available of {fmt_bytes(total)}"
        low = avail < MEM_WARN_FRAC * total or avail < MEM_WARN_MIN
        results.append(CheckResult("memory", "warn" if low else "go", msg + (": low" if low else ""), data))
    used_swap = swap_total - swap_free
    if swap_total:
        msg = f"swap {fmt_bytes(used_swap)} used of {fmt_bytes(swap_total)}"
        heavy = used_swap > SWAP_WARN_FRAC * swap_total
        msg += ": the host is swapping" if heavy else ""
        results.append(CheckResult("swap", "warn" if heavy else "go", msg, data))
    else:
        results.append(CheckResult("swap", "info", "no swap configured", data))
    return results


# ============================================================================ model files


def _read_json_file(path: Path) -> tuple[Any, str | None]:
    try:
        return json.loads(path.read_bytes()), None
    except FileNotFoundError:
        return None, f"{path}: missing"
    except OSError as e:
        return None, f"{path}: cannot read: {e.strerror or e}"
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"{path}: not valid JSON: {e}"


def inspect_safetensors(path: Path) -> str | None:
    """None if the file's header parses and its tensors fit in the file, else what is wrong.

    Layout: u64 little-endian N, N bytes of JSON {name: {dtype, shape, data_offsets}}, data. A
    download cut short keeps a valid header whose last data offset runs past the end of the file.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path}: {size} bytes, too short for a safetensors header"
            (n,) = struct.unpack("<Q", head)
            if n > min(SAFETENSORS_MAX_HEADER, size - 8):
                return f"{path}: header length {n} does not fit in {size} bytes (not safetensors, or truncated)"
            header = json.loads(f.read(n))
    except OSError as e:
        return f"{path}: cannot read: {e.strerror or e}"
    except (ValueError, UnicodeDecodeError) as e:
        return f"{path}: safetensors header is not valid JSON: {e}"
    if not isinstance(header, dict):
        return f"{path}: safetensors header is not a JSON object"
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)
               and "data_offsets" in v), default=0)
    if 8 + n + end > size:
        return f"{path}: truncated: tensors end at byte {8 + n + end}, file has {size}"
    return None


def _inspect_bin(path: Path) -> str | None:
    # torch.save files are zip archives ("PK"); legacy ones start with a pickle protocol byte.
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        return f"{path}: cannot read: {e.strerror or e}"
    if not (head.startswith(b"PK") or head[:1] == b"\x80"):
        return f"{path}: not a torch checkpoint (starts with {head!r})"
    return None


def check_model(model_dir: Path, *, tokenizer_dir: Path | None = None, need_tokenizer: bool = True
                ) -> tuple[list[CheckResult], dict[str, Any] | None]:
    """config.json (nested text config too), weight files and tokenizer of an HF model directory.

    Returns the results and the parsed config.json (None when unreadable) for the forecast.
    """
    model_dir = Path(model_dir)
    results: list[CheckResult] = []
    cfg_path = model_dir / "config.json"
    config, err = _read_json_file(cfg_path)
    if err is None and not isinstance(config, dict):
        config, err = None, f"{cfg_path}: expected a JSON object, got {type(config).__name__}"
    if err is not None:
        results.append(CheckResult("model.config", "nogo", err, {"path": str(cfg_path)}))
        config = None
    else:
        tc = text_config(config)
        nested = next((k for k in TEXT_CONFIG_KEYS if config.get(k) is tc), None)
        shape = {k: tc.get(k) for k in ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size")}
        arch = (config.get("architectures") or [config.get("model_type", "?")])[0]
        where = f" (from {nested})" if nested else ""
        data = {"path": str(cfg_path), "architecture": arch, "text_config_key": nested, **shape}
        missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if not isinstance(shape[k], int)]
        if missing:
            results.append(CheckResult("model.config", "nogo",
                                       f"{cfg_path}: no {', '.join(missing)} (top level or text_config)", data))
        else:
            results.append(CheckResult(
                "model.config", "go",
                f"{arch}: hidden_size {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
                f"vocab {shape['vocab_size']}{where}", data))

    results.append(_check_weights(model_dir))
    results.append(_check_tokenizer(tokenizer_dir or model_dir, need_tokenizer))
    return results, config


def _check_weights(model_dir: Path) -> CheckResult:
    files = sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin"))
    problems: list[str] = []
    for idx_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        idx, err = _read_json_file(model_dir / idx_name)
        if idx is None:
            if err and not err.endswith("missing"):
                problems.append(err)
            continue
        shards = sorted(set((idx.get("weight_map") or {}).values())) if isinstance(idx, dict) else []
        problems += [f"{model_dir / s}: listed in {idx_name} but missing"
                     for s in shards if not (model_dir / s).is_file()]
    if not files and not problems:
        return CheckResult("model.weights", "nogo", f"{model_dir}: no *.safetensors or *.bin weight files",
                           {"path": str(model_dir)})
    total = 0
    for f in files:
        problem = inspect_safetensors(f) if f.suffix == ".safetensors" else _inspect_bin(f)
        if problem:
            problems.append(problem)
        else:
            total += f.stat().st_size
    data = {"path": str(model_dir), "files": len(files), "bytes": total}
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return CheckResult("model.weights", "nogo", problems[0] + more, {**data, "problems": problems})
    msg = f"{len(files)} weight file(s), {fmt_bytes(total)}, headers readable"
    return CheckResult("model.weights", "go", msg, data)


def _check_tokenizer(tok_dir: Path, need: bool) -> CheckResult:
    found = [n for n in TOKENIZER_FILES if (tok_dir / n).is_file()]
    data = {"path": str(tok_dir), "files": found}
    if not found:
        return CheckResult("model.tokenizer", "nogo" if need else "warn",
                           f"{tok_dir}: no tokenizer file ({', '.join(TOKENIZER_FILES)})", data)
    for n in found:
        try:
            with open(tok_dir / n, "rb") as f:
                f.read(1)
        except OSError as e:
            return CheckResult("model.tokenizer", "nogo", f"{tok_dir / n}: cannot read: {e.strerror or e}", data)
    if (tok_dir / "tokenizer.json").is_file():
        _, err = _read_json_file(tok_dir / "tokenizer.json")
        if err:
            return CheckResult("model.tokenizer", "nogo", err, data)
    return CheckResult("model.tokenizer", "go", f"tokenizer: {', '.join(found)}", data)


# ============================================================================ ports


def check_ports(ports: Iterable[int], *, host: str = "127.0.0.1") -> list[CheckResult]:
    """Each port a server will listen on must be free: try to bind it (SO_REUSEADDR, as servers
    do, so a port in TIME_WAIT from a stopped server counts as free)."""
    results = []
    for port in ports:
        name = f"port.{port}"
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, int(port)))
        except OSError as e:
            why = "in use" if e.errno == errno.EADDRINUSE else f"cannot bind ({e.strerror or e})"
            results.append(CheckResult(name, "nogo", f"port {port} on {host} is {why}",
                                       {"host": host, "port": port, "errno": e.errno}))
        else:
            results.append(CheckResult(name, "go", f"port {port} on {host} is free", {"host": host, "port": port}))
        finally:
            s.close()
    return results

