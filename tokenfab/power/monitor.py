"""Background sampling of a power backend and the energy/average-power figures of a time window.

Energy over a window [a, b] (time.time() seconds), per device:

* with an energy counter:  E = C(b) − C(a), C linearly interpolated between samples (exact at sample times);
* without one (power only):  E = ∫ P dt by the trapezoid rule over the samples, with P linearly interpolated at a and b.

Average power = E / (b − a) in W; total kW = Σ_devices average W / 1000. The window is clipped to the sampled span
[first sample, last sample]; :meth:`PowerMonitor.start` takes the first sample and :meth:`PowerMonitor.stop` the
last, so whatever ran before ``start`` (warm-up) is outside every figure.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from tokenfab.power.base import PowerBackend, PowerBackendError


@dataclass
class Sample:
    """One reading: time ``t`` (s, time.time()), power per device (W; None where not derivable), energy (J, cumulative)."""

    t: float
    power_w: list[float | None]
    energy_j: list[float] | None


def interp(ts: list[float], ys: list[float], x: float) -> float:
    """Linear interpolation of the series (ts, ys) at x (ts ascending; x is clamped to [ts[0], ts[-1]])."""
    if x <= ts[0]:
        return ys[0]
    if x >= ts[-1]:
        return ys[-1]
    lo, hi = 0, len(ts) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ts[mid] <= x:
            lo = mid
        else:
            hi = mid
    t0, t1 = ts[lo], ts[hi]
    if t1 == t0:
        return ys[hi]
    return ys[lo] + (ys[hi] - ys[lo]) * (x - t0) / (t1 - t0)


def trapezoid(ts: list[float], ys: list[float], a: float, b: float) -> float:
    """∫_a^b y dt by the trapezoid rule over the points of (ts, ys) inside (a, b) plus interpolated end points."""
    if b <= a:
        return 0.0
    pts = [(a, interp(ts, ys, a))] + [(t, y) for t, y in zip(ts, ys) if a < t < b] + [(b, interp(ts, ys, b))]
    return sum(0.5 * (y0 + y1) * (t1 - t0) for (t0, y0), (t1, y1) in zip(pts, pts[1:]))


class PowerMonitor:
    """Samples ``backend`` every ``interval_s`` seconds (default 2.0) in a daemon thread.

    ``clock`` (default time.time) is injectable for tests; ``start(thread=False)`` lets a test drive
    :meth:`sample` by hand; ``already_open`` says the backend was opened by :func:`select_backend`.
    """

    def __init__(self, backend: PowerBackend, interval_s: float = 2.0, clock: Callable[[], float] = time.time,
                 already_open: bool = False):
        if interval_s <= 0:
            raise PowerBackendError(f"--power-interval must be > 0 seconds, got {interval_s}")
        self.backend = backend
        self.interval_s = float(interval_s)
        self.clock = clock
        self.samples: list[Sample] = []
        self.caps_w: list[float | None] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._opened = already_open

    # ------------------------------------------------------------------ sampling
    def start(self, thread: bool = True) -> None:
        """Open the backend if needed, record the caps (W), take the first sample, start the sampling thread."""
        if not self._opened:
            self.backend.open()
            self._opened = True
        self.caps_w = self.backend.caps_w()
        self.sample()
        if thread:
            self._thread = threading.Thread(target=self._loop, name="tokenfab-power", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception as e:  # keep sampling; report at the end
                if len(self.errors) < 20:
                    self.errors.append(f"{type(e).__name__}: {e}")

    def sample(self) -> Sample:
        """Read the backend once and append a :class:`Sample`. Power missing from a counter-only backend is
        derived from the counter: P = ΔE / Δt over the preceding interval (None for the first sample)."""
        with self._lock:
            t = self.clock()
            energy = self.backend.read_energy_j() if self.backend.has_energy_counter else None
            power = self.backend.read_power_w()
            if power is None:
                prev = self.samples[-1] if self.samples else None
                if energy is not None and prev is not None and prev.energy_j is not None and t > prev.t:
                    power = [(e1 - e0) / (t - prev.t) for e0, e1 in zip(prev.energy_j, energy)]
                else:
                    power = [None] * len(self.backend.devices)
            s = Sample(t, list(power), list(energy) if energy is not None else None)
            self.samples.append(s)
            return s

    def stop(self) -> None:
        """Stop the thread, take a last sample, close the backend."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5.0)
            self._thread = None
        if self._opened:
            try:
                self.sample()
            except Exception as e:
                self.errors.append(f"{type(e).__name__}: {e}")
            self.backend.close()
            self._opened = False

    # ------------------------------------------------------------------ figures
    @property
    def method(self) -> str:
        """How energy is obtained: 'energy counter' or 'sampled power (trapezoid)'."""
        return "energy counter" if self.backend.has_energy_counter else "sampled power (trapezoid)"

    def window(self, t_start: float | None = None, t_end: float | None = None) -> dict | None:
        """Energy (J), duration (s), average W per device and total kW over [t_start, t_end] ∩ sampled span.

        Returns None when the clipped window is empty or fewer than two samples exist.
        """
        with self._lock:
            samples = list(self.samples)
        if len(samples) < 2:
            return None
        ts = [s.t for s in samples]
        a = ts[0] if t_start is None else max(ts[0], float(t_start))
        b = ts[-1] if t_end is None else min(ts[-1], float(t_end))
        if b <= a:
            return None
        n = len(self.backend.devices)
        energy: list[float] = []
        for d in range(n):
            if samples[0].energy_j is not None and all(s.energy_j is not None for s in samples):
                ys = [s.energy_j[d] for s in samples]
                energy.append(interp(ts, ys, b) - interp(ts, ys, a))
            else:
                pts = [(s.t, s.power_w[d]) for s in samples if s.power_w[d] is not None]
                if len(pts) < 2:
                    return None
                energy.append(trapezoid([p[0] for p in pts], [p[1] for p in pts], a, b))
        dur = b - a
        avg = [e / dur for e in energy]
        return {
            "t_start": a,
            "t_end": b,
            "duration_s": dur,
            "energy_j": sum(energy),
            "energy_j_per_device": energy,
            "avg_w_per_device": avg,
            "total_kw": sum(avg) / 1000.0,
        }


