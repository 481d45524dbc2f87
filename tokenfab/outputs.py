"""Results returned to users, in vLLM's public shape."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenfab.logprobs import Logprob

# One position's logprobs: {token_id: Logprob} holding the chosen token and the top-k alternatives (vLLM's shape).
Logprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence.

    ``token_ids``: generated token ids; ``logprobs``: one ``{token_id: Logprob}`` dict per generated token, the
    sampled token and the top ``SamplingParams.logprobs`` alternatives (None unless asked for; tokenfab/logprobs.py);
    ``finish_reason``: "stop" (EOS, stop string or stop token), "length" (max_tokens or max_model_len), "abort",
    "error" (the engine failed this request, see ``RequestOutput.error``), or None while running.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps in seconds (time.monotonic) of one request's life, for TTFT / TPOT / E2E latency."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """The state of one request after an engine step (or at the end of ``LLM.generate``).

    ``prompt_logprobs`` has one entry per prompt position: None for position 0 (nothing predicts it), then a
    ``{token_id: Logprob}`` dict holding the actual prompt token and the top alternatives (tokenfab/logprobs.py).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[Logprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
    error: str | None = None  # why the engine failed this request (its outputs then finish with "error")
