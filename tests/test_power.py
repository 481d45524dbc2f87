"""Power telemetry: fake RAPL sysfs (with a counter wrap), fake pynvml, fake amdsmi / amd-smi, the bench hook.

Every expected energy / average power below is worked by hand in the comments.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import types

import pytest

from tokenfab.power import bench_hook
from tokenfab.power import amdsmi_backend, rapl
from tokenfab.power.amdsmi_backend import AmdSmiBackend, AmdSmiCliBackend
from tokenfab.power.base import PowerBackendError
from tokenfab.power.monitor import PowerMonitor, select_backend, trapezoid
from tokenfab.power.nvml import NvmlBackend
from tokenfab.power.rapl import RaplBackend


class Clock:
    """A settable time.time() stand-in."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def started_monitor(backend, t0: float = 0.0) -> tuple[PowerMonitor, Clock]:
    """A PowerMonitor on ``backend`` (2 s interval) started at time ``t0`` without its thread."""
    clock = Clock(t0)
    mon = PowerMonitor(backend, 2.0, clock=clock)
    mon.start(thread=False)
    return mon, clock


def sample_then_stop(mon: PowerMonitor, clock: Clock, fake=None) -> None:
    """From the start time t0: a sample at t0 + 2 s, the stop at t0 + 4 s; a fake library's readings advance with
    them (``fake.step`` 1, then 2)."""
    t0 = clock.t
    clock.t = t0 + 2.0
    if fake is not None:
        fake.step = 1
    mon.sample()
    clock.t = t0 + 4.0
    if fake is not None:
        fake.step = 2
    mon.stop()


