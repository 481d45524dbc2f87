"""Per-request sampling settings, in vLLM's public shape."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    Args:
        n: completions per prompt (each runs as its own sequence; seeds are derived as seed + i).
        temperature: 0 means greedy (argmax); otherwise logits are divided by it before softmax.
        top_p: nucleus mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; -1 (or 0) disables.
        max_tokens: most tokens to generate (tokens).
        min_tokens: EOS and stop strings are ignored until this many tokens were generated.
        seed: per-request RNG seed; the same seed gives the same output whatever the batch mates.
        stop: strings that end generation; the stop string is not included in the text.
        stop_token_ids: extra token ids that end generation (besides the model's EOS).
        ignore_eos: keep generating after EOS (benchmarks).
        logprobs: number of top logprobs to return per generated token (the sampled token's logprob is always
            included); None returns none.
        prompt_logprobs: number of top logprobs per prompt position; None returns none.

    Raises:
        ValueError: a field out of range, naming it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k is None or self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}.")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}.")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
