"""Benchmark datasets: each yields :class:`SampleRequest` (prompt text, prompt_len tokens, expected_output_len tokens).

Four of vLLM's datasets (vllm/benchmarks/datasets), with its flag names and sampling rules so that the same file
and seed give the same requests in the same order:

- ``sharegpt`` (``--dataset-path`` a local ShareGPT JSON): entries with at least two ``conversations`` turns,
  shuffled with Python's ``random`` seeded by ``--seed`` (unless ``--disable-shuffle``); the prompt is turn 0's
  ``value`` (the human turn), the output length is the token count of turn 1 (the gpt turn) unless
  ``--sharegpt-output-len``. Both counts are ``len(tokenizer(text).input_ids)`` (special tokens the tokenizer adds
  included, as vLLM counts them). Pairs with a prompt or output under 4 tokens (the output check is skipped when
  the length is fixed), a prompt over 1024 tokens or a total over 2048 are skipped (vLLM's ``is_valid_sequence``).
- ``custom`` (``--dataset-path`` a local JSONL file): one JSON object per line with ``"prompt"`` and, optionally,
  ``"output_tokens"``; the output length is ``--custom-output-len`` (default 256) unless that is -1, then each
  line's ``output_tokens``. The prompt is wrapped in the tokenizer's chat template (one user turn, generation
  prompt) unless ``--skip-chat-template`` (tokenfab also skips it for ``--backend openai-chat``, where the server
  applies the template); shuffled with seed 0 (vLLM passes no seed to this dataset) unless ``--disable-shuffle``.
- both: with fewer usable samples than ``--num-prompts``, seeded random duplicates fill the list (vLLM's
  oversampling) unless ``--no-oversample``.

The ``prefix_repetition`` dataset follows vLLM's ``PrefixRepetitionRandomDataset``: ``--prefix-repetition-num-prefixes``
G random prefixes of ``--prefix-repetition-prefix-len`` tokens, each shared by ``num_prompts // G`` prompts that
append their own random suffix of ``--prefix-repetition-suffix-len`` tokens, all asking for
``--prefix-repetition-output-len`` tokens; shuffled (seeded) unless ``--disable-shuffle``. The workload of prefix
caching (a system prompt or few-shot block sent again and again).

The ``random`` dataset follows the workload of vLLM's ``RandomDataset`` (vllm/benchmarks/datasets, "random"):
token ids drawn from the tokenizer's vocabulary (special tokens excluded),
decoded to text, re-encoded and corrected so the prompt re-tokenizes to the sampled length. Lengths are drawn
uniformly from ``[floor(L * (1 - r)), ceil(L * (1 + r))]`` with ``r = --random-range-ratio``, and an optional shared
prefix of ``--random-prefix-len`` random tokens is prepended to every prompt.
"""
from __future__ import annotations

import copy
import json
import math
import os
import random
from dataclasses import dataclass
from typing import Any

from tokenfab.bench import BenchError
from tokenfab.jsonl import iter_jsonl

DATASET_NAMES = ("random", "sharegpt", "custom", "prefix_repetition")
FILE_DATASETS = ("sharegpt", "custom")  # need --dataset-path

# vLLM's is_valid_sequence defaults (from its original sample_sharegpt_requests).
_MIN_LEN, _MAX_PROMPT_LEN, _MAX_TOTAL_LEN = 4, 1024, 2048

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


