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
