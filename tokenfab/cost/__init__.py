"""Cost model (tokens per device, per kW, per dollar), price scenarios and the benchmark report.

* :mod:`.model` — formulas and the rich cost table;
* :mod:`.scenarios` — ``--kwh-price`` / ``--device-hour-price`` flags and the TOML/YAML scenario file;
* :mod:`.report` — ``tokenfab report``: Markdown tables and SVG/PNG charts over saved runs and peer figures.
"""
from tokenfab.cost.model import (
    Price,
    PriceSet,
    annual_electricity_usd,
    compute_cost,
    electricity_usd_per_mtok,
    rental_usd_per_mtok,
    tok_s_per_device,
    tok_s_per_kw,
)

__all__ = ["Price", "PriceSet", "annual_electricity_usd", "compute_cost", "electricity_usd_per_mtok",
           "rental_usd_per_mtok", "tok_s_per_device", "tok_s_per_kw"]
