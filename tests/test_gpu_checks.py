"""GPU pre-flight: judgement on recorded device descriptions, NVML access without a GPU."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from specops.checks.gpu import (
    GpuUnavailable,
    NvmlSource,
    RecordedSource,
    assess_gpus,
    check_gpus,
    decode_throttle,
    record_devices,
    snapshot,
    visible_indices,
)

FIXTURES = Path(__file__).parent / "fixtures" / "gpus"


def devices(name: str) -> list[dict]:
    return RecordedSource(FIXTURES / f"{name}.json").describe()["devices"]


def by_name(results):
    return {r.name: r for r in results}


# ---------------------------------------------------------------- judgement on fixtures


def test_real_h200_recordings():
    # Recorded on the lent H200 with `record_devices` (driver 580.159.04): idle, then with a
    # process holding 70 GB. Retired pages are N/A on Hopper (row remapping instead): None.
    idle = RecordedSource(FIXTURES / "h200x1_idle_recorded.json").describe()
    (d,) = idle["devices"]
    assert d["retired_pages_pending"] is None and d["memory"]["reserved"] > 0 and d["errors"] == {}
    assert [r.status for r in assess_gpus(idle["devices"], need_gpus=1)] == ["go", "go"]
    busy = RecordedSource(FIXTURES / "h200x1_busy_recorded.json").describe()["devices"]
    r = by_name(assess_gpus(busy, need_gpus=1))["gpu0"]
    assert r.status == "nogo" and "pid 425 python3 (70.6 GB)" in r.message


def test_idle_host_is_go_on_every_gpu():
    res = by_name(assess_gpus(devices("h200x8_idle"), need_gpus=8))
    assert [res[f"gpu{i}"].status for i in range(8)] == ["go"] * 8
    assert res["gpus"].status == "go"
    assert "8 × NVIDIA H200" in res["gpus"].message
    assert res["gpus"].data["use"] == list(range(8))


def test_stray_process_on_gpu3_is_found_and_named():
    devs = devices("h200x8_gpu3_busy")
    res = by_name(assess_gpus(devs, need_gpus=8))
    bad = [n for n, r in res.items() if r.status == "nogo"]
    assert bad == ["gpu3"], bad  # GPU 0 is idle: we look at every GPU, not the first
    pid = devs[3]["processes"][0]["pid"]
    assert f"pid {pid}" in res["gpu3"].message
    assert "70.0 GB" in res["gpu3"].message
    assert "busy" in res["gpu3"].message
    assert "unusable: 3" in res["gpus"].message
    assert "suggest_visible" not in res["gpus"].data  # 7 idle GPUs cannot make 8
    # With room to spare, the summary points at a way out.
    res = by_name(assess_gpus(devs, need_gpus=4))
    assert res["gpu3"].status == "nogo"
    assert res["gpus"].data["suggest_visible"] == [0, 1, 2, 4]
    assert "CUDA_VISIBLE_DEVICES=0,1,2,4" in res["gpus"].message


def test_busy_gpu_outside_the_plan_is_not_a_nogo():
    res = by_name(assess_gpus(devices("h200x8_gpu3_busy"), need_gpus=2))
    assert res["gpu3"].status == "info"
    assert "not used by the plan" in res["gpu3"].message
    assert all(r.status != "nogo" for r in res.values())


def test_cuda_visible_devices_moves_the_plan_off_the_busy_gpu():
    src = RecordedSource(FIXTURES / "h200x8_gpu3_busy.json")
    res = by_name(check_gpus(src, need_gpus=4, env={"CUDA_VISIBLE_DEVICES": "0,1,2,4"}))
    assert res["gpus"].data["use"] == [0, 1, 2, 4]
    assert res["gpu3"].status == "info" and res["gpu4"].status == "go"
    res = by_name(check_gpus(src, need_gpus=4, env={}))
    assert res["gpu3"].status == "nogo"


def test_uncorrected_ecc_on_gpu5_is_nogo():
    res = by_name(assess_gpus(devices("h200x8_gpu5_ecc"), need_gpus=8))
    assert res["gpu5"].status == "nogo"
    assert "uncorrected ECC" in res["gpu5"].message
    assert [n for n, r in res.items() if r.status == "nogo"] == ["gpu5"]
    # Outside the plan a hardware fault is still worth a warning.
    assert by_name(assess_gpus(devices("h200x8_gpu5_ecc"), need_gpus=1))["gpu5"].status == "warn"


def test_mig_enabled_warns_and_says_so():
    res = by_name(assess_gpus(devices("h200x8_mig"), need_gpus=8))
    warned = [n for n, r in res.items() if r.status == "warn"]
    assert warned and all("MIG is enabled" in res[n].message for n in warned)
    assert not [r for r in res.values() if r.status == "nogo"]


def test_throttling_warns_with_decoded_reasons():
    res = by_name(assess_gpus(devices("h200x8_throttle"), need_gpus=8))
    warned = {n: r.message for n, r in res.items() if r.status == "warn"}
    assert warned, res
    assert any("hw_thermal_slowdown" in m or "hw_slowdown" in m for m in warned.values())
    # sw_power_cap and gpu_idle alone are normal and must not warn.
    assert res["gpu0"].status == "go"


def test_retired_pages_remap_failure_and_compute_modes():
    base = devices("h200x8_idle")[0]
    cases = [
        ({"retired_pages_pending": True}, "nogo", "retired pages pending"),
        ({"remapped_rows": {"correctable": 0, "uncorrectable": 1, "pending": False, "failure": True}}, "nogo",
         "row remapping failed"),
        ({"remapped_rows": {"correctable": 0, "uncorrectable": 1, "pending": True, "failure": False}}, "warn",
         "row remap pending"),
        ({"compute_mode": "PROHIBITED"}, "nogo", "PROHIBITED"),
        ({"compute_mode": "EXCLUSIVE_PROCESS", "processes": [{"pid": 7, "name": "x", "used_memory": 10**8}]}, "nogo",
         "EXCLUSIVE_PROCESS and already held by pid 7"),
        ({"compute_mode": "EXCLUSIVE_PROCESS"}, "go", "idle"),
        ({"ecc_uncorrected": {"volatile": 0, "aggregate": 2}}, "warn", "lifetime"),
        ({"errors": {"temperature_c": {"code": 15, "message": "GPU is lost"}}}, "nogo", "GPU is lost"),
    ]
    for patch, status, text in cases:
        r = by_name(assess_gpus([{**base, **patch}], need_gpus=1))["gpu0"]
        assert (r.status, text in r.message) == (status, True), (patch, r)


def test_memory_without_a_process_counts_as_busy():
    base = devices("h200x8_idle")[0]
    total = base["memory"]["total"]
    held = {**base, "memory": {**base["memory"], "used": int(total * 0.2)}}
    r = by_name(assess_gpus([held], need_gpus=1))["gpu0"]
    assert r.status == "nogo" and "no compute process visible" in r.message
    r = by_name(assess_gpus([held], need_gpus=1, busy_mem_frac=0.5))["gpu0"]
    assert r.status == "go"


def test_too_few_gpus_for_the_plan():
    res = by_name(assess_gpus(devices("h200x8_idle")[:2], need_gpus=4))
    assert res["gpus"].status == "nogo" and "needs 4" in res["gpus"].message


def test_decode_throttle():
    assert decode_throttle(0x48) == ["hw_slowdown", "hw_thermal_slowdown"]
    assert decode_throttle(0) == []
    assert decode_throttle(None) is None
    assert decode_throttle(0x1 | 0x8000) == ["gpu_idle", "unknown_0x8000"]


def test_visible_indices():
    devs = devices("h200x8_idle")
    assert visible_indices(devs, None) is None
    assert visible_indices(devs, "") == []
    assert visible_indices(devs, "3,1") == [3, 1]
    assert visible_indices(devs, f"{devs[5]['uuid'][:12]},0") == [5, 0]
    assert visible_indices(devs, "2,9,1") == [2]  # CUDA stops at the first unknown entry


# ---------------------------------------------------------------- sources


def test_snapshot_reports_every_gpu():
    snap = snapshot(RecordedSource(FIXTURES / "h200x8_gpu3_busy.json"))
    assert [s["index"] for s in snap] == list(range(8))
    assert snap[3]["memory_used"] >= 70 * 10**9 and snap[3]["processes"] == 1
    assert snap[0]["processes"] == 0


def test_record_devices_round_trip(tmp_path):
    src = RecordedSource(FIXTURES / "h200x8_gpu5_ecc.json")
    out = tmp_path / "rec.json"
    written = record_devices(out, src)
    assert RecordedSource(out).describe()["devices"] == src.describe()["devices"] == written["devices"]
    assert json.loads(out.read_text())["host"]


def test_record_command_writes_a_replayable_description(tmp_path, capsys):
    from specops.checks.gpu import _main

    out = tmp_path / "host.json"
    assert _main(["--record", str(out)]) == 0
    assert f"{out}: " in capsys.readouterr().out
    try:  # this host's GPUs, or the recorded reason there are none
        desc = RecordedSource(out).describe()
    except GpuUnavailable as e:
        assert str(e) == json.loads(out.read_text())["nvml_error"]
    else:
        assert [d["index"] for d in desc["devices"]] == list(range(len(desc["devices"])))


def test_recorded_no_driver_replays_as_unavailable(tmp_path):
    out = tmp_path / "nodriver.json"
    out.write_text(json.dumps({"nvml_error": "NVML: Driver Not Loaded", "devices": []}))
    with pytest.raises(GpuUnavailable, match="Driver Not Loaded"):
        RecordedSource(out).describe()
    (r,) = check_gpus(RecordedSource(out), need_gpus=0)
    assert (r.name, r.status, r.message) == ("gpus", "info", "no NVIDIA driver (NVML: Driver Not Loaded)")


def _driver_present() -> bool:
    try:
        NvmlSource().describe()
    except GpuUnavailable:
        return False
    return True


@pytest.mark.skipif(_driver_present(), reason="this host has an NVIDIA driver")
def test_nvml_without_driver_says_so_plainly():
    with pytest.raises(GpuUnavailable, match="^NVML: "):
        NvmlSource().describe()
    (r,) = check_gpus(NvmlSource(), need_gpus=0)
    assert r.status == "info" and r.message.startswith("no NVIDIA driver (NVML: ")
    (r,) = check_gpus(NvmlSource(), need_gpus=2)
    assert r.status == "nogo" and "needs 2 GPU" in r.message
    with pytest.raises(GpuUnavailable):
        snapshot(NvmlSource())


def _fake_nvml(monkeypatch, overrides):
    """A pynvml stand-in: real constants and error classes, every device query NotSupported."""
    import pynvml

    def unsupported(*a, **k):
        raise pynvml.NVMLError_NotSupported()

    fake = SimpleNamespace(**{k: getattr(pynvml, k) for k in dir(pynvml) if not k.startswith("__")})
    for k in dir(pynvml):
        if k.startswith("nvmlDeviceGet") or k.startswith("nvmlSystemGet"):
            setattr(fake, k, unsupported)
    fake.nvmlInit = lambda: None
    fake.nvmlShutdown = lambda: None
    fake.nvmlDeviceGetCount = lambda: 2
    fake.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"
    for k, v in overrides.items():
        setattr(fake, k, v)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return pynvml


def test_nvml_unsupported_queries_become_none(monkeypatch):
    _fake_nvml(monkeypatch, {"nvmlDeviceGetName": lambda h: "NVIDIA H200"})
    desc = NvmlSource().describe()
    assert len(desc["devices"]) == 2
    d = desc["devices"][1]
    assert d["index"] == 1 and d["name"] == "NVIDIA H200"
    for field in ("memory", "processes", "mig", "ecc_uncorrected", "remapped_rows", "throttle", "temperature_c",
                  "power_w", "compute_mode", "utilization", "retired_pages_pending"):
        assert d[field] is None, field
    assert d["errors"] == {}  # "not supported" is not an error
    res = by_name(assess_gpus(desc["devices"], need_gpus=2))
    assert res["gpu1"].status == "go"


def test_nvml_fields_processes_and_errors(monkeypatch):
    pynvml = _fake_nvml(monkeypatch, {})
    gb = 10**9

    def lost(h, *a):
        raise pynvml.NVMLError_GpuIsLost()

    def procs(h):
        return [SimpleNamespace(pid=os.getpid(), usedGpuMemory=3 * gb)] if h == "h1" else []

    fake = sys.modules["pynvml"]
    fake.nvmlDeviceGetMemoryInfo = lambda h, version=None: SimpleNamespace(
        total=140 * gb, used=4 * gb if h == "h1" else 0, free=136 * gb, reserved=gb if version else None)
    fake.nvmlDeviceGetComputeRunningProcesses = procs
    fake.nvmlDeviceGetMigMode = lambda h: [0, 0]
    fake.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0x48 if h == "h0" else 0
    fake.nvmlDeviceGetTemperature = lambda h, s: 85 if h == "h0" else lost(h)
    fake.nvmlDeviceGetPowerUsage = lambda h: 700_000
    fake.nvmlDeviceGetTotalEccErrors = lambda h, t, c: 0
    desc = NvmlSource().describe()
    d0, d1 = desc["devices"]
    assert d0["memory"] == {"total": 140 * gb, "used": 0, "free": 136 * gb, "reserved": gb}
    assert d0["throttle"] == {"mask": 0x48, "reasons": ["hw_slowdown", "hw_thermal_slowdown"]}
    assert d0["power_w"] == 700.0 and d0["mig"] == {"current": False, "pending": False}
    assert d1["processes"][0]["pid"] == os.getpid()
    assert d1["processes"][0]["name"] == Path("/proc/self/comm").read_text().strip()
    assert d1["errors"]["temperature_c"]["message"] == str(pynvml.NVMLError_GpuIsLost())
    res = by_name(assess_gpus(desc["devices"], need_gpus=2))
    assert res["gpu0"].status == "warn" and "hw_thermal_slowdown at 85 °C" in res["gpu0"].message
    assert res["gpu1"].status == "nogo" and f"pid {os.getpid()}" in res["gpu1"].message


def test_nvml_init_failure_is_unavailable(monkeypatch):
    pynvml = _fake_nvml(monkeypatch, {})

    def fail():
        raise pynvml.NVMLError_DriverNotLoaded()

    sys.modules["pynvml"].nvmlInit = fail
    (r,) = check_gpus(NvmlSource(), need_gpus=1)
    assert r.status == "nogo" and r.message.startswith("no NVIDIA driver (NVML: Driver Not Loaded)")
