"""Incremental detokenization: the text built delta by delta equals transformers' decode of the whole output, with
and without special tokens, for the fast tokenizer's backend decode and for transformers' own decode."""
from __future__ import annotations

import random

import pytest

from tokenfab.engine.detokenizer import IncrementalDetokenizer, decode_fn


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("backend", [True, False])
def test_incremental_text_equals_transformers_decode(tokenizer_dir, skip, backend, monkeypatch):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if backend:
        assert decode_fn(tok) == tok.backend_tokenizer.decode  # this fast tokenizer takes the backend path
    else:
        monkeypatch.setattr(tok, "clean_up_tokenization_spaces", True, raising=False)
        assert decode_fn(tok) == tok.decode
    rng = random.Random(0)
    specials = sorted(set(tok.all_special_ids))
    for trial in range(20):
        ids = [rng.randrange(len(tok)) if rng.random() > 0.1 else rng.choice(specials) for _ in range(40)]
        d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        out, text = [], ""
        for t in ids:
            out.append(t)
            delta, stop = d.update(out)
            assert stop is None
            text += delta
        want = AutoTokenizer.from_pretrained(tokenizer_dir).decode(ids, skip_special_tokens=skip)
        assert d.text == text
        assert want.startswith(text) and (text == want or want[len(text):] == "\ufffd" * (len(want) - len(text)))


def test_finish_flushes_an_incomplete_character(tokenizer_dir):
    """After finish() the text is exactly decode(ids), also when the ids end inside a multi-byte character (its
    bytes decode to U+FFFD, which update() holds back while more tokens may complete it)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(1)
    tails = 0
    for trial in range(60):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 30))]
        d = IncrementalDetokenizer(tok)
        for i in range(1, len(ids) + 1):
            d.update(ids[:i])
        want = tok.decode(ids, skip_special_tokens=True)
        tails += d.text != want
        d.finish(ids)
        assert d.text == want
    assert tails >= 5  # the case under test occurs


def test_stop_strings_are_not_searched_below_min_tokens(tokenizer_dir):
    """update(check_stop=False) appends text without cutting a stop string; later updates find only stop strings
    that end in their new text, so the text stays a prefix of decode(ids)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok("the model said the word twice: the end", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok, stop=["the"])
    for i in range(1, 3):
        assert d.update(ids[:i], check_stop=False)[1] is None
    assert d.text.startswith("the")
    stop = None
    for i in range(3, len(ids) + 1):
        _, stop = d.update(ids[:i])
        if stop:
            break
    assert stop == "the" and d.text == "the model said "
    assert tok.decode(ids).startswith(d.text)