BACKEND_NAMES = ("nvml", "amdsmi", "rapl")
AUTO_ORDER = ("nvml", "amdsmi", "rapl")


def make_backend(name: str, indices: list[int] | None = None, rapl_root: str | None = None) -> PowerBackend:
    """Construct (not open) the backend ``name`` ∈ {nvml, amdsmi, rapl}; amdsmi falls back to the amd-smi CLI."""
    if name == "nvml":
        from tokenfab.power.nvml import NvmlBackend
        return NvmlBackend(indices)
    if name == "amdsmi":
        from tokenfab.power.amdsmi_backend import AmdSmiBackend
        return AmdSmiBackend(indices)
    if name == "rapl":
        from tokenfab.power.rapl import DEFAULT_ROOT, RaplBackend
        return RaplBackend(indices, root=rapl_root or DEFAULT_ROOT)
    raise PowerBackendError(f"--power: unknown backend {name!r}; choose auto, nvml, amdsmi, rapl or none")


def _open(name: str, indices: list[int] | None, rapl_root: str | None) -> tuple[PowerBackend | None, str]:
    """Try to open ``name``; return (backend, "") or (None, reason)."""
    backend = make_backend(name, indices, rapl_root)
    try:
        backend.open()
        return backend, ""
    except PowerBackendError as e:
        reason = str(e)
    except Exception as e:  # a library that fails in an unexpected way must not break a benchmark
        reason = f"{type(e).__name__}: {e}"
    if name == "amdsmi":  # the CLI fallback
        from tokenfab.power.amdsmi_backend import AmdSmiCliBackend
        cli = AmdSmiCliBackend(indices)
        try:
            cli.open()
            return cli, ""
        except Exception as e:
            reason = f"{reason}; amd-smi CLI: {e}"
    return None, reason


def select_backend(name: str, indices: list[int] | None = None,
                   rapl_root: str | None = None) -> tuple[PowerBackend | None, str]:
    """Open the backend chosen by ``--power``; return (opened backend or None, a sentence saying what was picked).

    * ``none``: (None, "not measured: --power none").
    * ``auto``: the first of nvml, amdsmi, rapl that opens; when none does, (None, reasons for each).
    * a name: that backend, or :class:`PowerBackendError` naming ``--power``, the reason and what is available.
    """
    name = (name or "auto").lower()
    if name == "none":
        return None, "not measured: --power none"
    if name == "auto":
        reasons = []
        for cand in AUTO_ORDER:
            b, why = _open(cand, indices, rapl_root)
            if b is not None:
                return b, f"--power auto picked {cand} ({len(b.devices)} device(s): {', '.join(b.devices)})"
            reasons.append(f"{cand}: {why}")
        return None, "not measured: --power auto found no readable backend (" + "; ".join(reasons) + ")"
    if name not in BACKEND_NAMES:
        raise PowerBackendError(f"--power: unknown backend {name!r}; choose auto, nvml, amdsmi, rapl or none")
    b, why = _open(name, indices, rapl_root)
    if b is not None:
        return b, f"--power {name} ({len(b.devices)} device(s): {', '.join(b.devices)})"
    available = []
    for cand in BACKEND_NAMES:
        if cand == name:
            continue
        other, _ = _open(cand, indices, rapl_root)
        if other is not None:
            available.append(cand)
            other.close()
    raise PowerBackendError(
        f"--power {name}: not available on this machine ({why}). Available here: "
        f"{', '.join(available + ['none'])}; use --power auto or --power none")
