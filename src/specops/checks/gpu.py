"""GPU pre-flight through NVML: describe every GPU, then judge whether the plan can use it.

Two halves, so the judgement is tested without a GPU:

* a `GpuSource` describes the host: `NvmlSource` asks the driver, `RecordedSource` replays a JSON
  description written by `record_devices` on a real machine (tests/fixtures/gpus/*.json);
* `assess_gpus(devices, ...)` turns the description into `CheckResult`s.

A device description is a plain dict (JSON as written by `record_devices`):

    index, name, uuid, pci_bus_id
    memory        {total, used, free, reserved}  bytes; reserved is None without nvmlMemory_v2
                  (then `used` includes the driver's reservation)
    utilization   {gpu, memory}  percent over the driver's last sample period
    processes     [{pid, name, used_memory}]  compute processes; pids are the host's pid namespace
    compute_mode  "DEFAULT" | "EXCLUSIVE_THREAD" | "PROHIBITED" | "EXCLUSIVE_PROCESS"
    mig           {current, pending}  booleans
    ecc_uncorrected {volatile, aggregate}  counts (volatile: since the last driver load/reset)
    retired_pages_pending  bool  (pre-Ampere page retirement waiting for a reset)
    remapped_rows {correctable, uncorrectable, pending, failure}  (Ampere+ row remapping)
    throttle      {mask, reasons}  current clock-event reasons; `reasons` decodes `mask`
    temperature_c, power_w, power_limit_w
    errors        {field: {code, message}}  NVML errors other than "not supported"

Any field NVML does not support on this GPU/driver is None; nothing here raises for that.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from .result import SEVERITY, CheckResult, fmt_bytes

__all__ = [
    "GpuSource",
    "GpuUnavailable",
    "NvmlSource",
    "RecordedSource",
    "assess_gpus",
    "check_gpus",
    "decode_throttle",
    "record_devices",
    "snapshot",
    "visible_indices",
]


class GpuUnavailable(Exception):
    """NVML cannot be used on this host (no driver, no library, init failed). str() says why."""


class GpuSource(Protocol):
    def describe(self) -> dict[str, Any]:
        """{"driver_version": str | None, "devices": [device dict, ...]}; raises GpuUnavailable."""
        ...


# ============================================================================ decoding tables

# nvmlClocksEventReason* bits (formerly nvmlClocksThrottleReason*), nvml.h.
THROTTLE_BITS: dict[int, str] = {
    0x001: "gpu_idle",
    0x002: "applications_clocks_setting",
    0x004: "sw_power_cap",
    0x008: "hw_slowdown",
    0x010: "sync_boost",
    0x020: "sw_thermal_slowdown",
    0x040: "hw_thermal_slowdown",
    0x080: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
    0x200: "board_limit",
    0x400: "reliability",
}
# Reasons that mean the GPU runs slower than it should for reasons outside our job: heat, the
# board's slowdown signal, an external power brake. sw_power_cap under load and gpu_idle are normal.
SLOWDOWN_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown")

COMPUTE_MODES = {0: "DEFAULT", 1: "EXCLUSIVE_THREAD", 2: "PROHIBITED", 3: "EXCLUSIVE_PROCESS"}


def decode_throttle(mask: int | None) -> list[str] | None:
    """Names of the set bits of a clock-event mask, unknown bits as "unknown_0x..."."""
    if mask is None:
        return None
    names = [name for bit, name in THROTTLE_BITS.items() if mask & bit]
    rest = mask & ~sum(THROTTLE_BITS)
    if rest:
        names.append(f"unknown_{rest:#x}")
    return names


# ============================================================================ sources


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _proc_name(pid: int, nvml_name: Callable[[int], Any] | None) -> str | None:
    # /proc/<pid>/comm is the short name ("python3"). In a container the pid NVML reports lives in
    # the host's namespace and may be absent here; then ask the driver.
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() or None
    except OSError:
        pass
    if nvml_name is not None:
        try:
            return _text(nvml_name(pid))
        except Exception:  # noqa: BLE001 - a name is evidence, never a reason to fail the check
            return None
    return None


class NvmlSource:
    """The real host, through nvidia-ml-py. Each describe() is one init/shutdown cycle (~50 ms)."""

    def describe(self) -> dict[str, Any]:
        try:
            import pynvml as nv
        except ImportError as e:
            raise GpuUnavailable(f"nvidia-ml-py is not installed: {e}") from e
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            raise GpuUnavailable(f"NVML: {e}") from e
        try:
            driver = self._call(nv, {}, "driver_version", nv.nvmlSystemGetDriverVersion)
            count = nv.nvmlDeviceGetCount()
            return {
                "driver_version": _text(driver) if driver is not None else None,
                "devices": [self._device(nv, i) for i in range(count)],
            }
        except nv.NVMLError as e:
            raise GpuUnavailable(f"NVML: {e}") from e
        finally:
            try:
                nv.nvmlShutdown()
            except nv.NVMLError:
                pass

    @staticmethod
    def _call(nv: Any, errors: dict[str, Any], field: str, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), or None when NVML cannot answer; unexpected errors are kept as evidence."""
        try:
            return fn(*args)
        except nv.NVMLError as e:
            if e.value not in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
                errors[field] = {"code": int(e.value), "message": str(e)}
            return None

    def _device(self, nv: Any, i: int) -> dict[str, Any]:
        errors: dict[str, Any] = {}
        dev: dict[str, Any] = {"index": i, "errors": errors}
        h = self._call(nv, errors, "handle", nv.nvmlDeviceGetHandleByIndex, i)
        if h is None:
            return dev
        q = lambda field, fn, *a: self._call(nv, errors, field, fn, h, *a)  # noqa: E731

        name, uuid = q("name", nv.nvmlDeviceGetName), q("uuid", nv.nvmlDeviceGetUUID)
        dev["name"] = _text(name) if name is not None else None
        dev["uuid"] = _text(uuid) if uuid is not None else None
        pci = q("pci_bus_id", nv.nvmlDeviceGetPciInfo)
        dev["pci_bus_id"] = _text(pci.busId) if pci is not None else None

        # v2 splits the driver's reservation out of `used`; drivers before r510 lack it.
        v2 = getattr(nv, "nvmlMemory_v2", None)
        mem = self._call(nv, {}, "memory", nv.nvmlDeviceGetMemoryInfo, h, v2) if v2 else None
        if mem is not None:
            dev["memory"] = {"total": mem.total, "used": mem.used, "free": mem.free, "reserved": mem.reserved}
        else:
            mem = q("memory", nv.nvmlDeviceGetMemoryInfo)
            dev["memory"] = (
                {"total": mem.total, "used": mem.used, "free": mem.free, "reserved": None} if mem is not None else None
            )

        util = q("utilization", nv.nvmlDeviceGetUtilizationRates)
        dev["utilization"] = {"gpu": util.gpu, "memory": util.memory} if util is not None else None

        procs = q("processes", nv.nvmlDeviceGetComputeRunningProcesses)
        nvml_name = getattr(nv, "nvmlSystemGetProcessName", None)
        dev["processes"] = (
            [{"pid": int(p.pid), "name": _proc_name(int(p.pid), nvml_name), "used_memory": p.usedGpuMemory}
             for p in procs]
            if procs is not None
            else None
        )

        mode = q("compute_mode", nv.nvmlDeviceGetComputeMode)
        dev["compute_mode"] = COMPUTE_MODES.get(mode, str(mode)) if mode is not None else None

        mig = q("mig", nv.nvmlDeviceGetMigMode)
        dev["mig"] = {"current": bool(mig[0]), "pending": bool(mig[1])} if mig is not None else None

        unc = nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        vol = q("ecc_uncorrected.volatile", nv.nvmlDeviceGetTotalEccErrors, unc, nv.NVML_VOLATILE_ECC)
        agg = q("ecc_uncorrected.aggregate", nv.nvmlDeviceGetTotalEccErrors, unc, nv.NVML_AGGREGATE_ECC)
        dev["ecc_uncorrected"] = None if vol is None and agg is None else {"volatile": vol, "aggregate": agg}

        pend = q("retired_pages_pending", nv.nvmlDeviceGetRetiredPagesPendingStatus)
        dev["retired_pages_pending"] = bool(pend) if pend is not None else None
        rows = q("remapped_rows", nv.nvmlDeviceGetRemappedRows)
        dev["remapped_rows"] = (
            {"correctable": rows[0], "uncorrectable": rows[1], "pending": bool(rows[2]), "failure": bool(rows[3])}
            if rows is not None
            else None
        )

        # Renamed "clocks event reasons" in r535; older drivers only have the throttle name.
        mask = q("throttle", getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
                 or nv.nvmlDeviceGetCurrentClocksThrottleReasons)
        if mask is None and "throttle" not in errors:
            mask = q("throttle", nv.nvmlDeviceGetCurrentClocksThrottleReasons)
        dev["throttle"] = {"mask": int(mask), "reasons": decode_throttle(int(mask))} if mask is not None else None

        dev["temperature_c"] = q("temperature_c", nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU)
        power = q("power_w", nv.nvmlDeviceGetPowerUsage)  # milliwatts
        dev["power_w"] = power / 1000 if power is not None else None
        limit = q("power_limit_w", nv.nvmlDeviceGetEnforcedPowerLimit)
        dev["power_limit_w"] = limit / 1000 if limit is not None else None
        return dev


