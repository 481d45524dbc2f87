"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Unseeded random rows are drawn in one batched ``torch.multinomial`` call from the engine's generator. Rows with a
per-request seed use the exponential race (equivalent to Gumbel-max): token = argmax_i p_i / q_i with q_i ~ Exp(1)
i.i.d. from the request's own generator, which picks i with probability exactly p_i, so a seeded request gives the
same tokens whatever its batch mates. (Drawing V exponentials per row costs ~19 ns each on CPU, which is why
unseeded rows use one uniform per row instead.)

Returned logprobs are the model's raw log-softmax (before temperature / top-k / top-p), as vLLM returns by default.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenfab.engine.sequence import Sequence


@dataclass
class SamplerOutput:
    """token_ids [N] int64; logprobs [N] float32 of the chosen tokens; top_ids / top_logprobs [N, K] (K = the largest
    ``logprobs`` asked for in the batch; None when no row asked)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits [N, V] outside each row's top-k (int64 [N], V = disabled) and then outside its top-p nucleus
    (float32 [N], 1.0 = disabled; the smallest set of most likely tokens whose mass reaches p). Returns new logits."""
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    V = logits.shape[-1]
    if top_k is not None:
        ranks = torch.arange(V, device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, sorted_logits)


class Sampler:
    """Samples one token per row of a logits matrix.

    Args:
        generator: the engine's RNG for rows without a per-request seed.
    """

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], raw_logits: torch.Tensor | None = None
                 ) -> SamplerOutput:
        """logits [N, V] float32 for sequences ``seqs`` (len N) -> SamplerOutput. ``raw_logits`` (default: logits)
        are the model's logits before constraints such as min_tokens; returned logprobs come from them."""
        N, V = logits.shape
        params = [s.params for s in seqs]
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        greedy = temps < 1e-5
        if bool(greedy.all()):
            token_ids = logits.argmax(dim=-1)
        else:
            x = logits / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(1)
            ks = [p.top_k for p in params]
            ps = [p.top_p for p in params]
            top_k = torch.tensor([k if k > 0 else V for k in ks]) if any(0 < k < V for k in ks) else None
            top_p = torch.tensor(ps, dtype=torch.float32) if any(p < 1.0 for p in ps) else None
            if top_k is not None or top_p is not None:
                x = apply_top_k_top_p(x, top_k, top_p)
            probs = x.softmax(dim=-1)
            token_ids = logits.argmax(dim=-1)
            seeded = torch.tensor([s.generator is not None for s in seqs])
            pool = ~greedy & ~seeded  # unseeded random rows: one batched inverse-CDF draw from the engine RNG
            if bool(pool.any()):
                token_ids[pool] = torch.multinomial(probs[pool], 1, generator=self.generator).squeeze(1)
            for i in torch.nonzero(~greedy & seeded).flatten().tolist():  # seeded rows: their own RNG
                q = torch.empty_like(probs[i]).exponential_(generator=seqs[i].generator)
                token_ids[i] = (probs[i] / q).argmax()
        want = [p.logprobs for p in params if p.logprobs is not None]
        if not want:
            return SamplerOutput(token_ids, None, None, None)
        logp = torch.log_softmax(logits if raw_logits is None else raw_logits, dim=-1)
        chosen = logp.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        k = max(want)
        if k > 0:
            top_vals, top_ids = logp.topk(k, dim=-1)
        else:
            top_vals = top_ids = None
        return SamplerOutput(token_ids, chosen, top_ids, top_vals)