def sample_prefix_repetition_requests(
    tokenizer: Any,
    num_requests: int,
    prefix_len: int = 256,
    suffix_len: int = 256,
    num_prefixes: int = 10,
    output_len: int = 128,
    seed: int = 0,
    disable_shuffle: bool = False,
) -> list[SampleRequest]:
    """Shared-prefix prompts (vLLM's ``prefix_repetition`` workload).

    Args:
        tokenizer: a Hugging Face tokenizer.
        num_requests: requests wanted; ``num_prefixes * (num_requests // num_prefixes)`` are made (as vLLM).
        prefix_len: tokens of each group's shared random prefix (>= 0).
        suffix_len: tokens of each prompt's own random suffix (>= 0; prefix_len + suffix_len >= 1).
        num_prefixes: number of groups (1 <= num_prefixes <= num_requests).
        output_len: ``max_tokens`` of every request (>= 1).
        seed: numpy ``default_rng`` seed (prompts) and Python ``random`` seed (the shuffle).
        disable_shuffle: keep the requests grouped by prefix, in order.

    Token ids are drawn from the tokenizer's non-special vocabulary; each prefix and each prompt is decoded and
    corrected to re-tokenize to its length, the prompt text being the prefix text followed by the suffix text (so
    every prompt of a group starts with exactly the same text; ``prompt_len`` is the prompt's re-tokenized length).

    Raises:
        BenchError: a length or count out of range (the message names the flag).
    """
    import numpy as np

    if num_prefixes < 1:
        raise BenchError(f"--prefix-repetition-num-prefixes must be >= 1, got {num_prefixes}.")
    if num_requests < num_prefixes:
        raise BenchError(f"--num-prompts ({num_requests}) must be >= --prefix-repetition-num-prefixes "
                         f"({num_prefixes}): each prefix needs at least one prompt.")
    if prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1:
        raise BenchError(f"--prefix-repetition-prefix-len and --prefix-repetition-suffix-len must be >= 0 and not "
                         f"both 0, got {prefix_len} and {suffix_len}.")
    if output_len < 1:
        raise BenchError(f"--prefix-repetition-output-len must be >= 1, got {output_len}.")
    rng = np.random.default_rng(seed)
    allowed = np.array(_allowed_token_ids(tokenizer, int(tokenizer.vocab_size)), dtype=np.int64)
    if len(allowed) == 0:
        raise BenchError("--tokenizer has no non-special tokens to build random prompts from.")

    def text_of(n: int) -> str:
        if n == 0:
            return ""
        ids = allowed[rng.integers(0, len(allowed), size=n)].tolist()
        return _fit_to_length(tokenizer, ids, n, allowed, rng)[0]

    per_prefix = num_requests // num_prefixes
    requests = []
    for _ in range(num_prefixes):
        prefix = text_of(prefix_len)
        for _ in range(per_prefix):
            prompt = prefix + text_of(suffix_len)
            requests.append(SampleRequest(prompt=prompt, prompt_len=len(_encode(tokenizer, prompt)),
                                          expected_output_len=int(output_len)))
    if not disable_shuffle:
        random.Random(seed).shuffle(requests)
    return requests


def _token_count(tokenizer: Any, text: str) -> int:
    """``len(tokenizer(text).input_ids)``: vLLM's count for file datasets (special tokens added by the tokenizer
    included)."""
    return len(tokenizer(text).input_ids)


def is_valid_sequence(prompt_len: int, output_len: int, skip_min_output_len_check: bool = False) -> bool:
    """vLLM's ShareGPT filter: prompt >= 4 tokens, output >= 4 (unless skipped), prompt <= 1024, total <= 2048."""
    return not (prompt_len < _MIN_LEN
                or (not skip_min_output_len_check and output_len < _MIN_LEN)
                or prompt_len > _MAX_PROMPT_LEN
                or prompt_len + output_len > _MAX_TOTAL_LEN)


def _oversample(samples: list[SampleRequest], num_requests: int, seed: int, no_oversample: bool,
                flag_hint: str) -> list[SampleRequest]:
    """Fill up to ``num_requests`` with seeded random duplicates (vLLM's ``maybe_oversample_requests``)."""
    if not samples:
        raise BenchError(f"{flag_hint} yielded no usable request.")
    if no_oversample or len(samples) >= num_requests:
        return samples
    rng = random.Random(seed)
    extra = [copy.deepcopy(rng.choice(samples)) for _ in range(num_requests - len(samples))]
    print(f"Oversampled {len(samples)} dataset requests to {num_requests} (--no-oversample turns this off).")
    return samples + extra


