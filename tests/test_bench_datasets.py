"""The file datasets of ``tokenfab bench serve`` (vLLM's ``sharegpt`` and ``custom``) on small files written here.

Token counts are checked against the tokenizer itself (``len(tokenizer(text).input_ids)``, vLLM's count); the
sample order against Python's ``random`` shuffle with vLLM's seeds.
"""
from __future__ import annotations

import json
import random

import pytest

from tokenfab.bench import BenchError
from tokenfab.bench.datasets import get_samples, sample_custom_requests, sample_sharegpt_requests
from tokenfab.bench.serve import make_args

LONG_Q = "Please explain in a few words how a paged key value cache stores the tokens of many requests."
LONG_A = "It splits the cache into fixed blocks and keeps a table from each request's positions to its blocks."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tokenfab.testing.tokenizer_builder import build_tokenizer

    path = build_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab_size=512)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _n(tok, text):
    return len(tok(text).input_ids)


def _conv(q, a, extra=()):
    return {"id": q[:8], "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}, *extra]}


@pytest.fixture
def sharegpt_file(tmp_path):
    entries = [
        _conv("What does the scheduler do when the cache is full?", LONG_A),                         # 0 valid
        {"id": "one-turn", "conversations": [{"from": "human", "value": LONG_Q}]},                   # 1 < 2 turns
        _conv("hi", LONG_A),                                                                          # 2 prompt < 4
        _conv(LONG_Q, "Blocks of sixteen tokens each, shared by reference."),                        # 3 valid
        {"id": "no-conversations", "text": LONG_Q},                                                   # 4 no turns
        _conv("Why batch the decode step of all running sequences?", "ok"),                          # 5 output < 4
        _conv("How is the first token timed by the client?", LONG_A,
              [{"from": "human", "value": "and the rest?"}]),                                        # 6 valid, 3 turns
        _conv("x " * 1100, LONG_A),                                                                   # 7 prompt > 1024
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    return str(path), entries


def test_sharegpt_filters_and_counts_tokens(tokenizer, sharegpt_file):
    path, entries = sharegpt_file
    got = sample_sharegpt_requests(tokenizer, path, 10, disable_shuffle=True, no_oversample=True)
    want = [entries[i]["conversations"] for i in (0, 3, 6)]
    assert [r.prompt for r in got] == [c[0]["value"] for c in want]
    assert [r.prompt_len for r in got] == [_n(tokenizer, c[0]["value"]) for c in want]
    assert [r.expected_output_len for r in got] == [_n(tokenizer, c[1]["value"]) for c in want]
    # the filtered entries really are outside vLLM's bounds with this tokenizer
    assert _n(tokenizer, "hi") < 4 and _n(tokenizer, "ok") < 4 and _n(tokenizer, "x " * 1100) > 1024

    # --sharegpt-output-len fixes max_tokens and lifts the short-output filter (entry 5 comes back)
    fixed = sample_sharegpt_requests(tokenizer, path, 10, output_len=5, disable_shuffle=True, no_oversample=True)
    assert [r.prompt for r in fixed] == [entries[i]["conversations"][0]["value"] for i in (0, 3, 5, 6)]
    assert all(r.expected_output_len == 5 for r in fixed)


def test_sharegpt_shuffle_and_oversample_follow_vllm(tokenizer, sharegpt_file):
    path, entries = sharegpt_file
    # vLLM: keep entries with >= 2 turns, random.seed(seed); random.shuffle(...), then filter while sampling.
    two_turns = [e for e in entries if len(e.get("conversations", [])) >= 2]
    random.seed(7)
    random.shuffle(two_turns)
    valid_ids = {entries[i]["id"] for i in (0, 3, 6)}
    order = [e["conversations"][0]["value"] for e in two_turns if e["id"] in valid_ids]
    got = sample_sharegpt_requests(tokenizer, path, 3, seed=7)
    assert [r.prompt for r in got] == order
    # Oversampling to 5: the 2 extra are copies of sampled requests; --no-oversample keeps the 3.
    over = sample_sharegpt_requests(tokenizer, path, 5, seed=7)
    assert len(over) == 5 and [r.prompt for r in over[:3]] == order
    assert all(r.prompt in order for r in over[3:])
    assert len(sample_sharegpt_requests(tokenizer, path, 5, seed=7, no_oversample=True)) == 3
    assert len(sample_sharegpt_requests(tokenizer, path, 2, seed=7)) == 2


def test_sharegpt_bad_files(tokenizer, tmp_path):
    with pytest.raises(BenchError, match="--dataset-path .* not a readable file"):
        sample_sharegpt_requests(tokenizer, str(tmp_path / "missing.json"), 2)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(BenchError, match="not valid JSON"):
        sample_sharegpt_requests(tokenizer, str(bad), 2)
    bad.write_text(json.dumps({"conversations": []}))
    with pytest.raises(BenchError, match="JSON list"):
        sample_sharegpt_requests(tokenizer, str(bad), 2)
    bad.write_text(json.dumps([_conv("hi", "ok")]))
    with pytest.raises(BenchError, match="no usable request"):
        sample_sharegpt_requests(tokenizer, str(bad), 2)
    bad.write_text(json.dumps([{"id": "n", "conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]}]))
    with pytest.raises(BenchError, match="without a text \"value\""):
        sample_sharegpt_requests(tokenizer, str(bad), 2)


@pytest.fixture
def custom_file(tmp_path):
    rows = [{"prompt": "What is the capital of France?", "output_tokens": 7},
            {"prompt": "Write a factorial function in Python.", "output_tokens": 12},
            {"prompt": "Name three prime numbers.", "output_tokens": 3}]
    path = tmp_path / "custom.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[1:]) + "\n")
    return str(path), rows


def test_custom_jsonl(tokenizer, custom_file):
    path, rows = custom_file
    # Defaults as vLLM: --custom-output-len 256, chat template applied.
    got = sample_custom_requests(tokenizer, path, 3, disable_shuffle=True)
    want = [f"<|im_start|>user\n{r['prompt']}<|im_end|>\n<|im_start|>assistant\n" for r in rows]  # ChatML template
    assert [r.prompt for r in got] == want
    assert [r.prompt_len for r in got] == [_n(tokenizer, p) for p in want]
    assert all(r.expected_output_len == 256 for r in got)
    # --custom-output-len -1: each line's output_tokens; --skip-chat-template: the prompt as written.
    got = sample_custom_requests(tokenizer, path, 3, output_len=-1, apply_chat_template=False, disable_shuffle=True)
    assert [(r.prompt, r.expected_output_len) for r in got] == [(r["prompt"], r["output_tokens"]) for r in rows]
    assert [r.prompt_len for r in got] == [_n(tokenizer, r["prompt"]) for r in rows]
    # Shuffled with vLLM's fixed seed 0 (CustomDataset gets no --seed); <= 0 prompts takes the whole file.
    order = list(rows)
    random.seed(0)
    random.shuffle(order)
    got = sample_custom_requests(tokenizer, path, 0, output_len=4, apply_chat_template=False)
    assert [r.prompt for r in got] == [r["prompt"] for r in order] and all(r.expected_output_len == 4 for r in got)


def test_custom_errors(tokenizer, tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"prompt": "a b c d", "output_tokens": 3}\n{"prompt": "e f g"}\n')
    with pytest.raises(BenchError, match="line 2: \"output_tokens\" must be a positive integer"):
        sample_custom_requests(tokenizer, str(path), 2, output_len=-1, disable_shuffle=True)
    path.write_text('{"prompt": "a"}\n{"prompt": 5}\n')
    with pytest.raises(BenchError, match="line 2 has no string \"prompt\""):
        sample_custom_requests(tokenizer, str(path), 2)
    path.write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(BenchError, match="line 2 is not JSON"):
        sample_custom_requests(tokenizer, str(path), 2)
    with pytest.raises(BenchError, match="--custom-output-len must be >= 1"):
        sample_custom_requests(tokenizer, str(path), 2, output_len=0)


def test_get_samples_uses_vllm_flags(tokenizer, custom_file, sharegpt_file):
    path, rows = custom_file
    # openai-chat: the server applies the chat template, so the client sends the raw prompt
    args = make_args(dataset_name="custom", dataset_path=path, num_prompts=3, backend="openai-chat",
                     custom_output_len=9, disable_shuffle=True)
    assert [(r.prompt, r.expected_output_len) for r in get_samples(args, tokenizer)] == \
        [(r["prompt"], 9) for r in rows]
    args = make_args(dataset_name="sharegpt", dataset_path=sharegpt_file[0], num_prompts=2, sharegpt_output_len=6,
                     disable_shuffle=True)
    assert [r.expected_output_len for r in get_samples(args, tokenizer)] == [6, 6]
