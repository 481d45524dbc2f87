"""The cost model: tokens per device, per kW and per dollar from a throughput, a device count and a power draw.

Formulas (tok/s = total tokens per second, input + output; kW = total electrical draw of the serving devices):

* tok/s per device = tok/s ÷ devices
* tok/s per kW = tok/s ÷ kW   (at the configured cap, and at the measured draw)
* electricity $ per million tokens = kW × $/kWh × 1e6 ÷ (tok/s × 3600)
* rental $ per million tokens = devices × $/device-hour × 1e6 ÷ (tok/s × 3600)
* annual electricity $ at continuous draw = kW × 8760 h × $/kWh

Worked example (tests/test_cost.py): 5,661 tok/s on 6 devices capped at 800 W (4.8 kW) → 1,179 tok/s per kW;
$0.024 per million tokens at $0.10/kWh; $0.87 per million at $2.95 per device-hour; $4,205 a year at 4.8 kW.
"""
from __future__ import annotations

from dataclasses import dataclass, field

HOURS_PER_YEAR = 8760.0
SECONDS_PER_HOUR = 3600.0


@dataclass
class Price:
    """A named price: ``value`` is $/kWh for electricity or $/device-hour for rental."""

    value: float
    name: str = ""


@dataclass
class PriceSet:
    """The electricity ($/kWh) and rental ($/device-hour) prices to evaluate together."""

    electricity: list[Price] = field(default_factory=list)
    rental: list[Price] = field(default_factory=list)


def tok_s_per_device(total_tok_s: float, devices: int) -> float:
    """Total tokens/s per device = tok/s ÷ devices."""
    return total_tok_s / devices


def tok_s_per_kw(total_tok_s: float, kw: float) -> float:
    """Total tokens/s per kW = tok/s ÷ kW."""
    return total_tok_s / kw


def electricity_usd_per_mtok(kw: float, usd_per_kwh: float, total_tok_s: float) -> float:
    """Electricity $ per million total tokens = kW × $/kWh × 1e6 ÷ (tok/s × 3600)."""
    return kw * usd_per_kwh * 1e6 / (total_tok_s * SECONDS_PER_HOUR)


def rental_usd_per_mtok(devices: int, usd_per_device_hour: float, total_tok_s: float) -> float:
    """Rental $ per million total tokens = devices × $/device-hour × 1e6 ÷ (tok/s × 3600)."""
    return devices * usd_per_device_hour * 1e6 / (total_tok_s * SECONDS_PER_HOUR)


def annual_electricity_usd(kw: float, usd_per_kwh: float) -> float:
    """Electricity $ per year at a continuous draw of ``kw`` = kW × 8760 h × $/kWh."""
    return kw * HOURS_PER_YEAR * usd_per_kwh


def _pos(x: float | None) -> float | None:
    return float(x) if x is not None and x > 0 else None


def compute_cost(total_tok_s: float, devices: int, prices: PriceSet, cap_kw: float | None = None,
                 measured_kw: float | None = None) -> dict:
    """All cost figures as a JSON-ready dict.

    Args:
        total_tok_s: total (input + output) tokens/s of the run.
        devices: number of devices serving it.
        prices: electricity ($/kWh) and rental ($/device-hour) prices.
        cap_kw: configured power cap of all devices together, kW (None when unknown).
        measured_kw: measured average draw, kW (None when not measured).

    Figures that need a missing input are None.
    """
    if total_tok_s is None or total_tok_s <= 0:
        raise ValueError(f"total tokens/s must be > 0 (got {total_tok_s})")
    if devices is None or int(devices) < 1:
        raise ValueError(f"devices must be >= 1 (got {devices})")
    devices = int(devices)
    cap_kw, measured_kw = _pos(cap_kw), _pos(measured_kw)
    out = {
        "total_tok_s": float(total_tok_s),
        "devices": devices,
        "cap_kw": cap_kw,
        "measured_kw": measured_kw,
        "tok_s_per_device": tok_s_per_device(total_tok_s, devices),
        "tok_s_per_kw_cap": tok_s_per_kw(total_tok_s, cap_kw) if cap_kw else None,
        "tok_s_per_kw_measured": tok_s_per_kw(total_tok_s, measured_kw) if measured_kw else None,
        "electricity": [],
        "rental": [],
    }
    for p in prices.electricity:
        out["electricity"].append({
            "name": p.name,
            "usd_per_kwh": p.value,
            "usd_per_mtok_cap": electricity_usd_per_mtok(cap_kw, p.value, total_tok_s) if cap_kw else None,
            "usd_per_mtok_measured":
                electricity_usd_per_mtok(measured_kw, p.value, total_tok_s) if measured_kw else None,
            "annual_usd_cap": annual_electricity_usd(cap_kw, p.value) if cap_kw else None,
            "annual_usd_measured": annual_electricity_usd(measured_kw, p.value) if measured_kw else None,
        })
    for p in prices.rental:
        out["rental"].append({
            "name": p.name,
            "usd_per_device_hour": p.value,
            "usd_per_mtok": rental_usd_per_mtok(devices, p.value, total_tok_s),
            "annual_usd": devices * p.value * HOURS_PER_YEAR,
        })
    return out