def _check_path(path: str | None, name: str) -> str:
    if not path:
        what = "a ShareGPT JSON file" if name == "sharegpt" else "a JSONL file with a \"prompt\" per line"
        raise BenchError(f"--dataset-name {name} needs --dataset-path: the local path of {what}.")
    if not os.path.isfile(path):
        raise BenchError(f"--dataset-path {path!r} is not a readable file (datasets are read from local files; "
                         "tokenfab downloads nothing).")
    return path


def sample_sharegpt_requests(
    tokenizer: Any,
    dataset_path: str,
    num_requests: int,
    output_len: int | None = None,
    seed: int = 0,
    disable_shuffle: bool = False,
    no_oversample: bool = False,
) -> list[SampleRequest]:
    """Requests from a local ShareGPT JSON file (vLLM's ``ShareGPTDataset``; rules in the module docstring).

    Args:
        tokenizer: a Hugging Face tokenizer (callable, returning ``input_ids``).
        dataset_path: a JSON list of ``{"conversations": [{"from": ..., "value": ...}, ...]}`` entries.
        num_requests: requests wanted (``--num-prompts``).
        output_len: ``--sharegpt-output-len``: a fixed ``max_tokens``; None uses each gpt turn's token count.
        seed: ``--seed`` for the shuffle and the oversampling.
        disable_shuffle, no_oversample: vLLM's ``--disable-shuffle`` and ``--no-oversample``.

    Raises:
        BenchError: a missing or malformed file, a turn without a text ``value``, or no entry passing the filter.
    """
    _check_path(dataset_path, "sharegpt")
    if output_len is not None and output_len < 1:
        raise BenchError(f"--sharegpt-output-len must be >= 1, got {output_len}.")
    try:
        with open(dataset_path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BenchError(f"--dataset-path {dataset_path!r} is not valid JSON (a ShareGPT file is one JSON list): "
                         f"{e}") from None
    if not isinstance(data, list):
        raise BenchError(f"--dataset-path {dataset_path!r}: a ShareGPT file is a JSON list of entries with "
                         f"\"conversations\", got a {type(data).__name__}.")
    entries = [e for e in data
               if isinstance(e, dict) and isinstance(e.get("conversations"), list) and len(e["conversations"]) >= 2]
    if not disable_shuffle:
        random.Random(seed).shuffle(entries)
    samples: list[SampleRequest] = []
    for entry in entries:
        if len(samples) >= num_requests:
            break
        turns = entry["conversations"][:2]
        if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns):
            ident = entry.get("id", "?")
            raise BenchError(f"--dataset-path {dataset_path!r}: entry id {ident!r} has a conversation turn without "
                             "a text \"value\".")
        prompt, completion = turns[0]["value"], turns[1]["value"]
        prompt_len = _token_count(tokenizer, prompt)
        n_out = _token_count(tokenizer, completion) if output_len is None else int(output_len)
        if not is_valid_sequence(prompt_len, n_out, skip_min_output_len_check=output_len is not None):
            continue
        samples.append(SampleRequest(prompt=prompt, prompt_len=prompt_len, expected_output_len=n_out))
    return _oversample(samples, num_requests, seed, no_oversample,
                       f"--dataset-path {dataset_path!r} (ShareGPT: 2+ turns, prompt 4-1024 tokens, output >= 4, "
                       "total <= 2048)")


