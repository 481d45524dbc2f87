"""The power + cost hook that ``tokenfab bench serve`` calls around its requests.

Interface (fixed; the bench command depends on it)::

    add_power_args(parser)                      # --power, --power-devices, --power-interval, cost flags
    run = start(args)                           # right before the first request; a PowerRun or None
    text = finish(run, result, args, steady_window)   # after the last request; fills result["power"], result["cost"]

``result["power"]`` (JSON-ready)::

    measured: bool, reason: str | None, note: str (which backend and why),
    backend: "nvml" | "amdsmi" | "rapl" | None, method: "energy counter" | "sampled power (trapezoid)",
    devices: [labels], interval_s, caps_w: [W per device or None], cap_total_kw, cap_source,
    samples: [[t (time.time() s), [W per device]], ...],
    whole_run / steady: {t_start, t_end, duration_s, energy_j, energy_j_per_device, avg_w_per_device, total_kw,
                         j_per_output_token, total_tokens_per_j, token_source} or None

Token figures: whole run uses the run's token counts (``total_input_tokens`` + ``total_output_tokens``):
tokens/J = tokens ÷ J and J/output token = J ÷ output tokens. The steady window uses throughputs
(``steady_total_token_throughput`` / ``steady_output_throughput`` when the bench provides them, else the whole-run
``total_token_throughput`` / ``output_throughput``): tokens/J = (tok/s) ÷ W, J/output token = W ÷ (output tok/s).

``result["cost"]`` is :func:`tokenfab.cost.model.compute_cost` on ``total_token_throughput``, ``num_devices``, the
measured kW (steady window when given, else whole run) and the cap kW (sum of the caps read, else
``--power-cap-kw``), at the prices of ``--kwh-price`` / ``--device-hour-price`` / ``--cost-scenarios``.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from tokenfab.cost.scenarios import add_price_args, prices_from_args
from tokenfab.power.base import PowerBackendError, parse_device_list
from tokenfab.power.monitor import PowerMonitor, select_backend

POWER_CHOICES = ("auto", "nvml", "amdsmi", "rapl", "none")


def add_power_args(parser: argparse.ArgumentParser) -> None:
    """Add the power flags (``--power``, ``--power-devices``, ``--power-interval``) and the cost flags
    (``--kwh-price``, ``--device-hour-price``, ``--power-cap-kw``, ``--cost-scenarios``) to ``parser``."""
    g = parser.add_argument_group("power and cost")
    g.add_argument("--power", choices=POWER_CHOICES, default="auto",
                   help="power telemetry backend (default auto: nvml, then amdsmi, then rapl; none to skip)")
    g.add_argument("--power-devices", default=None, metavar="LIST",
                   help="comma list of device indices to measure (default: all visible)")
    g.add_argument("--power-interval", type=float, default=2.0, metavar="S",
                   help="power sampling interval in seconds (default 2.0)")
    g.add_argument("--power-cap-kw", type=float, default=None, metavar="KW",
                   help="total power cap in kW for the cost table when none can be read from the devices")
    add_price_args(g)


@dataclass
class PowerRun:
    """A started measurement: the monitor (None when nothing is measurable) and the sentence saying why."""

    backend: str | None
    note: str
    monitor: PowerMonitor | None


def start(args: argparse.Namespace) -> PowerRun | None:
    """Pick and start the power backend named by ``--power``; None for ``--power none``.

    ``auto`` never fails: with nothing readable it returns a PowerRun without a monitor whose note gives the reasons.
    A backend asked for by name that cannot open raises :class:`PowerBackendError` (a ValueError) naming ``--power``
    and the backends available here.
    """
    name = getattr(args, "power", "auto") or "auto"
    if name == "none":
        return None
    interval = float(getattr(args, "power_interval", 2.0) or 2.0)
    if interval <= 0:
        raise PowerBackendError(f"--power-interval must be > 0 seconds, got {interval}")
    prices_from_args(args)  # fail on a bad price flag/scenario file before the benchmark, not after it
    devices = parse_device_list(getattr(args, "power_devices", None))
    backend, note = select_backend(name, devices)
    if backend is None:  # said once, in the result block ("Power: not measured (...)")
        return PowerRun(None, note, None)
    print(f"power: {note}", file=sys.stderr, flush=True)
    monitor = PowerMonitor(backend, interval, already_open=True)
    try:
        monitor.start()
    except Exception as e:
        backend.close()
        if name == "auto":
            return PowerRun(None, f"not measured: {backend.name} failed at start ({e})", None)
        raise PowerBackendError(f"--power {name}: failed at start ({e})") from None
    return PowerRun(backend.name, note, monitor)


def _tokens_fig(win: dict, steady: bool, result: dict) -> None:
    """Add j_per_output_token and total_tokens_per_j to window dict ``win`` (see module docstring)."""
    e, w = win["energy_j"], win["total_kw"] * 1000.0
    win["j_per_output_token"] = None
    win["total_tokens_per_j"] = None
    if not steady and result.get("total_output_tokens") is not None:
        out_tok = float(result.get("total_output_tokens") or 0)
        all_tok = out_tok + float(result.get("total_input_tokens") or 0)
        win["token_source"] = "token counts"
        if e > 0:
            win["total_tokens_per_j"] = all_tok / e
        if out_tok > 0:
            win["j_per_output_token"] = e / out_tok
        return
    tot = result.get("steady_total_token_throughput") if steady else None
    out = result.get("steady_output_throughput") if steady else None
    src = "steady throughput"
    if tot is None:
        tot, out, src = result.get("total_token_throughput"), result.get("output_throughput"), "run throughput"
    win["token_source"] = src
    if tot and w > 0:
        win["total_tokens_per_j"] = float(tot) / w
    if out:
        win["j_per_output_token"] = w / float(out)


def _power_dict(run: PowerRun | None, result: dict, steady_window, args: argparse.Namespace) -> dict:
    if run is None:
        name = getattr(args, "power", "auto") or "auto"
        reason = "--power none" if name == "none" else f"--power {name}: measurement did not start"
        return {"measured": False, "reason": reason, "note": f"not measured: {reason}", "backend": None,
                "devices": [], "caps_w": [], "cap_total_kw": None, "samples": [], "whole_run": None, "steady": None}
    if run.monitor is None:
        return {"measured": False, "reason": run.note.removeprefix("not measured: "), "note": run.note,
                "backend": None, "devices": [], "caps_w": [], "cap_total_kw": None, "samples": [],
                "whole_run": None, "steady": None}
    mon = run.monitor
    mon.stop()
    caps = mon.caps_w
    power = {
        "measured": False,
        "reason": None,
        "note": run.note,
        "backend": run.backend,
        "method": mon.method,
        "devices": list(mon.backend.devices),
        "interval_s": mon.interval_s,
        "caps_w": caps,
        "cap_total_kw": sum(caps) / 1000.0 if caps and all(c is not None for c in caps) else None,
        "cap_source": mon.backend.cap_source,
        "samples": [[s.t, s.power_w] for s in mon.samples],
        "errors": list(mon.errors),
        "whole_run": mon.window(),
        "steady": None,
    }
    if run.backend == "rapl":
        power["scope"] = "CPU packages only (RAPL); accelerators are not included"
    if power["whole_run"] is None:
        power["reason"] = "fewer than two samples (run too short or backend reads failed)"
        return power
    power["measured"] = True
    _tokens_fig(power["whole_run"], False, result)
    if steady_window is not None:
        a, b = steady_window
        win = mon.window(a, b)
        if win is not None:
            _tokens_fig(win, True, result)
        power["steady"] = win
        power["steady_requested"] = [a, b]
    return power


def _cost_dict(result: dict, args: argparse.Namespace, power: dict) -> dict:
    from tokenfab.cost.model import compute_cost

    notes = []
    tok_s = result.get("total_token_throughput")
    devices = result.get("num_devices")
    if not devices:
        devices = max(1, len(power.get("devices") or []))
        notes.append(f"num_devices missing from the result; assumed {devices}")
    cap_kw, cap_src = power.get("cap_total_kw"), "read from devices"
    if cap_kw is None:
        cap_kw, cap_src = getattr(args, "power_cap_kw", None), "--power-cap-kw"
        if cap_kw is None:
            cap_src = None
            notes.append("no power cap read or given (--power-cap-kw): electricity at cap not priced")
    measured_kw, meas_src = None, None
    if power.get("steady"):
        measured_kw, meas_src = power["steady"]["total_kw"], "steady window"
    elif power.get("whole_run"):
        measured_kw, meas_src = power["whole_run"]["total_kw"], "whole run"
    prices = prices_from_args(args)
    if not tok_s or tok_s <= 0:
        return {"computed": False, "reason": "total_token_throughput missing or zero", "notes": notes}
    cost = compute_cost(float(tok_s), int(devices), prices, cap_kw=cap_kw, measured_kw=measured_kw)
    cost.update({"computed": True, "cap_source": cap_src, "measured_source": meas_src, "notes": notes})
    if power.get("scope"):
        notes.append("measured kW is " + power["scope"])
    return cost


def _num(x, spec):
    return "—" if x is None else format(x, spec)


def _per_dev(ws: list[float]) -> str:
    if len(ws) <= 4:
        return " / ".join(f"{x:,.0f}" for x in ws)
    return f"mean {sum(ws) / len(ws):,.0f} ({min(ws):,.0f}-{max(ws):,.0f})"


def _strip(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


def render_power_text(power: dict, width: int = 100, said: str | None = None) -> str:
    """The power block as plain text (rich table, no colour): backend, caps, and whole-run / steady figures.

    ``said``: the reason an earlier block of the same console output gave for not measuring; a block with the same
    reason then says so in one line instead of repeating it (``tokenfab demo`` runs several benchmarks)."""
    import io

    from rich import box
    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=False, color_system=None, highlight=False)
    if not power.get("measured"):
        reason = power.get("reason") or "unknown reason"
        con.print("Power: not measured (the reason given above)" if said and reason == said
                  else f"Power: not measured ({reason})")
        if power.get("note") and power.get("backend"):
            con.print(f"  {power['note']}")
        return buf.getvalue()
    devs = power["devices"]
    shown = ", ".join(devs) if len(devs) <= 4 else f"{devs[0]} .. {devs[-1]}"
    con.print(f"Power: {power['backend']}, {power['method']}, {len(devs)} device(s) ({shown}), "
              f"sampled every {power['interval_s']:g} s, {len(power['samples'])} samples")
    caps = power["caps_w"]
    total = power.get("cap_total_kw")
    if caps and all(c is not None for c in caps) and len(set(caps)) == 1:
        cap_txt = f"{len(caps)} x {caps[0]:,.0f} W"
    else:
        cap_txt = ", ".join(f"{d} {_num(c, ',.0f')} W" for d, c in zip(devs, caps))
    con.print(f"  caps: {cap_txt}" + (f" = {total:.3f} kW ({power.get('cap_source')})" if total else ""))
    if power.get("scope"):
        con.print(f"  scope: {power['scope']}")
    wins = [("whole run", power["whole_run"])]
    if power.get("steady_requested") is not None:
        wins.append(("steady window", power.get("steady")))
    t = Table(header_style="bold", box=box.SIMPLE_HEAD)
    t.add_column("")
    for name, _ in wins:
        t.add_column(name, justify="right")

    def row(label, fn):
        t.add_row(label, *[("—" if w is None else fn(w)) for _, w in wins])

    row("duration (s)", lambda w: f"{w['duration_s']:,.1f}")
    row("energy (J)", lambda w: f"{w['energy_j']:,.0f}")
    row("avg W per device", lambda w: _per_dev(w["avg_w_per_device"]))
    row("total kW", lambda w: f"{w['total_kw']:.3f}")
    row("J per output token", lambda w: _num(w.get("j_per_output_token"), ",.3f"))
    row("total tokens per J", lambda w: _num(w.get("total_tokens_per_j"), ",.3f"))
    con.print(t)
    if power.get("errors"):
        con.print(f"  sampling errors: {len(power['errors'])} (first: {power['errors'][0]})")
    return _strip(buf.getvalue())


def finish(run: PowerRun | None, result: dict, args: argparse.Namespace,
           steady_window: tuple[float, float] | None) -> str:
    """Stop sampling, put ``result["power"]`` and ``result["cost"]`` into ``result``, return the printed section
    (``args.power_reason_said``, where set: see :func:`render_power_text`'s ``said``).

    ``steady_window`` is (t_start, t_end) in time.time() seconds, or None for whole-run figures only.
    """
    from tokenfab.cost.model import render_cost_table

    power = _power_dict(run, result, steady_window, args)
    result["power"] = power
    cost = _cost_dict(result, args, power)
    result["cost"] = cost
    text = render_power_text(power, said=getattr(args, "power_reason_said", None))
    if cost.get("computed"):
        src = cost.get("measured_source")
        if src:
            title = f"Cost (measured kW from the {src})"
        elif getattr(args, "power_cap_kw", None):
            title = "Cost (no measured power; cap from --power-cap-kw)"
        else:
            title = "Cost (no measured power: give --power-cap-kw)"
        text += render_cost_table(cost, title=title)
    else:
        text += f"Cost: not computed ({cost['reason']})\n"
    return text
