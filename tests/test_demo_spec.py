"""``tokenfab demo --speculative-config``: the side-by-side table's numbers come from the engines' counters, tokens
compared at T = 0, bad flags refused in one line (tokenfab/commands/demo_spec.py, tokenfab/commands/demo.py)."""
from __future__ import annotations

import pytest

from tokenfab import LLM
from tokenfab.cli import main
from tokenfab.commands import demo_spec


def test_table_acceptance_equals_engine_counters(tiny_model, monkeypatch):
    """Every LLM.generate call is wrapped to record its engine's counters before and after, independently of
    demo_spec's own bookkeeping; the table's acceptance rate / length must be vLLM's formulas on the timed call's
    deltas. Target as its own draft in float32 at T = 0: every draft accepted (100.0%) and tokens identical; a
    draft with unrelated weights at T = 1 accepts fewer."""
    path = tiny_model("llama")
    seen = []  # (engine id, speculating?, counters before, counters after) per generate call, in order
    orig = LLM.generate

    def spy(self, *a, **kw):
        keys = demo_spec.COUNTERS
        before = {k: int(self.llm_engine.get_stats().get(k, 0)) for k in keys}
        out = orig(self, *a, **kw)
        after = {k: int(self.llm_engine.get_stats().get(k, 0)) for k in keys}
        seen.append((self.llm_engine.spec is not None, before, after))
        return out

    monkeypatch.setattr(LLM, "generate", spy)
    bad = tiny_model("llama", seed=7, num_hidden_layers=1)
    for draft, perfect in ((path, True), (bad, False)):
        seen.clear()
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "verify_token_cost": 0.0,
                "verify_step_overhead": 0.0, "random_row_cost": 0.0}
        res = demo_spec.compare(path, spec, [0.0, 1.0], num_prompts=3, input_len=10, output_len=8,
                                max_concurrency=2, dtype="float32")
        spec_calls = [s for s in seen if s[0]]
        assert len(spec_calls) == 4  # per temperature: warm-up, timed
        heads, metrics = demo_spec.table_cells(res)
        assert heads == ["T=0 off", "T=0 spec", "T=1 off", "T=1 spec"]
        cells = dict(metrics)
        for i, (_, before, after) in enumerate(spec_calls[1::2]):  # the timed calls
            d = {k: after[k] - before[k] for k in after}
            assert d["spec_decode_num_drafts"] > 0
            rate = d["spec_decode_num_accepted_tokens"] / d["spec_decode_num_draft_tokens"]
            length = 1 + d["spec_decode_num_accepted_tokens"] / d["spec_decode_num_drafts"]
            col = 2 * i + 1
            assert cells["Acceptance rate"][col] == f"{100 * rate:.1f}%"
            assert cells["Mean acceptance length"][col] == f"{length:.2f}"
            assert res["rows"][i]["spec"]["counters"] == d
            if perfect:
                assert d["spec_decode_num_accepted_tokens"] == d["spec_decode_num_draft_tokens"]
            elif i == 1:
                assert d["spec_decode_num_accepted_tokens"] < d["spec_decode_num_draft_tokens"]
        assert cells["Tokens identical to off"][1] == "yes" and cells["Tokens identical to off"][3] == "-"
        assert res["rows"][0]["plain"]["output_tokens"] == 3 * 8 == res["rows"][0]["spec"]["output_tokens"]
    md = demo_spec.markdown(res)
    assert "| Acceptance rate |" in md and "T=1 spec" in md


def test_rich_table_prints_every_column(tiny_model):
    from rich.console import Console

    path = tiny_model("llama")
    res = demo_spec.compare(path, {"method": "ngram", "num_speculative_tokens": 2}, [0.0], num_prompts=2,
                            input_len=8, output_len=6, max_concurrency=2, dtype="float32")
    con = Console(record=True, width=200)
    demo_spec.print_table(res, console=con)
    text = con.export_text()
    for name, cells in demo_spec.table_cells(res)[1]:
        assert name in text
        assert all(c in text for c in cells)


@pytest.mark.parametrize("value, names", [
    ("{bad", ["--speculative-config", "JSON"]),
    ('{"method": "ngram"}', ["--speculative-config", "num_speculative_tokens"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_k": 1}', ["--speculative-config", "draft_k"]),
    ('{"method": "draft_model", "num_speculative_tokens": 2, "model": "/no/such.gguf"}',
     ["--speculative-config", "speculative_config.model"]),
    ("{}", ["--speculative-config", "empty"]),
])
def test_bad_flag_is_one_line_naming_the_field(value, names, capsys, tmp_path):
    rc = main(["demo", "--speculative-config", value, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    for n in names:
        assert n in err