def sample_custom_requests(
    tokenizer: Any,
    dataset_path: str,
    num_requests: int,
    output_len: int | None = 256,
    apply_chat_template: bool = True,
    disable_shuffle: bool = False,
    no_oversample: bool = False,
) -> list[SampleRequest]:
    """Requests from a local JSONL file (vLLM's ``CustomDataset``; rules in the module docstring).

    Args:
        tokenizer: a Hugging Face tokenizer (callable; ``apply_chat_template`` when ``apply_chat_template``).
        dataset_path: one JSON object per line with a string ``"prompt"`` and optionally an integer
            ``"output_tokens"``; blank lines are skipped.
        num_requests: requests wanted; <= 0 takes every line (as vLLM).
        output_len: ``--custom-output-len``; -1 or None reads each line's ``output_tokens``.
        apply_chat_template: wrap each prompt in the chat template (one user turn plus the generation prompt).
        disable_shuffle, no_oversample: vLLM's ``--disable-shuffle`` and ``--no-oversample``.

    Raises:
        BenchError: a missing file, a line that is not a JSON object with a string ``prompt``, a missing or
        non-integer ``output_tokens`` when the length comes from the file, or no chat template to apply.
    """
    _check_path(dataset_path, "custom")
    from_file = output_len is None or output_len == -1
    if not from_file and output_len < 1:
        raise BenchError(f"--custom-output-len must be >= 1, or -1 to read \"output_tokens\" from the file; "
                         f"got {output_len}.")
    rows: list[tuple[int, dict]] = []
    with open(dataset_path, encoding="utf-8") as f:
        for lineno, item in iter_jsonl(f, lambda lineno, e: BenchError(
                f"--dataset-path {dataset_path!r} line {lineno} is not JSON ({e.msg}); a custom dataset is JSONL: "
                "one {\"prompt\": ...} object per line.")):
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                raise BenchError(f"--dataset-path {dataset_path!r} line {lineno} has no string \"prompt\" field.")
            rows.append((lineno, item))
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise BenchError("the tokenizer has no chat template to wrap custom prompts in; pass --skip-chat-template "
                         "to send the prompts as they are (or --tokenizer with a chat template).")
    if not disable_shuffle:
        random.Random(0).shuffle(rows)  # vLLM's CustomDataset keeps its default seed 0
    if num_requests <= 0:
        num_requests = len(rows)
    samples: list[SampleRequest] = []
    for lineno, item in rows[:num_requests]:
        if from_file:
            value = item.get("output_tokens")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < 1:
                raise BenchError(f"--dataset-path {dataset_path!r} line {lineno}: \"output_tokens\" must be a "
                                 f"positive integer when --custom-output-len is -1, got {value!r}.")
            n_out = int(value)
        else:
            n_out = int(output_len)
        prompt = item["prompt"]
        if apply_chat_template:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                   add_generation_prompt=True, tokenize=False)
        samples.append(SampleRequest(prompt=prompt, prompt_len=_token_count(tokenizer, prompt),
                                     expected_output_len=n_out))
    return _oversample(samples, num_requests, 0, no_oversample, f"--dataset-path {dataset_path!r}")


def get_samples(args: Any, tokenizer: Any) -> list[SampleRequest]:
    """Build the dataset named by ``args.dataset_name`` from the flags in ``args`` (vLLM's names).

    Raises:
        BenchError: unknown ``--dataset-name``, or a dataset flag out of range.
    """
    name = getattr(args, "dataset_name", "random")
    if name not in DATASET_NAMES:
        raise BenchError(f"--dataset-name {name!r} is not supported; choose one of: {', '.join(DATASET_NAMES)}.")
    if name == "sharegpt":
        return sample_sharegpt_requests(
            tokenizer, args.dataset_path, args.num_prompts, output_len=args.sharegpt_output_len, seed=args.seed,
            disable_shuffle=args.disable_shuffle, no_oversample=args.no_oversample)
    if name == "prefix_repetition":
        return sample_prefix_repetition_requests(
            tokenizer, args.num_prompts, prefix_len=args.prefix_repetition_prefix_len,
            suffix_len=args.prefix_repetition_suffix_len, num_prefixes=args.prefix_repetition_num_prefixes,
            output_len=args.prefix_repetition_output_len, seed=args.seed, disable_shuffle=args.disable_shuffle)
    if name == "custom":
        skip = args.skip_chat_template or getattr(args, "backend", None) == "openai-chat"
        return sample_custom_requests(
            tokenizer, args.dataset_path, args.num_prompts, output_len=args.custom_output_len,
            apply_chat_template=not skip, disable_shuffle=args.disable_shuffle, no_oversample=args.no_oversample)
    return sample_random_requests(
        tokenizer,
        num_requests=args.num_prompts,
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        range_ratio=args.random_range_ratio,
        prefix_len=args.random_prefix_len,
        seed=args.seed,
    )
