"""A short smoke run of benchmarks/soak.py (the 600 s report is benchmarks/results/2026-12-01-soak.md): a handful
of streaming clients on the tiny model with a pool small enough for the bursts to run past it, disconnects and bad
requests; afterwards none is lost or duplicated and nothing leaked (blocks, batch rows, /metrics gauges)."""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_soak_smoke(tmp_path):
    sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
    try:
        import soak
    finally:
        sys.path.pop(0)
    stem = str(tmp_path / "soak")
    rc = soak.main(["--model", "tiny", "--duration", "6", "--clients", "4", "--burst-every", "2", "--burst-size", "4",
                    "--bad-every", "0.5", "--num-kv-blocks", "24", "--max-model-len", "384", "--max-num-seqs", "16", "--max-tokens", "24",
                    "--workdir", str(tmp_path / "work"), "--out", stem])
    rep = json.load(open(stem + ".json"))
    assert rc == 0 and rep["passed"], (rep["checks"], rep["summary"]["lost_examples"][:3])
    kinds = rep["summary"]["by_kind"]
    assert any(k.startswith("burst_") for k in kinds) and any(k.startswith("bad_") for k in kinds), kinds
    outcomes = rep["summary"]["outcomes"]
    assert outcomes.get("complete", 0) > 0 and outcomes.get("refused_400", 0) > 0, outcomes
    # the server's finished-request counter equals the choices the clients started (none lost, none counted twice)
    assert rep["server_finished_choices"] == rep["summary"]["choices_started"] > 0
    assert rep["engine_after"]["free_blocks"] == rep["engine_after"]["num_blocks"] == 24
