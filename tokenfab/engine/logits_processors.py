"""Batched logits processors: penalties, min-p, logit bias, allowed token ids, bad words (vLLM semantics).

Pure torch functions over a batch of rows; none loops over rows or tokens in Python. They run in this order inside
the sampler (vLLM v1's: ``vllm/v1/sample/sampler.py``), all on float32 logits:

1. :func:`apply_allowed_token_ids` and :func:`apply_bad_words` (-inf masks), then :func:`apply_logit_bias`, on the
   raw logits (after the min_tokens mask);
2. :func:`apply_penalties` (repetition, frequency, presence) on those logits, before temperature;
3. greedy rows take the argmax here; random rows divide by temperature, then :func:`apply_min_p`, then top-k / top-p.

The request's processor fields are checked once, when it is built or added (never per step), by
:mod:`tokenfab.request_validation` with every other field.
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """Repetition, frequency and presence penalties on ``logits`` [N, V] float32; returns new logits.

    Args:
        prompt_mask: [N, V] bool, True where the token occurs in the row's prompt.
        output_counts: [N, V] int32, how often each token occurs in the row's output so far.
        repetition: [N] float32 > 0 (1 = off): for tokens in the prompt OR the output, a logit > 0 becomes
            logit / r, any other logit * r (CTRL, Keskar et al. 2019, as in HF's RepetitionPenaltyLogitsProcessor
            and vLLM).
        frequency: [N] float32 (0 = off): subtracts f * count(token in output) (OpenAI's definition).
        presence: [N] float32 (0 = off): subtracts p * [count(token in output) > 0] (OpenAI's definition).
    """
    seen = output_counts > 0
    rep = repetition.to(logits.dtype).unsqueeze(1)
    rep = torch.where(prompt_mask | seen, rep, torch.ones((), dtype=logits.dtype))
    out = torch.where(logits > 0, logits / rep, logits * rep)
    out = out - frequency.to(logits.dtype).unsqueeze(1) * output_counts.to(logits.dtype)
    return out - presence.to(logits.dtype).unsqueeze(1) * seen.to(logits.dtype)


def apply_penalties_at(logits: torch.Tensor, row: torch.Tensor, token: torch.Tensor, count: torch.Tensor,
                       repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """:func:`apply_penalties` touching only the tokens it changes, in place: the K distinct (``row``, ``token``)
    pairs [K] int64 of tokens seen in a row's prompt or output, with ``count`` [K] int32 their occurrences in the
    output (0 for prompt-only tokens). Every other logit is left as it is, which is what the dense formula gives it
    (r = 1, no count), so the result is the same in O(K) instead of O(N * V). Returns ``logits``."""
    vals = logits[row, token]
    r = repetition.to(logits.dtype)[row]
    vals = torch.where(vals > 0, vals / r, vals * r)
    c = count.to(logits.dtype)
    vals = vals - frequency.to(logits.dtype)[row] * c
    vals = vals - presence.to(logits.dtype)[row] * (c > 0).to(logits.dtype)
    logits[row, token] = vals
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (-inf) tokens whose probability is below ``min_p`` [N] float32 times the row's largest probability;
    ``logits`` [N, V] float32 are already divided by temperature (vLLM applies min-p after temperature). 0 keeps
    every token. Returns new logits.

    Computed in logit space: p_i < m * p_max exactly when x_i < x_max + log(m) (p_i / p_max = exp(x_i - x_max)),
    with no softmax. On logits not yet divided by a temperature T the same mask is ``min_p ** T`` (x_i / T <
    x_max / T + log(m) exactly when x_i < x_max + T log(m)), which lets the sampler mask before its fused
    temperature-and-draw kernel."""
    thresh = logits.amax(dim=-1, keepdim=True) + min_p.to(logits.dtype).log().unsqueeze(1)
    return logits.masked_fill(logits < thresh, NEG_INF)


def apply_logit_bias(logits: torch.Tensor, row: torch.Tensor, token: torch.Tensor, bias: torch.Tensor
                     ) -> torch.Tensor:
    """Add ``bias`` [K] float32 to ``logits[row[k], token[k]]`` (``row``, ``token`` [K] int64; no (row, token) pair
    twice), in place; returns ``logits``."""
    return logits.index_put_((row, token), bias.to(logits.dtype), accumulate=True)


def allowed_token_mask(num_rows: int, vocab_size: int, rows: torch.Tensor, row: torch.Tensor, token: torch.Tensor
                       ) -> torch.Tensor:
    """[num_rows, vocab_size] bool mask for :func:`apply_allowed_token_ids`: True (masked) everywhere in ``rows``
    [M] int64 (the rows with an allow-list) except at the allowed pairs (``row``, ``token``) [K] int64."""
    mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool)
    mask[rows] = True
    mask[row, token] = False
    return mask


def apply_allowed_token_ids(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Set ``logits`` [N, V] to -inf where ``mask`` [N, V] bool (:func:`allowed_token_mask`) is True, in place."""
    return logits.masked_fill_(mask, NEG_INF)


def apply_bad_words(logits: torch.Tensor, row: torch.Tensor, last_token: torch.Tensor, prefix: torch.Tensor,
                    history: torch.Tensor) -> torch.Tensor:
    """Mask (-inf, in place) the last token of each bad word whose preceding tokens end the row's output.

    One entry per (row, bad word) pair, P in all, prefixes right-aligned to a common width L:

    Args:
        row: [P] int64 row of ``logits`` [N, V].
        last_token: [P] int64 the word's last token id.
        prefix: [P, L] int64 the word's tokens before the last, right-aligned, -1 where the word is shorter.
        history: [P, L] int64 the row's last L output tokens, right-aligned, -2 before the output's start (so a word
            longer than the output + 1 never matches, as in vLLM). A single-token word (prefix all -1) always masks.
    """
    match = ((prefix == history) | (prefix < 0)).all(dim=1)
    # adding -inf where a word matches and 0 elsewhere (accumulate: pairs may repeat): no boolean indexing, so no
    # host sync on a GPU
    zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
    return logits.index_put_((row, last_token), torch.where(match, NEG_INF, zero), accumulate=True)
