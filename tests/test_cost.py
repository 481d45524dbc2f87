"""The cost model: the mission's worked example, a second case worked by hand, scenario files, the CLI."""
from __future__ import annotations

import json

import pytest

from tokenfab.cli import main
from tokenfab.cost.model import (Price, PriceSet, annual_electricity_usd, compute_cost, electricity_usd_per_mtok,
                                 rental_usd_per_mtok, tok_s_per_kw, usd)
from tokenfab.cost.scenarios import ScenarioError, load_scenarios


def test_worked_example():
    # 5,661 total tok/s on 6 devices capped at 800 W each = 4.8 kW.
    assert tok_s_per_kw(5661, 4.8) == pytest.approx(1179.375)                 # 5661 / 4.8
    assert round(tok_s_per_kw(5661, 4.8)) == 1179
    # 4.8 kW x $0.10/kWh x 1e6 / (5661 x 3600) = 480,000 / 20,379,600 = $0.02355 -> $0.024
    e = electricity_usd_per_mtok(4.8, 0.10, 5661)
    assert e == pytest.approx(480_000 / 20_379_600)
    assert usd(e) == "$0.024"
    # 6 x $2.95 x 1e6 / (5661 x 3600) = 17,700,000 / 20,379,600 = $0.8685 -> $0.87
    r = rental_usd_per_mtok(6, 2.95, 5661)
    assert r == pytest.approx(17_700_000 / 20_379_600)
    assert usd(r) == "$0.87"
    # 4.8 kW x 8760 h x $0.10 = $4,204.80 -> $4,205
    a = annual_electricity_usd(4.8, 0.10)
    assert a == pytest.approx(4204.8)
    assert usd(a) == "$4,205"


def test_second_case_by_hand():
    # 2,400 total tok/s on 4 devices capped at 700 W (2.8 kW), measured draw 2.4 kW,
    # electricity $0.15/kWh, rental $2.00/device-hour.
    c = compute_cost(2400, 4, PriceSet([Price(0.15)], [Price(2.00)]), cap_kw=2.8, measured_kw=2.4)
    assert c["tok_s_per_device"] == pytest.approx(600.0)                     # 2400 / 4
    assert c["tok_s_per_kw_cap"] == pytest.approx(857.142857)                # 2400 / 2.8
    assert c["tok_s_per_kw_measured"] == pytest.approx(1000.0)               # 2400 / 2.4
    e = c["electricity"][0]
    # tok/s x 3600 = 8,640,000 tokens per hour
    assert e["usd_per_mtok_cap"] == pytest.approx(0.0486111, rel=1e-5)      # 2.8 x 0.15 x 1e6 / 8.64e6 = 420,000 / 8.64e6
    assert e["usd_per_mtok_measured"] == pytest.approx(0.0416667, rel=1e-5)  # 2.4 x 0.15 x 1e6 / 8.64e6 = 360,000 / 8.64e6
    assert e["annual_usd_cap"] == pytest.approx(3679.2)                       # 2.8 x 8760 x 0.15
    assert e["annual_usd_measured"] == pytest.approx(3153.6)                  # 2.4 x 8760 x 0.15
    assert c["rental"][0]["usd_per_mtok"] == pytest.approx(0.9259259, rel=1e-6)  # 4 x 2.00 x 1e6 / 8.64e6 = 8e6 / 8.64e6


def test_missing_power_gives_none_not_error():
    c = compute_cost(1000, 2, PriceSet([Price(0.1)], []))
    assert c["tok_s_per_kw_cap"] is None and c["electricity"][0]["usd_per_mtok_cap"] is None
    with pytest.raises(ValueError, match="tokens/s"):
        compute_cost(0, 2, PriceSet())


def test_cli_worked_example(capsys):
    rc = main(["cost", "--total-tok-s", "5661", "--devices", "6", "--power-kw", "4.8", "--measured-kw", "4.18",
               "--kwh-price", "0.10", "--device-hour-price", "2.95", "--device-hour-price", "5.99"])
    out = capsys.readouterr().out
    assert rc == 0
    for s in ("1,179", "$0.024", "$0.87", "$4,205", "$5.99", "943.5"):
        assert s in out, s
    rc = main(["cost", "--total-tok-s", "5661", "--devices", "6", "--power-kw", "4.8", "--kwh-price", "0.10",
               "--device-hour-price", "2.95", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["tok_s_per_kw_cap"] == pytest.approx(1179.375)
    assert doc["electricity"][0]["annual_usd_cap"] == pytest.approx(4204.8)
    assert doc["rental"][0]["usd_per_mtok"] == pytest.approx(0.8685156, rel=1e-6)


def test_cli_default_kwh_and_bad_flag(capsys):
    main(["cost", "--total-tok-s", "5661", "--devices", "6", "--power-kw", "4.8", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert [e["usd_per_kwh"] for e in doc["electricity"]] == [0.10] and doc["rental"] == []
    rc = main(["cost", "--total-tok-s", "5661", "--devices", "0"])
    assert rc == 2 and "--devices" in capsys.readouterr().err


def test_scenario_files_toml_and_yaml(tmp_path, capsys):
    toml = tmp_path / "prices.toml"
    toml.write_text('[[electricity]]\nname = "cheap"\nusd_per_kwh = 0.05\n\n[[electricity]]\nname = "dear"\n'
                    'usd_per_kwh = 0.30\n\n[[rental]]\nname = "on-demand"\nusd_per_device_hour = 2.95\n')
    yaml = tmp_path / "prices.yaml"
    yaml.write_text("electricity: [0.05, 0.30]\nrental:\n  - {name: on-demand, usd_per_device_hour: 2.95}\n")
    for f in (toml, yaml):
        ps = load_scenarios(str(f))
        assert [p.value for p in ps.electricity] == [0.05, 0.30]
        assert [(p.name, p.value) for p in ps.rental] == [("on-demand", 2.95)]
    # file + repeated flags together
    main(["cost", "--total-tok-s", "5661", "--devices", "6", "--power-kw", "4.8", "--cost-scenarios", str(toml),
          "--device-hour-price", "5.99", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert [e["usd_per_kwh"] for e in doc["electricity"]] == [0.05, 0.30]
    assert [r["usd_per_device_hour"] for r in doc["rental"]] == [2.95, 5.99]
    # 0.30 $/kWh: 4.8 x 0.30 x 1e6 / 20,379,600 = 1,440,000 / 20,379,600 = 0.07066
    assert doc["electricity"][1]["usd_per_mtok_cap"] == pytest.approx(1_440_000 / 20_379_600)


def test_bad_scenario_names_flag(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[electricity]]\nusd_per_kwh = "ten cents"\n')
    with pytest.raises(ScenarioError, match="--cost-scenarios .*electricity\\[0\\]"):
        load_scenarios(str(bad))
    bad.write_text('[[rental]]\nprice = 2\n')
    with pytest.raises(ScenarioError, match="unknown key"):
        load_scenarios(str(bad))
    with pytest.raises(FileNotFoundError, match="--cost-scenarios"):
        load_scenarios(str(tmp_path / "missing.toml"))
