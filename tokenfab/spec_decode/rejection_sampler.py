"""Exact verification of draft tokens (speculative sampling; Leviathan et al. 2023, Chen et al. 2023).

For a row with drafts d_1..d_k drawn from q_1..q_k and target distributions p_1..p_{k+1} (the target's logits at
the k + 1 verified positions, after the request's temperature, top-k and top-p, as the plain sampler applies them):

* greedy rows (temperature 0): accept d_j while d_j == argmax(target logits_j); the token after the accepted run
  is the target's argmax there (the first mismatch, or the bonus position k + 1): exactly the tokens plain greedy
  decoding gives.
* random rows without a seed: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)) (uniform u_j: accept when
  u_j * q_j(d_j) < p_j(d_j)); at the first rejection j draw from normalize(max(0, p_j - q_j)); when all k are
  accepted draw a bonus token from p_{k+1}. Each emitted token is then distributed exactly as p (the theorem of
  both papers). One-hot proposals (n-gram lookup) have q_j(d_j) = 1, so the acceptance probability is p_j(d_j) and
  the recovery distribution is p_j with d_j removed.
* random rows with a per-request seed (``match_rows``): sampled-match verification. With u_1..u_{k+1} the next
  k + 1 uniforms of the row's own generator (``u_match``; plain decoding draws the token at verified position j
  from exactly u_j), the target's token there is the inverse-CDF draw from p_j at u_j; d_j is accepted while it
  equals that token, and the token after the accepted run is the target's draw there. Every emitted token is then
  exactly the token plain decoding gives from the same stream, one uniform per emitted token
  (:meth:`VerifyUniforms.advance` moves the stream by the tokens emitted), so a seeded request's tokens do not
  depend on how many drafts it got, its batch mates, preemption or the proposer: the seeded contract holds under
  speculation. Drafters draw a seeded row's d_j from q_j at the same u_j, read ahead without advancing the stream
  (:class:`DraftUniforms`): inverse-CDF coupling, so d_j is accepted with probability
  sum_x |[F_p(x-1), F_p(x)) cap [F_q(x-1), F_q(x))| (1 when q = p; p_j(d_j) for one-hot proposals, as above),
  a little below the sum_x min(p, q) of the rule above when q differs from p.

Everything is batched over rows and positions (one softmax over [N * (k + 1), V], gathers, a cumulative product
for the accepted prefix, one inverse-CDF draw per row); no Python loop over rows or positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenfab.engine.input_staging import to_device
from tokenfab.engine.sampler import apply_top_k_top_p, inverse_cdf_sample

GREEDY_EPS = 1e-5  # temperatures below this are greedy (as the plain sampler)


@dataclass
class SamplingTensors:
    """Per-row sampling settings: temperatures [N] float32, top_k [N] int64 (V = off) or None, top_p [N]
    float32 or None, greedy [N] bool."""

    temperatures: torch.Tensor
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    greedy: torch.Tensor

    @staticmethod
    def from_seqs(seqs, vocab_size: int) -> "SamplingTensors":
        params = [s.params for s in seqs]
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        ks = [p.top_k for p in params]
        ps = [p.top_p for p in params]
        top_k = (torch.tensor([k if 0 < k < vocab_size else vocab_size for k in ks])
                 if any(0 < k < vocab_size for k in ks) else None)
        top_p = torch.tensor(ps, dtype=torch.float32) if any(p < 1.0 for p in ps) else None
        return SamplingTensors(temps, top_k, top_p, temps < GREEDY_EPS)

    def to(self, device: torch.device) -> "SamplingTensors":
        """The same settings on ``device`` (non-blocking copies; itself on the CPU)."""
        put = lambda t: to_device(t, device)  # noqa: E731
        return SamplingTensors(put(self.temperatures), put(self.top_k), put(self.top_p), put(self.greedy))

    def select(self, idx: torch.Tensor) -> "SamplingTensors":
        return SamplingTensors(self.temperatures[idx], None if self.top_k is None else self.top_k[idx],
                               None if self.top_p is None else self.top_p[idx], self.greedy[idx])


def target_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Softmax of ``logits`` [N, P, V] float32 after each row's temperature (greedy rows: 1), top-k and top-p, the
    plain sampler's order (sampler.py). Returns [N, P, V] float32.

    The request-level logits processors (penalties, masks, logit bias, min-p) are applied to ``logits`` per
    position before this (``LogitsProcessorState.apply_verify``: position j counts drafts 1..j as output).
    """
    N, P, V = logits.shape
    t = torch.where(st.greedy, torch.ones_like(st.temperatures), st.temperatures)
    x = (logits / t[:, None, None]).reshape(N * P, V)
    if st.top_k is not None or st.top_p is not None:
        x = apply_top_k_top_p(x, None if st.top_k is None else st.top_k.repeat_interleave(P),
                              None if st.top_p is None else st.top_p.repeat_interleave(P))
    return x.softmax(dim=-1).reshape(N, P, V)