@pytest.fixture
def no_hw(monkeypatch, tmp_path):
    """A machine with nothing: no pynvml, no amdsmi, no amd-smi, no powercap."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    monkeypatch.setattr(amdsmi_backend.shutil, "which", lambda name: None)
    monkeypatch.setattr(rapl, "DEFAULT_ROOT", str(tmp_path / "no-powercap"))


# ---------------------------------------------------------------------------------------------------- RAPL
def _w(path, value):
    path.write_text(f"{value}\n")


def make_rapl(root, pkgs):
    """pkgs: {N: (energy_uj, max_energy_range_uj, long_term_limit_uw)}; adds a core sub-zone to be ignored."""
    for n, (e, mx, lim) in pkgs.items():
        z = root / f"intel-rapl:{n}"
        z.mkdir(parents=True)
        _w(z / "name", f"package-{n}")
        _w(z / "energy_uj", e)
        _w(z / "max_energy_range_uj", mx)
        _w(z / "constraint_0_name", "long_term")
        _w(z / "constraint_0_power_limit_uw", lim)
        _w(z / "constraint_1_name", "short_term")
        _w(z / "constraint_1_power_limit_uw", lim * 2)
        sub = root / f"intel-rapl:{n}:0"
        sub.mkdir()
        _w(sub / "name", "core")
        _w(sub / "energy_uj", 12345)
    return root


def test_rapl_counter_with_wrap(tmp_path):
    root = make_rapl(tmp_path / "powercap", {0: (900_000_000, 1_000_000_000, 125_000_000),
                                            1: (10_000_000, 1_000_000_000, 100_000_000)})
    clock = Clock(100.0)
    be = RaplBackend(root=str(root))
    mon = PowerMonitor(be, interval_s=2.0, clock=clock)
    mon.start(thread=False)
    assert be.devices == ["package-0", "package-1"]          # the core sub-zone is not a device
    assert mon.caps_w == [125.0, 100.0]                       # long_term limit, µW / 1e6
    # t=102: package-0 900 J -> 950 J (+50 J); package-1 10 J -> 30 J (+20 J)
    clock.t = 102.0
    _w(root / "intel-rapl:0" / "energy_uj", 950_000_000)
    _w(root / "intel-rapl:1" / "energy_uj", 30_000_000)
    s = mon.sample()
    assert s.power_w == pytest.approx([25.0, 10.0])          # 50 J / 2 s, 20 J / 2 s
    # t=104: package-0 wraps: 950 J -> (max 1000 J) -> 40 J, i.e. +50 + 40 = +90 J; package-1 +20 J
    clock.t = 104.0
    _w(root / "intel-rapl:0" / "energy_uj", 40_000_000)
    _w(root / "intel-rapl:1" / "energy_uj", 50_000_000)
    mon.stop()
    assert mon.samples[-1].power_w == pytest.approx([45.0, 10.0])   # 90 J / 2 s
    whole = mon.window()
    # package-0: 50 + 90 = 140 J over 4 s = 35 W; package-1: 40 J / 4 s = 10 W; total 45 W = 0.045 kW
    assert whole["energy_j_per_device"] == pytest.approx([140.0, 40.0])
    assert whole["energy_j"] == pytest.approx(180.0)
    assert whole["avg_w_per_device"] == pytest.approx([35.0, 10.0])
    assert whole["total_kw"] == pytest.approx(0.045)
    # steady window (101, 103): counters interpolated: pkg0 E(101) = 25 J, E(103) = 50 + 45 = 95 J -> 70 J / 2 s
    steady = mon.window(101.0, 103.0)
    assert steady["energy_j_per_device"] == pytest.approx([70.0, 20.0])
    assert steady["avg_w_per_device"] == pytest.approx([35.0, 10.0])
    # a window reaching outside the samples is clipped to [100, 104]
    assert mon.window(50.0, 500.0)["duration_s"] == pytest.approx(4.0)


def test_rapl_device_selection_and_unreadable(tmp_path, monkeypatch):
    root = make_rapl(tmp_path / "pc", {0: (0, 2**32, 1), 1: (0, 2**32, 1)})
    be = RaplBackend([1], root=str(root))
    be.open()
    assert be.devices == ["package-1"]
    with pytest.raises(PowerBackendError, match="--power-devices"):
        RaplBackend([5], root=str(root)).open()

    def deny(path, *a, **k):
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(rapl, "_read_int", deny)
    with pytest.raises(PowerBackendError, match="not readable"):
        RaplBackend(root=str(root)).open()


# ---------------------------------------------------------------------------------------------------- NVML
class _NVMLError(Exception):
    pass


def fake_pynvml(energy_mj, power_mw, limit_mw=700_000, counter=True):
    """A pynvml stand-in: per-device tables indexed by mod.step (energy in mJ, power in mW)."""
    mod = types.ModuleType("pynvml")
    mod.step = 0
    mod.calls = []
    mod.NVMLError = _NVMLError
    mod.nvmlInit = lambda: mod.calls.append("init")
    mod.nvmlShutdown = lambda: mod.calls.append("shutdown")
    mod.nvmlDeviceGetCount = lambda: len(power_mw)
    mod.nvmlDeviceGetHandleByIndex = lambda i: i

    def energy(h):
        if not counter:
            raise _NVMLError("Not Supported")
        return energy_mj[h][mod.step]
    mod.nvmlDeviceGetTotalEnergyConsumption = energy
    mod.nvmlDeviceGetPowerUsage = lambda h: power_mw[h][mod.step]
    mod.nvmlDeviceGetEnforcedPowerLimit = lambda h: limit_mw
    return mod


def test_nvml_energy_counter(monkeypatch):
    nv = fake_pynvml(energy_mj=[[1_000_000, 1_600_000, 2_400_000], [0, 1_000_000, 2_000_000]],
                     power_mw=[[300_000, 300_000, 400_000], [500_000, 500_000, 500_000]])
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    mon, clock = started_monitor(NvmlBackend(), 0.0)
    assert mon.method == "energy counter"
    assert mon.caps_w == [700.0, 700.0]                      # 700,000 mW
    sample_then_stop(mon, clock, nv)                          # t = 2 s, 4 s
    assert nv.calls == ["init", "shutdown"]
    w = mon.window()
    # gpu0: (2,400,000 - 1,000,000) mJ = 1400 J / 4 s = 350 W; gpu1: 2000 J / 4 s = 500 W; total 0.85 kW
    assert w["energy_j_per_device"] == pytest.approx([1400.0, 2000.0])
    assert w["avg_w_per_device"] == pytest.approx([350.0, 500.0])
    assert w["total_kw"] == pytest.approx(0.85)
    assert mon.samples[1].power_w == [300.0, 500.0]           # instantaneous power is still recorded


def test_nvml_sampled_power_trapezoid(monkeypatch):
    nv = fake_pynvml(energy_mj=None, power_mw=[[300_000, 400_000, 200_000]], counter=False)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    mon, clock = started_monitor(NvmlBackend([0]), 10.0)
    assert mon.method == "sampled power (trapezoid)"
    sample_then_stop(mon, clock, nv)                          # t = 12 s, 14 s
    # trapezoid: (300 + 400)/2 * 2 + (400 + 200)/2 * 2 = 700 + 600 = 1300 J over 4 s = 325 W
    w = mon.window()
    assert w["energy_j"] == pytest.approx(1300.0)
    assert w["avg_w_per_device"] == pytest.approx([325.0])
    # steady (11, 13): P(11) = 350, P(12) = 400, P(13) = 300 -> (350+400)/2 + (400+300)/2 = 725 J / 2 s = 362.5 W
    s = mon.window(11.0, 13.0)
    assert s["energy_j"] == pytest.approx(725.0)
    assert s["avg_w_per_device"] == pytest.approx([362.5])


def test_nvml_respects_cuda_visible_devices(monkeypatch):
    nv = fake_pynvml(energy_mj=[[0], [0], [0]], power_mw=[[1], [2], [3]])
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    be = NvmlBackend()
    be.open()
    assert be.devices == ["gpu2", "gpu0"]
    with pytest.raises(PowerBackendError, match="--power-devices"):
        NvmlBackend([7]).open()


def test_trapezoid_helper():
    # y = t on [0, 4], integrated over [1, 3] = (9 - 1)/2 = 4
    assert trapezoid([0, 2, 4], [0, 2, 4], 1, 3) == pytest.approx(4.0)


# ---------------------------------------------------------------------------------------------------- AMD
def fake_amdsmi(acc, resolution_uj, socket_w, cap_uw, key="energy_accumulator"):
    mod = types.ModuleType("amdsmi")
    mod.step = 0
    mod.amdsmi_init = lambda: None
    mod.amdsmi_shut_down = lambda: None
    mod.amdsmi_get_processor_handles = lambda: ["h0"]
    mod.amdsmi_get_energy_count = lambda h: {key: acc[mod.step], "counter_resolution": resolution_uj,
                                             "timestamp": mod.step}
    mod.amdsmi_get_power_info = lambda h: {"current_socket_power": "N/A", "average_socket_power": socket_w}
    mod.amdsmi_get_power_cap_info = lambda h: {"power_cap": cap_uw}
    return mod


@pytest.mark.parametrize("key", ["energy_accumulator", "power"])  # "power" before ROCm 6.4
def test_amdsmi_energy_counter(monkeypatch, key):
    amd = fake_amdsmi([5_000, 605_000, 1_205_000], 1000.0, 300, 750_000_000, key=key)
    monkeypatch.setitem(sys.modules, "amdsmi", amd)
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    mon, clock = started_monitor(AmdSmiBackend(), 0.0)
    assert mon.caps_w == [750.0]                              # 750,000,000 µW
    sample_then_stop(mon, clock, amd)                         # t = 2 s, 4 s
    # (1,205,000 - 5,000) counts x 1000 µJ = 1.2e9 µJ = 1200 J over 4 s = 300 W
    w = mon.window()
    assert w["energy_j"] == pytest.approx(1200.0)
    assert w["avg_w_per_device"] == pytest.approx([300.0])
    assert mon.samples[1].power_w == [300.0]                  # average_socket_power when current is N/A


def test_amd_smi_cli_fallback():
    metric = json.dumps([{"gpu": 0, "power": {"socket_power": {"value": 250, "unit": "W"}}},
                         {"gpu": 1, "power": {"socket_power": {"value": 100, "unit": "W"}}}])
    static = json.dumps([{"gpu": 0, "limit": {"max_power": {"value": 750, "unit": "W"}}},
                         {"gpu": 1, "limit": {"max_power": {"value": 750, "unit": "W"}}}])
    seen = []

    def runner(cmd):
        seen.append(cmd[1])
        return metric if cmd[1] == "metric" else static
    mon, clock = started_monitor(AmdSmiCliBackend([0], runner=runner), 0.0)
    sample_then_stop(mon, clock)                              # t = 2 s, 4 s
    assert mon.caps_w == [750.0]
    # constant 250 W for 4 s = 1000 J
    assert mon.window()["energy_j"] == pytest.approx(1000.0)
    assert "static" in seen


# ---------------------------------------------------------------------------------------------------- selection
def test_named_backend_missing_gives_clear_error(no_hw):
    with pytest.raises(ValueError) as ei:
        select_backend("nvml")
    msg = str(ei.value)
    assert "--power nvml" in msg and "pynvml" in msg and "Available here: none" in msg
    assert getattr(ei.value, "user_error", False)
    with pytest.raises(ValueError, match="--power amdsmi"):
        bench_hook.start(argparse.Namespace(power="amdsmi", power_devices=None, power_interval=2.0))
    with pytest.raises(ValueError, match="--power rapl"):
        select_backend("rapl")


def test_named_backend_missing_lists_available(no_hw, tmp_path, monkeypatch):
    root = make_rapl(tmp_path / "pc", {0: (0, 2**32, 50_000_000)})
    monkeypatch.setattr(rapl, "DEFAULT_ROOT", str(root))
    with pytest.raises(ValueError, match=r"Available here: rapl, none"):
        select_backend("nvml")
    backend, note = select_backend("auto")
    assert backend.name == "rapl" and "auto picked rapl" in note
    backend.close()


def _args(**kw):
    p = argparse.ArgumentParser()
    bench_hook.add_power_args(p)
    argv = []
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        for item in (v if isinstance(v, list) else [v]):
            argv += [flag, str(item)]
    return p.parse_args(argv)


def test_add_power_args_defaults():
    a = _args()
    assert a.power == "auto" and a.power_interval == 2.0 and a.power_devices is None
    assert a.kwh_price is None and a.device_hour_price is None and a.power_cap_kw is None  # 0.10 applied later
    a = _args(power="rapl", power_devices="0,1", device_hour_price=[2.95, 5.99], kwh_price=0.12)
    assert a.device_hour_price == [2.95, 5.99] and a.kwh_price == [0.12]


def test_auto_degrades_and_cost_still_prints(no_hw, capsys):
    args = _args(power_cap_kw=4.8, device_hour_price=2.95)
    run = bench_hook.start(args)
    assert run is not None and run.monitor is None
    assert "nothing" not in run.note and "found no readable backend" in run.note
    result = {"total_token_throughput": 5661.0, "output_throughput": 2800.0, "num_devices": 6}
    text = bench_hook.finish(run, result, args, None)
    assert "Power: not measured" in text and "pynvml" in text
    assert result["power"]["measured"] is False and "rapl" in result["power"]["reason"]
    c = result["cost"]
    assert c["cap_kw"] == 4.8 and c["measured_kw"] is None and c["cap_source"] == "--power-cap-kw"
    assert "1,179" in text and "$0.024" in text and "$0.87" in text and "$4,205" in text
    assert json.loads(json.dumps(result))  # JSON-ready
    # a later block of the same output (tokenfab demo's next benchmark) gives the same reason in one line; the
    # result keeps it in full
    args.power_reason_said = result["power"]["reason"]
    again = {"total_token_throughput": 5661.0, "output_throughput": 2800.0, "num_devices": 6}
    text = bench_hook.finish(bench_hook.start(args), again, args, None)
    assert "Power: not measured (the reason given above)" in text and "pynvml" not in text
    assert again["power"]["reason"] == result["power"]["reason"] and "$0.024" in text


def test_power_none():
    args = _args(power="none", power_cap_kw=4.8)
    assert bench_hook.start(args) is None
    result = {"total_token_throughput": 5661.0, "num_devices": 6}
    text = bench_hook.finish(None, result, args, None)
    assert "not measured (--power none)" in text and result["cost"]["tok_s_per_kw_cap"] == pytest.approx(1179.375)


def test_bench_hook_end_to_end_with_thread(monkeypatch):
    """Real clock and sampling thread over a fake NVML whose counters grow at 300 W and 200 W."""
    t0 = time.time()
    nv = fake_pynvml(None, None)
    nv.nvmlDeviceGetCount = lambda: 2
    rate = {0: 300.0, 1: 200.0}
    nv.nvmlDeviceGetTotalEnergyConsumption = lambda h: (time.time() - t0) * rate[h] * 1000.0  # mJ
    nv.nvmlDeviceGetPowerUsage = lambda h: rate[h] * 1000.0
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    args = _args(power="auto", power_interval=0.02, kwh_price=[0.10, 0.20])
    run = bench_hook.start(args)
    assert run.backend == "nvml"
    t_a = time.time()
    time.sleep(0.15)
    t_b = time.time()
    time.sleep(0.05)
    result = {"total_token_throughput": 1000.0, "output_throughput": 400.0, "num_devices": 2,
              "total_input_tokens": 600, "total_output_tokens": 400}
    text = bench_hook.finish(run, result, args, (t_a, t_b))
    p = result["power"]
    assert p["measured"] and p["backend"] == "nvml" and p["method"] == "energy counter"
    assert p["caps_w"] == [700.0, 700.0] and p["cap_total_kw"] == pytest.approx(1.4)
    assert len(p["samples"]) >= 3 and p["samples"][0][1] == [300.0, 200.0]
    whole, steady = p["whole_run"], p["steady"]
    assert whole["avg_w_per_device"] == pytest.approx([300.0, 200.0], rel=1e-3)
    assert whole["total_kw"] == pytest.approx(0.5, rel=1e-3)
    # whole run uses token counts: 1000 tokens / E J; 400 output tokens -> E / 400 J per output token
    assert whole["total_tokens_per_j"] == pytest.approx(1000.0 / whole["energy_j"])
    assert whole["j_per_output_token"] == pytest.approx(whole["energy_j"] / 400.0)
    # steady window uses throughput: 1000 tok/s / 500 W = 2 tokens/J; 500 W / 400 tok/s = 1.25 J per output token
    assert steady["duration_s"] == pytest.approx(t_b - t_a, abs=1e-6)
    assert steady["total_tokens_per_j"] == pytest.approx(2.0, rel=1e-3)
    assert steady["j_per_output_token"] == pytest.approx(1.25, rel=1e-3)
    c = result["cost"]
    assert c["measured_source"] == "steady window" and c["measured_kw"] == pytest.approx(0.5, rel=1e-3)
    assert c["cap_kw"] == pytest.approx(1.4) and [e["usd_per_kwh"] for e in c["electricity"]] == [0.10, 0.20]
    assert "Power: nvml, energy counter, 2 device(s)" in text and "steady window" in text
    assert "Electricity" in text
