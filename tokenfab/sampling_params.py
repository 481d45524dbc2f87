"""Per-request sampling settings, in vLLM's public shape."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenfab.request_validation import check_processor_params, check_processor_params_for_model
from tokenfab.errors import InvalidRequestError
from tokenfab.request_validation import check_sampling_params, check_sampling_params_for_model
from tokenfab.structured_output.params import GuidedDecodingParams, StructuredOutputsParams, as_structured_outputs


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
            included), each a ``{token_id: Logprob}`` dict (tokenfab/logprobs.py); None returns none.
        prompt_logprobs: number of top logprobs per prompt position (the prompt token's always included); None
            returns none.
        presence_penalty: in [-2, 2]; subtracted once from the logit of every token already in the output.
        frequency_penalty: in [-2, 2]; subtracted from a token's logit once per occurrence in the output.
        repetition_penalty: > 0 (1 disables); tokens in the prompt or the output get logit / r where the logit is
            positive, logit * r otherwise (CTRL / HF).
        min_p: in [0, 1]; after temperature, tokens less likely than min_p times the most likely one are dropped.
        logit_bias: token id -> bias in [-100, 100] added to that token's logit.
        allowed_token_ids: when set, only these token ids can be generated.
        bad_words: words never generated: each is encoded with and without a leading space; a word's last token
            is forbidden whenever the output ends with the word's other tokens.
        (The penalties, logit_bias, allowed_token_ids and bad_words act on the logits before temperature, in
        vLLM's order; see tokenfab/engine/logits_processors.py.)
        structured_outputs: a :class:`~tokenfab.structured_output.params.StructuredOutputsParams` (or a dict of
            its fields): the output follows a JSON schema, any JSON object, a regex, one of a list of strings or an
            EBNF grammar (xgrammar's token mask, tokenfab/engine/grammar_state.py; EOS only once it is complete).
        guided_decoding: vLLM <= 0.10's name for ``structured_outputs`` (``GuidedDecodingParams``); folded into it.

    Raises:
        InvalidRequestError (a ValueError): a field of the wrong type or out of range (NaN and infinities
            included), naming it (checks in tokenfab/request_validation.py, shared with the HTTP server).
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise InvalidRequestError("give structured_outputs or guided_decoding (its older name), not both.",
                                          "guided_decoding")
            self.structured_outputs = as_structured_outputs(self.guided_decoding, "guided_decoding")
            self.guided_decoding = None
        self.structured_outputs = as_structured_outputs(
            self.structured_outputs, getattr(self.structured_outputs, "source", "structured_outputs"))
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None or isinstance(self.stop, (list, tuple)):  # anything else: refused by name below
            self.stop = [s for s in (self.stop or []) if not isinstance(s, str) or s]
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or (self.top_k == 0 and not isinstance(self.top_k, bool)):  # False: refused below
            self.top_k = -1
        check_sampling_params(self)
        check_processor_params(self)

    def validate(self, vocab_size: int) -> None:
        """Check every field again (they may have been changed since construction) and against the model's
        vocabulary: stop token ids in [0, vocab_size), logprobs and prompt_logprobs at most vocab_size.
        ``LLMEngine.add_request`` calls it for every request.

        Raises:
            InvalidRequestError (a ValueError): the field at fault, by name.
        """
        check_sampling_params_for_model(self, vocab_size)
        self.structured_outputs = as_structured_outputs(
            self.structured_outputs, getattr(self.structured_outputs, "source", "structured_outputs"))
        check_processor_params(self)
        check_processor_params_for_model(self, vocab_size)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