class RecordedSource:
    """Replays a description written by `record_devices` (or a bare list of device dicts).

    A recording of a host without a driver holds {"nvml_error": "..."} and replays as
    GpuUnavailable, so the no-driver path is testable too.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)

    def describe(self) -> dict[str, Any]:
        data = json.loads(self.path.read_text())
        if isinstance(data, list):
            return {"driver_version": None, "devices": data}
        if data.get("nvml_error"):
            raise GpuUnavailable(data["nvml_error"])
        return {"driver_version": data.get("driver_version"), "devices": list(data["devices"])}


def record_devices(path: str | os.PathLike[str], source: GpuSource | None = None) -> dict[str, Any]:
    """Write this host's device description to `path` (JSON) and return it.

    On a GPU machine: `python -m specops.checks.gpu --record h200.json`. Without a driver the file
    records the NVML error instead of devices.
    """
    import datetime as dt

    from ..campaign import atomic_write_json

    src = source if source is not None else NvmlSource()
    meta = {"host": socket.gethostname(), "recorded_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    try:
        desc = {**meta, **src.describe()}
    except GpuUnavailable as e:
        desc = {**meta, "nvml_error": str(e), "devices": []}
    atomic_write_json(Path(path), desc)
    return desc


def snapshot(source: GpuSource | None = None) -> list[dict[str, Any]]:
    """Per-GPU memory and utilization for `status`. Raises GpuUnavailable without a driver."""
    src = source if source is not None else NvmlSource()
    out = []
    for d in src.describe()["devices"]:
        mem = d.get("memory") or {}
        util = d.get("utilization") or {}
        out.append({
            "index": d["index"],
            "name": d.get("name"),
            "memory_used": mem.get("used"),
            "memory_total": mem.get("total"),
            "utilization_gpu": util.get("gpu"),
            "utilization_memory": util.get("memory"),
            "processes": len(d["processes"]) if d.get("processes") is not None else None,
        })
    return out


# ============================================================================ judgement


def visible_indices(devices: Sequence[Mapping[str, Any]], cuda_visible_devices: str | None) -> list[int] | None:
    """NVML indices named by CUDA_VISIBLE_DEVICES, in CUDA's order; None when the variable is unset.

    Entries are indices or (prefixes of) GPU UUIDs; like CUDA, parsing stops at the first entry that
    names no device. Integer entries are taken as NVML (PCI bus) order, which is CUDA's order on
    hosts of one GPU model or with CUDA_DEVICE_ORDER=PCI_BUS_ID.
    """
    if cuda_visible_devices is None:
        return None
    by_index = {int(d["index"]): d for d in devices}
    out: list[int] = []
    for raw in cuda_visible_devices.split(","):
        tok = raw.strip()
        if tok.lstrip("-").isdigit():
            i = int(tok)
            if i not in by_index:
                break
            out.append(i)
            continue
        match = [i for i, d in by_index.items() if tok and str(d.get("uuid") or "").startswith(tok)]
        if len(match) != 1:
            break
        out.append(match[0])
    return out


def _gpu_label(d: Mapping[str, Any]) -> str:
    return f"GPU {d['index']}" + (f" ({d['name']})" if d.get("name") else "")


def _procs_text(procs: Iterable[Mapping[str, Any]]) -> str:
    parts = []
    for p in procs:
        s = f"pid {p['pid']}"
        if p.get("name"):
            s += f" {p['name']}"
        if p.get("used_memory") is not None:
            s += f" ({fmt_bytes(p['used_memory'])})"
        parts.append(s)
    return ", ".join(parts)


# Each problem: (status when the plan uses the GPU, status when it does not, text). Hardware
# faults stay a warning outside the plan (someone should know); occupancy there is only evidence.
Problem = tuple[str, str, str]


def _problems(d: Mapping[str, Any], busy_mem_frac: float) -> tuple[list[Problem], bool]:
    """The problems of one GPU, and whether it is busy."""
    out: list[Problem] = []
    errors = d.get("errors") or {}
    if "handle" in errors:
        return [("nogo", "warn", f"cannot be queried (NVML: {errors['handle'].get('message')})")], False

    procs = d.get("processes") or []
    mem = d.get("memory") or {}
    used, total = mem.get("used"), mem.get("total")
    mem_busy = used is not None and bool(total) and used > busy_mem_frac * total
    busy = bool(procs) or mem_busy
    if busy:
        text = f"busy: {fmt_bytes(used)} of {fmt_bytes(total)} used"
        text += f" by {_procs_text(procs)}" if procs else "; no compute process visible (another container?)"
        out.append(("nogo", "info", text))

    mode = d.get("compute_mode")
    if mode == "PROHIBITED":
        out.append(("nogo", "info", "compute mode PROHIBITED: no CUDA context can be created"))
    elif mode in ("EXCLUSIVE_PROCESS", "EXCLUSIVE_THREAD") and procs:
        out.append(("nogo", "info", f"compute mode {mode} and already held by pid {procs[0]['pid']}"))

    ecc = d.get("ecc_uncorrected") or {}
    if ecc.get("volatile"):
        out.append(("nogo", "warn", f"{ecc['volatile']} uncorrected ECC error(s) since the last reset"))
    elif ecc.get("aggregate"):
        # Lifetime counter: an old error since retired/remapped leaves it > 0 forever.
        text = f"{ecc['aggregate']} uncorrected ECC error(s) in the GPU's lifetime, none since reset"
        out.append(("warn", "warn", text))
    if d.get("retired_pages_pending"):
        out.append(("nogo", "warn", "retired pages pending: reset the GPU before use"))
    rows = d.get("remapped_rows") or {}
    if rows.get("failure"):
        out.append(("nogo", "warn", "row remapping failed: the GPU needs service"))
    elif rows.get("pending"):
        out.append(("warn", "warn", "row remap pending: reset the GPU to apply it"))

    mig = d.get("mig") or {}
    if mig.get("current"):
        out.append(("warn", "info", "MIG is enabled: processes see MIG instances, not the whole GPU"))
    if mig and bool(mig.get("pending")) != bool(mig.get("current")):
        change = "enable" if mig.get("pending") else "disable"
        out.append(("warn", "info", f"MIG mode change pending ({change} at reset)"))

    thr = d.get("throttle") or {}
    reasons = decode_throttle(thr["mask"]) if thr.get("mask") is not None else thr.get("reasons") or []
    slow = [r for r in reasons if r in SLOWDOWN_REASONS]
    if slow:
        temp = d.get("temperature_c")
        text = f"clocks throttled: {', '.join(slow)}" + (f" at {temp} °C" if temp is not None else "")
        out.append(("warn", "info", text))

    for field, err in errors.items():
        lost = "lost" in str(err.get("message", "")).lower()
        out.append(("nogo" if lost else "warn", "warn" if lost else "info", f"NVML {field}: {err.get('message')}"))
    return out, busy


def assess_gpus(
    devices: Sequence[Mapping[str, Any]],
    *,
    need_gpus: int = 0,
    use: Sequence[int] | None = None,
    busy_mem_frac: float = 0.05,
    driver_version: str | None = None,
) -> list[CheckResult]:
    """Judge every GPU: a "gpus" summary, then one "gpu<i>" result per device.

    `use`: NVML indices in the order the planned phases take them (CUDA_VISIBLE_DEVICES); the
    plan runs on the first `need_gpus` (default: GPUs 0..need_gpus-1). Busy (any compute process,
    or more than `busy_mem_frac` of memory used, the driver's reservation excluded where NVML
    reports it), compute mode PROHIBITED/EXCLUSIVE with a holder, volatile uncorrected ECC errors,
    pending retired pages and failed row remapping are no-go on a GPU in the plan; MIG and
    slowdown throttling are warnings. Outside the plan occupancy is info and faults are warnings,
    so a stray process on GPU 3 stops a 4-GPU job on GPUs 0-3 but not a 1-GPU job on GPU 0.
    """
    ordered = sorted(devices, key=lambda d: int(d["index"]))
    order = list(use) if use is not None else [int(d["index"]) for d in ordered]
    planned = order[:need_gpus]

    per_gpu: list[CheckResult] = []
    unusable: list[int] = []
    clean: list[int] = []
    for d in ordered:
        i = int(d["index"])
        problems, _busy = _problems(d, busy_mem_frac)
        in_plan = i in planned
        statuses = [p[0] if in_plan else p[1] for p in problems]
        # "info": a problem that does not concern the plan (e.g. a busy GPU it does not use).
        status = max(statuses, key=lambda s: (SEVERITY[s], s == "info"), default="go")
        if in_plan and status == "nogo":
            unusable.append(i)
        if not problems:
            clean.append(i)
        if problems:
            message = f"{_gpu_label(d)}: " + "; ".join(p[2] for p in problems)
            if not in_plan and need_gpus:
                message += " (not used by the plan)"
        else:
            mem = d.get("memory") or {}
            util = d.get("utilization") or {}
            bits = [f"idle: {fmt_bytes(mem.get('used'))} of {fmt_bytes(mem.get('total'))} used"]
            if util.get("gpu") is not None:
                bits.append(f"{util['gpu']} %")
            if d.get("temperature_c") is not None:
                bits.append(f"{d['temperature_c']} °C")
            if d.get("power_w") is not None:
                bits.append(f"{d['power_w']:.0f} W")
            message = f"{_gpu_label(d)}: " + ", ".join(bits)
        per_gpu.append(CheckResult(f"gpu{i}", status, message, {"in_plan": in_plan, "device": dict(d)}))

    names = sorted({str(d["name"]) for d in ordered if d.get("name")})
    head = f"{len(ordered)} × {' / '.join(names) or 'GPU'}" + (f", driver {driver_version}" if driver_version else "")
    data: dict[str, Any] = {"count": len(ordered), "need_gpus": need_gpus, "use": planned,
                            "driver_version": driver_version}
    if need_gpus == 0:
        summary = CheckResult("gpus", "info", f"{head}; no planned phase needs a GPU", data)
    elif len(planned) < need_gpus:
        msg = f"{head}; the plan needs {need_gpus} GPU(s), {len(planned)} visible"
        summary = CheckResult("gpus", "nogo", msg, data)
    else:
        msg = f"{head}; the plan uses GPU {', '.join(map(str, planned))}"
        if unusable:
            msg += f"; unusable: {', '.join(map(str, unusable))}"
            if len(clean) >= need_gpus:
                data["suggest_visible"] = clean[:need_gpus]
                msg += f"; idle healthy GPUs would do: CUDA_VISIBLE_DEVICES={','.join(map(str, clean[:need_gpus]))}"
        summary = CheckResult("gpus", "go", msg, data)
    return [summary, *per_gpu]


def check_gpus(
    source: GpuSource | None = None,
    *,
    need_gpus: int = 0,
    busy_mem_frac: float = 0.05,
    env: Mapping[str, str] | None = None,
) -> list[CheckResult]:
    """describe() + assess_gpus(); without a driver, one "gpus" result (info, or no-go if needed)."""
    src = source if source is not None else NvmlSource()
    try:
        desc = src.describe()
    except GpuUnavailable as e:
        status = "nogo" if need_gpus else "info"
        msg = f"no NVIDIA driver ({e})"
        if need_gpus:
            msg += f"; the plan needs {need_gpus} GPU(s)"
        return [CheckResult("gpus", status, msg, {"error": str(e), "need_gpus": need_gpus})]
    env = os.environ if env is None else env
    devices = desc["devices"]
    visible = visible_indices(devices, env.get("CUDA_VISIBLE_DEVICES"))
    return assess_gpus(devices, need_gpus=need_gpus, use=visible, busy_mem_frac=busy_mem_frac,
                       driver_version=desc.get("driver_version"))


def _main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m specops.checks.gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--record", metavar="PATH", help="write this host's device description (JSON) to PATH")
    args = ap.parse_args(argv)
    if args.record:
        desc = record_devices(args.record)
        why = f"; {desc['nvml_error']}" if desc.get("nvml_error") else ""
        print(f"{args.record}: {len(desc['devices'])} device(s){why}")
        return 0
    for r in check_gpus():
        print(f"{r.status:5} {r.name:6} {r.message}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
