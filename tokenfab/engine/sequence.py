"""One generated sequence and its state while it moves through the scheduler."""
from __future__ import annotations

import enum

import torch

from tokenfab.logprobs import Logprob
from tokenfab.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is: waiting to be scheduled (new or preempted), running (holds KV blocks), or finished."""
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request's token stream (prompt + generated) and its progress through the KV cache.

    Attributes:
        token_ids: prompt then generated token ids.
        num_prompt_tokens: length of the original prompt (tokens).
        num_computed_tokens: tokens whose K/V are in the cache (prefill progress; reset to 0 on preemption).
        block_table: KV-pool block ids holding this sequence's tokens, in order (shared blocks of a prefix-cache
            hit first).
        row: this sequence's row in the model runner's persistent input arrays, or -1 while not running.
        generator: per-request RNG (seeded) or None to use the engine's generator.
    """

    def __init__(self, seq_id: int, request_id: str, index: int, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float):
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # prefix caching: hashes of the full blocks of token_ids (prefix_cache.py)
        self.num_cached_blocks = 0  # prefix caching: leading block_table entries whose hash is registered
        self.snapshot_junction = 0  # prefix caching, hybrid models: extra state-snapshot boundary (tokens), or 0
        self.row = -1
        self.params = params
        self.status = SequenceStatus.WAITING
        self.arrival_time = arrival_time
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.output_logprobs: list[dict[int, Logprob]] = []  # tokenfab/logprobs.py
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.generator: torch.Generator | None = None
        self.bad_words_token_ids: list[list[int]] = []  # params.bad_words encoded (engine.add_request)
        self.grammar = None  # params.structured_outputs compiled (xgrammar CompiledGrammar; engine.add_request)
        self.priority = 0  # the request's priority (lower runs earlier under scheduling_policy "priority")
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed + index)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while prompt logprobs are requested and not all computed yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
