"""Benchmark datasets: each yields :class:`SampleRequest` (prompt text, prompt_len tokens, expected_output_len tokens).

Only the ``random`` dataset exists today. It follows the workload of vLLM's ``RandomDataset``
(vllm/benchmarks/datasets, "random"): token ids drawn from the tokenizer's vocabulary (special tokens excluded),
decoded to text, re-encoded and corrected so the prompt re-tokenizes to the sampled length. Lengths are drawn
uniformly from ``[floor(L * (1 - r)), ceil(L * (1 + r))]`` with ``r = --random-range-ratio``, and an optional shared
prefix of ``--random-prefix-len`` random tokens is prepended to every prompt.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tokenfab.bench import BenchError

DATASET_NAMES = ("random",)

# Decode -> re-encode can merge or split tokens (byte-level BPE); correct the sequence this many times at most.
_MAX_FIX_ROUNDS = 10


@dataclass
class SampleRequest:
    """One benchmark prompt.

    Attributes:
        prompt: the prompt text sent to the server.
        prompt_len: its length in tokens, as the benchmark tokenizer encodes it (no special tokens added).
        expected_output_len: the ``max_tokens`` to request (tokens).
    """

    prompt: str
    prompt_len: int
    expected_output_len: int


def _num_special_tokens_to_add(tokenizer: Any) -> int:
    try:
        return int(tokenizer.num_special_tokens_to_add())
    except Exception:  # some tokenizers do not implement it
        return 0


def _allowed_token_ids(tokenizer: Any, vocab_size: int) -> list[int]:
    """Vocabulary ids prompts are drawn from: not special, not added, and decoding alone to valid text.

    vLLM excludes only the special ids. tokenfab also drops added tokens (chat markers a server may parse) and
    tokens that decode to invalid UTF-8 on their own (lone bytes of multi-byte characters: they decode to U+FFFD,
    which re-tokenizes differently and, in small vocabularies, makes many prompts collapse to the same text).
    """
    excluded = set(int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []))
    try:
        excluded |= set(int(i) for i in tokenizer.added_tokens_decoder)
    except Exception:
        pass
    cand = [i for i in range(vocab_size) if i not in excluded]
    try:
        texts = tokenizer.batch_decode([[i] for i in cand], skip_special_tokens=False)
    except Exception:
        return cand
    ok = [i for i, t in zip(cand, texts) if t and "\ufffd" not in t]
    return ok or cand


def _sampling_bounds(length: int, range_ratio: float, minimum: int) -> tuple[int, int]:
    low = max(minimum, math.floor(length * (1.0 - range_ratio)))
    high = max(low, math.ceil(length * (1.0 + range_ratio)))
    return low, high


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _fit_to_length(tokenizer: Any, token_ids: list[int], target_len: int, allowed, rng) -> tuple[str, int]:
    """Decode ``token_ids`` to text whose re-encoding has ``target_len`` tokens (as close as possible).

    Returns ``(text, actual_len)``. Re-encoding can merge or split tokens; each round truncates an over-long
    encoding or pads a short one with random allowed tokens, then decodes again.
    """
    ids = list(token_ids)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    best = (text, len(_encode(tokenizer, text)))
    for _ in range(_MAX_FIX_ROUNDS):
        re_ids = _encode(tokenizer, text)
        n = len(re_ids)
        if abs(n - target_len) < abs(best[1] - target_len):
            best = (text, n)
        if n == target_len:
            return text, n
        if n > target_len:
            ids = re_ids[:target_len]
        else:
            extra = allowed[rng.integers(0, len(allowed), size=target_len - n)].tolist()
            ids = re_ids + extra
        text = tokenizer.decode(ids, skip_special_tokens=False)
    n = len(_encode(tokenizer, text))
    if abs(n - target_len) <= abs(best[1] - target_len):
        best = (text, n)
    return best


def sample_random_requests(
    tokenizer: Any,
    num_requests: int,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Build ``num_requests`` random prompts (the vLLM "random" workload).

    Args:
        tokenizer: a Hugging Face tokenizer (``encode``, ``decode``, ``vocab_size``, ``all_special_ids``).
        num_requests: number of prompts.
        input_len: mean prompt length in tokens, excluding ``prefix_len`` (the tokenizer's
            ``num_special_tokens_to_add()`` is subtracted, as the server adds those).
        output_len: mean requested output length in tokens (``max_tokens``); at least 1.
        range_ratio: r in [0, 1); lengths are uniform integers in ``[floor(L(1-r)), ceil(L(1+r))]``.
        prefix_len: tokens of a random prefix shared by every prompt.
        seed: numpy ``default_rng`` seed; the same seed and tokenizer give the same prompts.

    Each prompt's body is ``allowed[(offset + i + arange(n)) % len(allowed)]`` with a random per-request offset
    (distinct prompts, no accidental prefix sharing), decoded to text and corrected so it re-tokenizes to
    ``prefix_len + n`` tokens (``prompt_len`` reports the exact re-tokenized length).

    Raises:
        BenchError: a length or ratio out of range (the message names the flag).
    """
    import numpy as np

    if num_requests < 1:
        raise BenchError(f"--num-prompts must be >= 1, got {num_requests}.")
    if not 0.0 <= range_ratio < 1.0:
        raise BenchError(f"--random-range-ratio must be in [0, 1), got {range_ratio}.")
    if prefix_len < 0:
        raise BenchError(f"--random-prefix-len must be >= 0, got {prefix_len}.")
    if output_len < 1:
        raise BenchError(f"--random-output-len must be >= 1, got {output_len}.")
    real_input_len = max(0, int(input_len) - _num_special_tokens_to_add(tokenizer))
    in_low, in_high = _sampling_bounds(real_input_len, range_ratio, 0)
    out_low, out_high = _sampling_bounds(int(output_len), range_ratio, 1)
    if prefix_len + in_low < 1:
        raise BenchError(
            f"--random-input-len {input_len} is too small: with --random-range-ratio {range_ratio} and "
            f"--random-prefix-len {prefix_len} a prompt could have 0 tokens."
        )

    rng = np.random.default_rng(seed)
    vocab_size = int(tokenizer.vocab_size)
    allowed = np.array(_allowed_token_ids(tokenizer, vocab_size), dtype=np.int64)
    if len(allowed) == 0:
        raise BenchError("--tokenizer has no non-special tokens to build random prompts from.")

    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    offsets = rng.integers(0, vocab_size, size=num_requests)
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist() if prefix_len > 0 else []

    requests = []
    for i in range(num_requests):
        n = int(input_lens[i])
        body = allowed[(int(offsets[i]) + i + np.arange(n)) % len(allowed)].tolist()
        text, actual = _fit_to_length(tokenizer, prefix + body, prefix_len + n, allowed, rng)
        requests.append(SampleRequest(prompt=text, prompt_len=actual, expected_output_len=int(output_lens[i])))
    return requests


def get_samples(args: Any, tokenizer: Any) -> list[SampleRequest]:
    """Build the dataset named by ``args.dataset_name`` from the ``--random-*`` flags in ``args``.

    Raises:
        BenchError: unknown ``--dataset-name``.
    """
    name = getattr(args, "dataset_name", "random")
    if name not in DATASET_NAMES:
        raise BenchError(f"--dataset-name {name!r} is not supported; choose one of: {', '.join(DATASET_NAMES)}.")
    return sample_random_requests(
        tokenizer,
        num_requests=args.num_prompts,
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        range_ratio=args.random_range_ratio,
        prefix_len=args.random_prefix_len,
        seed=args.seed,
    )
