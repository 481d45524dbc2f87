"""Logprobs in vLLM's offline shape: one ``{token_id: Logprob}`` dict per position.

``CompletionOutput.logprobs`` holds one dict per generated token and ``RequestOutput.prompt_logprobs`` one per prompt
position (None at position 0, which nothing predicts). Each dict holds the position's own token (the sampled one, or
the prompt's) and the top-k alternatives the request asked for, each a :class:`Logprob`, as vLLM's
``vllm.logprobs.Logprob``, so code written against vLLM (``lp[token_id].logprob``, ``.rank``, ``.decoded_token``)
runs unchanged. The server's JSON follows OpenAI's shapes instead (tokenfab/server/serving.py).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    """One token's entry at one position.

    Attributes:
        logprob: the natural-log probability of the token under the model's distribution at that position (its raw
            logits, before any sampling setting, as vLLM's default ``raw_logprobs``).
        rank: the token's 1-based rank in the vocabulary by logprob (1 = the most likely). The top-k entries are
            ranked by their place among the top k; the position's own token, when outside them, by how many tokens
            have a logprob at least as high as its own (itself included), as vLLM counts it.
        decoded_token: the token's text decoded alone (``tokenizer.decode([token_id])``), or None without a
            tokenizer.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one {token_id: Logprob} per generated token
SampleLogprobs = list[dict[int, Logprob]]
# one per prompt position, None at position 0
PromptLogprobs = list[dict[int, Logprob] | None]


class TokenTexts:
    """Each token id's text decoded alone (``tokenizer.decode([id])``, vLLM's ``decoded_token``), decoded once per id
    and kept: a position's top-k ids recur from step to step, and a full-vocabulary request decodes every id once.

    Args:
        tokenizer: anything with ``decode(list[int]) -> str``; None gives None for every id.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str | None:
        """The text of ``token_id`` alone; "" for an id the tokenizer cannot decode (a padded vocabulary row)."""
        if self.tokenizer is None:
            return None
        text = self._texts.get(token_id)
        if text is None:
            try:
                text = self.tokenizer.decode([token_id])
            except Exception:  # ids past the tokenizer's vocabulary (models pad their embedding)
                text = None
            text = self._texts[token_id] = text or ""
        return text

    def many(self, token_ids: list[int]) -> list[str | None]:
        """:meth:`__call__` of each id (one dict lookup each once decoded: full-vocabulary requests ask for every
        id at every position)."""
        if self.tokenizer is None:
            return [None] * len(token_ids)
        get = self._texts.get
        out = [get(t) for t in token_ids]
        if None in out:
            out = [o if o is not None else self(t) for o, t in zip(out, token_ids)]
        return out


def position_logprobs(token_id: int, logprob: float, rank: int, top_ids: list[int] | None,
                      top_logprobs: list[float] | None, texts: TokenTexts) -> dict[int, Logprob]:
    """One position's ``{token_id: Logprob}``: the position's own token first (``logprob``, ``rank``), then the
    top-k ids (``top_ids`` / ``top_logprobs``, most likely first; None or empty for none) ranked 1..k. The own token,
    when among the top k, keeps its first place in the dict and takes its top-k entry (rank by place, as vLLM)."""
    d = {token_id: Logprob(logprob, rank, texts(token_id))}
    if top_ids:
        d.update(zip(top_ids, map(Logprob, top_logprobs, range(1, len(top_ids) + 1), texts.many(top_ids))))
    return d