def acceptance_probs(p_draft: torch.Tensor, q_draft: torch.Tensor | None) -> torch.Tensor:
    """min(1, p(d) / q(d)) for drafted tokens: ``p_draft`` / ``q_draft`` [...] the target / draft probability of
    each drafted token (q None: one-hot proposals, q(d) = 1)."""
    if q_draft is None:
        return p_draft.clamp(max=1.0)
    return torch.where(q_draft > 0, (p_draft / q_draft.clamp_min(1e-38)).clamp(max=1.0), torch.ones_like(p_draft))


def recovery_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) over the last axis (``p``, ``q`` [..., V]); where p - q has no positive mass (only
    reachable through rounding, p == q rejects with probability 0) the result is p itself."""
    r = (p - q).clamp_min(0.0)
    s = r.sum(dim=-1, keepdim=True)
    return torch.where(s > 0, r / s.clamp_min(1e-38), p)


@dataclass
class VerifyResult:
    """token_ids [N, k + 1] int64 (the first ``num_emitted[i]`` of row i are its new tokens: accepted drafts then
    one recovered or bonus token); num_accepted [N] int64 (drafts accepted, 0..draft_lens)."""

    token_ids: torch.Tensor
    num_accepted: torch.Tensor

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.num_accepted + 1


def rejection_sample(logits: torch.Tensor, draft_ids: torch.Tensor, draft_lens: torch.Tensor,
                     draft_probs: torch.Tensor | None, st: SamplingTensors, u_accept: torch.Tensor,
                     u_final: torch.Tensor, match_rows: torch.Tensor | None = None,
                     u_match: torch.Tensor | None = None) -> VerifyResult:
    """Verify drafts of N rows in one batched pass.

    Args:
        logits: [N, k + 1, V] float32 target logits at the verified positions (row i's first
            ``draft_lens[i] + 1`` are real, the rest padding).
        draft_ids: [N, k] int64 drafted tokens (padding past draft_lens is ignored).
        draft_lens: [N] int64 in [0, k].
        draft_probs: [N, k, V] float32 q each draft was drawn from, or None (one-hot proposals).
        st: the rows' sampling settings (:class:`SamplingTensors`).
        u_accept: [N, k] uniforms in [0, 1) for the acceptance tests; u_final: [N] for the last token's draw.
        match_rows: [N] bool, rows verified by sampled match (seeded random rows, module docstring), or None.
        u_match: [N, k + 1] their uniforms, position j's in column j (read for ``match_rows`` only).

    Where ``logits`` live on a GPU, the other tensors may be host tensors (settings, uniforms, drafts): the
    decisions that steer the computation are read from the host copies, the tensors the math needs are copied to
    the logits' device without waiting, and the draws use a float64 cdf there (as ``Sampler.draw_on_device``), so
    nothing reads the device until the caller reads the result.

    Returns:
        :class:`VerifyResult` on the logits' device.
    """
    N, K1, V = logits.shape
    k = K1 - 1
    dev = logits.device
    put = lambda t: to_device(t, dev)  # noqa: E731
    cdf = None if dev.type == "cpu" else torch.float64
    all_greedy = bool(st.greedy.all())  # host flags (st as the caller built it)
    any_greedy = all_greedy or bool(st.greedy.any())
    mi_host = None
    if match_rows is not None and not all_greedy:
        mi_host = (match_rows & ~st.greedy).nonzero().squeeze(1)
        mi_host = mi_host if len(mi_host) else None
    st = st.to(dev)
    draft_ids, draft_lens, u_accept, u_final, u_match, draft_probs = (
        put(t) for t in (draft_ids, draft_lens, u_accept, u_final, u_match, draft_probs))
    r = torch.arange(N, device=dev)
    valid = torch.arange(k, device=dev)[None, :] < draft_lens[:, None]
    d = draft_ids[:, :k].clamp(0, V - 1)
    argmax = logits.argmax(dim=-1) if any_greedy else None  # [N, K1]
    acc = d == argmax[:, :k] if any_greedy else None
    p = x = None
    if not all_greedy:
        if st.top_k is None and st.top_p is None:  # p only where needed: log-sum-exp per position, no full softmax
            t = torch.where(st.greedy, torch.ones_like(st.temperatures), st.temperatures)
            x = logits / t[:, None, None]
            p_d = (x[:, :k].gather(-1, d.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x[:, :k], dim=-1)).exp()
        else:
            p = target_probs(logits, st)
            p_d = p[:, :k].gather(-1, d.unsqueeze(-1)).squeeze(-1)
        q_d = None if draft_probs is None else draft_probs[:, :k].gather(-1, d.unsqueeze(-1)).squeeze(-1)
        acc_rand = u_accept[:, :k] < acceptance_probs(p_d, q_d)
        acc = torch.where(st.greedy[:, None], acc, acc_rand) if any_greedy else acc_rand
    mi = sampled_m = None
    if mi_host is not None:
        mi = put(mi_host)
        p_mi = p[mi] if p is not None else x[mi].softmax(dim=-1)  # [M, K1, V], the plain sampler's distribution
        sampled_m = inverse_cdf_sample(p_mi.reshape(-1, V), u_match[mi, :K1].reshape(-1), cdf).view(len(mi), K1)
        acc = acc.clone()
        acc[mi] = d[mi] == sampled_m[:, :k]
    acc = acc & valid
    m = acc.to(torch.int64).cumprod(dim=1).sum(dim=1) if k else torch.zeros(N, dtype=torch.int64, device=dev)
    final = argmax[r, m] if any_greedy else None
    if not all_greedy:
        p_m = p[r, m] if p is not None else x[r, m].softmax(dim=-1)  # [N, V]
        rejected = m < draft_lens
        mq = m.clamp(max=max(k - 1, 0))
        if k == 0:
            q_m = torch.zeros_like(p_m)
        elif draft_probs is None:
            q_m = torch.nn.functional.one_hot(d[r, mq], V).to(p_m.dtype)
        else:
            q_m = draft_probs[r, mq]
        q_m = torch.where(rejected[:, None], q_m, torch.zeros_like(q_m))
        sampled = inverse_cdf_sample(recovery_probs(p_m, q_m), u_final, cdf)
        final = torch.where(st.greedy, final, sampled) if any_greedy else sampled
        if mi is not None:
            final = final.clone()
            final[mi] = sampled_m[torch.arange(len(mi), device=dev), m[mi]]
    tokens = torch.cat([d, torch.zeros(N, 1, dtype=torch.int64, device=dev)], dim=1)
    tokens[r, m] = final
    return VerifyResult(tokens, m)


def peek_uniforms(generator: torch.Generator, n: int) -> torch.Tensor:
    """The next ``n`` uniforms in [0, 1) of ``generator`` (float32 [n]), read from a copy of its state: the
    generator itself does not advance (``torch.rand`` on a CPU generator gives the same values in one call of n as
    in n calls of one, so these are the values its next draws give whatever their sizes)."""
    g = torch.Generator()
    g.set_state(generator.get_state())
    return torch.rand(n, generator=g)


def _seeded(s) -> bool:
    return getattr(s, "generator", None) is not None


class DraftUniforms:
    """Uniforms for drawing drafts, one per row per draft position (``__call__(j)`` -> [N] for draft j).

    Unseeded rows take theirs from the engine's ``generator`` (one call per position). A seeded row's draft j takes
    the j-th uniform ahead in its own generator's stream, read without advancing it (:func:`peek_uniforms`): the
    uniform the plain sampler, and the verifier's sampled-match rule, use for the token at that position (module
    docstring). Drafting therefore never moves a seeded stream, whether or not the step then runs.

    Args:
        seqs: the N sequences drafted for (``.generator``: their seeded RNG or None).
        generator: the engine's RNG.
        k: the most draft positions asked for.
    """

    def __init__(self, seqs, generator: torch.Generator | None, k: int):
        self.n = len(seqs)
        self.generator = generator
        self.ahead = {i: peek_uniforms(s.generator, k) for i, s in enumerate(seqs) if _seeded(s)}

    def __call__(self, j: int) -> torch.Tensor:
        """[N] float32 uniforms for draft position ``j`` (0-based)."""
        u = torch.rand(self.n, generator=self.generator)
        for i, a in self.ahead.items():
            u[i] = a[j]
        return u


def draw_draft(logits: torch.Tensor, st: SamplingTensors, uniforms: DraftUniforms | None,
               j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft ``j`` (0-based) of every row from draft logits [N, V] float32, where the logits are: argmax for greedy
    rows, else the inverse-CDF draw from q (the row's temperature / top-k / top-p: :func:`target_probs`) at
    ``uniforms(j)`` (drawn on the host as the plain sampler draws them; a seeded row's is the uniform its own stream
    holds for that position, not consumed), the cumulative sum in float64 off the CPU (as
    ``Sampler.draw_on_device``). ``st`` on the host (moved here); ``uniforms`` None only when every row is greedy.

    Returns:
        (tokens [N] int64, q [N, V] float32 or None when every row is greedy), on the logits' device.
    """
    if bool(st.greedy.all()):
        return logits.argmax(dim=-1), None
    dev = logits.device
    on_cpu = dev.type == "cpu"
    st = st if on_cpu else st.to(dev)
    q = target_probs(logits.unsqueeze(1), st).squeeze(1)
    u = uniforms(j)
    tok = inverse_cdf_sample(q, u if on_cpu else u.to(dev, non_blocking=True), None if on_cpu else torch.float64)
    return torch.where(st.greedy, logits.argmax(dim=-1), tok), q


