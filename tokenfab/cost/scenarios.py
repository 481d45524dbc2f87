"""Price scenarios: the ``--kwh-price`` / ``--device-hour-price`` flags and the ``--cost-scenarios`` file.

Scenario file (TOML, or YAML with the same structure; chosen by extension .toml / .yaml / .yml)::

    # electricity prices, $ per kWh
    [[electricity]]
    name = "US industrial average"
    usd_per_kwh = 0.08

    [[electricity]]
    name = "EU industrial"
    usd_per_kwh = 0.20

    # rental prices, $ per device-hour
    [[rental]]
    name = "H100 on-demand"
    usd_per_device_hour = 2.95

A bare list of numbers is accepted too (``electricity = [0.08, 0.20]``, ``rental = [2.95, 5.99]``).

Prices used = the file's entries followed by the repeated flags. When neither gives an electricity price, the default
$0.10/kWh is used; rental rows appear only when some rental price is given.
"""
from __future__ import annotations

import argparse
import os

from tokenfab.cost.model import Price, PriceSet

DEFAULT_KWH_PRICE = 0.10


class ScenarioError(ValueError):
    """A bad price flag or scenario file; the message names the flag/file and the entry."""

    user_error = True


def add_price_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--kwh-price`` (repeatable, default 0.10 $/kWh), ``--device-hour-price`` (repeatable, $/device-hour) and
    ``--cost-scenarios FILE`` (TOML/YAML) to ``parser``."""
    parser.add_argument("--kwh-price", type=float, action="append", default=None, metavar="USD",
                        help=f"electricity price in $/kWh; repeat for several (default {DEFAULT_KWH_PRICE})")
    parser.add_argument("--device-hour-price", type=float, action="append", default=None, metavar="USD",
                        help="rental price in $ per device-hour; repeat for several")
    parser.add_argument("--cost-scenarios", default=None, metavar="FILE",
                        help="TOML or YAML file of [[electricity]] usd_per_kwh / [[rental]] usd_per_device_hour")


def _entries(doc: dict, key: str, value_key: str, path: str) -> list[Price]:
    raw = doc.get(key, [])
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ScenarioError(f"--cost-scenarios {path}: '{key}' must be a list (use [[{key}]] tables in TOML)")
    out = []
    for i, item in enumerate(raw):
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            name, value = "", item
        elif isinstance(item, dict):
            unknown = set(item) - {"name", value_key}
            if unknown:
                raise ScenarioError(f"--cost-scenarios {path}: {key}[{i}] has unknown key(s) {sorted(unknown)}; "
                                    f"expected name and {value_key}")
            if value_key not in item:
                raise ScenarioError(f"--cost-scenarios {path}: {key}[{i}] lacks {value_key}")
            name, value = str(item.get("name", "")), item[value_key]
        else:
            raise ScenarioError(f"--cost-scenarios {path}: {key}[{i}] must be a number or a table")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ScenarioError(f"--cost-scenarios {path}: {key}[{i}].{value_key} must be a number >= 0, "
                                f"got {value!r}")
        out.append(Price(float(value), name))
    return out


def load_scenarios(path: str) -> PriceSet:
    """Read a TOML (.toml) or YAML (.yaml/.yml) scenario file into a :class:`PriceSet`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--cost-scenarios: no such file {path}")
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".toml":
            import tomllib
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        elif ext in (".yaml", ".yml"):
            import yaml
            with open(path) as f:
                doc = yaml.safe_load(f) or {}
        else:
            raise ScenarioError(f"--cost-scenarios {path}: use a .toml, .yaml or .yml file")
    except ScenarioError:
        raise
    except Exception as e:
        raise ScenarioError(f"--cost-scenarios {path}: cannot parse ({e})") from None
    if not isinstance(doc, dict):
        raise ScenarioError(f"--cost-scenarios {path}: top level must be a table/mapping")
    unknown = set(doc) - {"electricity", "rental"}
    if unknown:
        raise ScenarioError(f"--cost-scenarios {path}: unknown key(s) {sorted(unknown)}; expected electricity, rental")
    return PriceSet(_entries(doc, "electricity", "usd_per_kwh", path),
                    _entries(doc, "rental", "usd_per_device_hour", path))


def prices_from_args(args: argparse.Namespace) -> PriceSet:
    """Merge ``--cost-scenarios`` entries with the repeated flags (see module docstring for the default)."""
    ps = PriceSet()
    path = getattr(args, "cost_scenarios", None)
    if path:
        ps = load_scenarios(path)
    for flag, attr in (("--kwh-price", "kwh_price"), ("--device-hour-price", "device_hour_price")):
        vals = getattr(args, attr, None)
        if vals is None:
            continue
        if not isinstance(vals, (list, tuple)):
            vals = [vals]
        for v in vals:
            if v is None or v < 0:
                raise ScenarioError(f"{flag} must be >= 0, got {v}")
            (ps.electricity if attr == "kwh_price" else ps.rental).append(Price(float(v)))
    if not ps.electricity:
        ps.electricity.append(Price(DEFAULT_KWH_PRICE, "default"))
    return ps