def _fmt(x: float | None, spec: str, prefix: str = "") -> str:
    return "—" if x is None else f"{prefix}{x:{spec}}"


def usd(x: float | None) -> str:
    """Dollars rounded for reading: $4,205 (≥ 100), $0.87 (≥ 0.1), $0.024 (≥ 0.01), $0.0047 (2 significant)."""
    if x is None:
        return "—"
    a = abs(x)
    if a >= 100:
        return f"${x:,.0f}"
    if a >= 0.1:
        return f"${x:,.2f}"
    if a >= 0.01:
        return f"${x:.3f}"
    return f"${x:.2g}" if x else "$0"


def price(x: float) -> str:
    """A unit price as typed: $0.10, $2.95, $0.085."""
    return f"${x:.2f}" if round(x, 2) == x else f"${x:g}"


def render_cost_table(cost: dict, title: str = "Cost", width: int = 100) -> str:
    """The cost figures as rich tables rendered to plain text (no colour codes).

    Three blocks: throughput per device / per kW; electricity per $/kWh price ($/M tokens and $/year, at the cap
    and at the measured draw); rental per $/device-hour price ($/M tokens).
    """
    import io

    from rich import box
    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None, highlight=False)

    t = Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD)
    for col in ("total tok/s", "devices", "tok/s/device", "cap kW", "measured kW", "tok/s/kW cap",
                "tok/s/kW measured"):
        t.add_column(col, justify="right")
    t.add_row(f"{cost['total_tok_s']:,.1f}", str(cost["devices"]), f"{cost['tok_s_per_device']:,.1f}",
              _fmt(cost["cap_kw"], ",.3f"), _fmt(cost["measured_kw"], ",.3f"),
              _fmt(cost["tok_s_per_kw_cap"], ",.0f"), _fmt(cost["tok_s_per_kw_measured"], ",.0f"))
    console.print(t)

    if cost["electricity"]:
        t = Table(title="Electricity", title_justify="left", header_style="bold", box=box.SIMPLE_HEAD)
        t.add_column("$/kWh", justify="right")
        t.add_column("scenario")
        for col in ("$/M tok at cap", "$/M tok measured", "$/year at cap", "$/year measured"):
            t.add_column(col, justify="right")
        for e in cost["electricity"]:
            t.add_row(price(e["usd_per_kwh"]), e["name"] or "", usd(e["usd_per_mtok_cap"]),
                      usd(e["usd_per_mtok_measured"]), usd(e["annual_usd_cap"]), usd(e["annual_usd_measured"]))
        console.print(t)
    if cost["rental"]:
        t = Table(title="Rental", title_justify="left", header_style="bold", box=box.SIMPLE_HEAD)
        t.add_column("$/device-hour", justify="right")
        t.add_column("scenario")
        t.add_column("$/M tok", justify="right")
        for r in cost["rental"]:
            t.add_row(price(r["usd_per_device_hour"]), r["name"] or "", usd(r["usd_per_mtok"]))
        console.print(t)
    for n in cost.get("notes") or []:
        console.print(f"note: {n}")
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"