@dataclass
class VerifyUniforms:
    """Uniforms for one verification (:func:`rejection_sample`'s ``u_accept``, ``u_final``, ``match_rows``,
    ``u_match``; build with :meth:`draw`), and the seeded streams to advance once the tokens are known
    (:meth:`advance`)."""

    u_accept: torch.Tensor
    u_final: torch.Tensor
    match_rows: torch.Tensor | None
    u_match: torch.Tensor | None

    @staticmethod
    def draw(seqs, n: int, generator: torch.Generator, draft_lens=None) -> "VerifyUniforms":
        """For N rows verifying up to ``n - 1`` drafts: unseeded rows take (u_accept [N, n - 1], u_final [N]) from
        one call on the engine's ``generator``; a seeded row (its own generator) is a match row whose
        ``draft_lens[i] + 1`` uniforms (all n when ``draft_lens`` is None) are its stream's next values, read
        without advancing it: :meth:`advance` moves it by the tokens the row emits."""
        u = torch.rand(len(seqs), n, generator=generator)
        seeded = [i for i, s in enumerate(seqs) if _seeded(s)]
        match = u_match = None
        if seeded:
            match = torch.zeros(len(seqs), dtype=torch.bool)
            match[seeded] = True
            u_match = torch.zeros(len(seqs), n)
            for i in seeded:
                c = n if draft_lens is None else int(draft_lens[i]) + 1
                u_match[i, :c] = peek_uniforms(seqs[i].generator, c)
        return VerifyUniforms(u[:, : n - 1].clone(), u[:, n - 1].clone(), match, u_match)

    def advance(self, seqs, num_emitted) -> None:
        """Move each seeded row's generator past the ``num_emitted[i]`` uniforms its emitted tokens used (one per
        token, as plain decoding draws), so its stream stands where plain decoding would leave it."""
        if self.match_rows is None:
            return
        for i in self.match_rows.nonzero().squeeze(1).tolist():
            torch.rand(int(num_emitted[i]), generator=seqs[i].generator)
