"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Random rows are drawn by inverse CDF: one uniform u per row, token = the first i whose cumulative probability
exceeds u times the row's total (:func:`inverse_cdf_sample`). Unseeded rows take their uniforms in one call from the
engine's generator; a row with a per-request seed takes its uniform from the request's own generator, so a seeded
request gives the same tokens whatever its batch mates. One uniform and one cumulative sum per row cost ~0.1 ms for
16 x 8,192 on CPU, where ``torch.multinomial`` or an exponential race (V exponentials per row, ~19 ns each) cost
~2.7 ms (benchmarks/NOTES.md).

Returned logprobs are the model's raw log-softmax (before temperature / top-k / top-p), as vLLM returns by default.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenfab.engine.input_staging import to_device
from tokenfab.engine.logits_processors import apply_min_p
from tokenfab.engine.logits_state import LogitsProcessorState
from tokenfab.engine.sequence import Sequence
from tokenfab.kernels import dispatch


@dataclass
class SamplerOutput:
    """token_ids [N] int64; logprobs [N] float32 of the chosen tokens and ranks [N] int64 (their vocabulary ranks,
    :func:`token_logprobs`); top_ids / top_logprobs [N, K] (K = the largest ``logprobs`` asked for in the batch;
    None when no row asked)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    ranks: torch.Tensor | None = None
    ready: object | None = None  # a CUDA event: the fields (pinned host tensors) hold the draw once it completed
    device_ids: torch.Tensor | None = None  # [N] int64 the drawn ids where they were drawn (GPU), or None

    def wait(self) -> None:
        """Block until ``token_ids`` (and the logprobs fields) hold the device's draw (:meth:`Sampler.draw_on_device`
        and the logprobs paths copy them without waiting); then they are CPU tensors of their own. A no-op for
        outputs made on the host."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits [N, V] outside each row's top-k (int64 [N], V = disabled) and then outside its top-p nucleus
    (float32 [N], 1.0 = disabled; the smallest set of most likely tokens whose mass reaches p, never empty: the most
    likely token stays even where p rounds to 0 in float32, e.g. 1e-300). Returns new logits."""
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    V = logits.shape[-1]
    if top_k is not None:
        ranks = torch.arange(V, device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= top_p.unsqueeze(1)
        drop[:, 0] = False  # the most likely token always stays: a top_p that rounds to 0 in float32 means greedy
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, sorted_logits)


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor, cdf_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sample one index per row of ``probs`` [N, V] (float32, non-negative, rows need not sum to 1) from uniforms
    ``u`` [N] in [0, 1): the first i with cdf[i] > u * cdf[V - 1]. Index i is drawn with probability p_i / sum(p)
    up to float32 rounding of the cumulative sum (CPU ``cumsum`` accumulates in float64, so the cdf is monotonic);
    a zero-probability index (masked by top-k / top-p) is never drawn. ``cdf_dtype`` float64: the cumulative sum in
    float64 (on a GPU, whose float32 scan adds in another order, so a zero-probability index could otherwise sit
    one rounding step above its predecessor). Returns int64 [N] on probs' device."""
    cdf = probs.cumsum(dim=-1, dtype=cdf_dtype)
    total = cdf[:, -1]
    target = torch.minimum(u.to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)


def top_logprobs(logp: torch.Tensor, k: int, ties_by_id: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of ``logp`` [N, V] and their ids, largest first (``torch.topk``). With
    ``ties_by_id`` (batch-invariant mode), equal values come lowest id first, so a row's top-k does not depend on the
    k its batch mates asked for (the batch takes the largest k and each request keeps its first k: ``topk(4)[:3]``
    and ``topk(3)`` may pick different tokens among ties). Returns (values [N, k], int64 ids [N, k])."""
    if not ties_by_id:
        return logp.topk(k, dim=-1)
    vals, ids = logp.sort(dim=-1, descending=True, stable=True)
    return vals[:, :k], ids[:, :k]


def token_logprobs(logp: torch.Tensor, token_ids: torch.Tensor, k: int, ties_by_id: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """What a row's logprobs output needs from its log-probabilities ``logp`` [N, V]: (the logprob of each row's
    ``token_ids`` entry [N], its rank [N] int64, top ids [N, k], top values [N, k]; the top two None when k is 0).

    The rank is vLLM's: how many of the row's V logprobs are at least the token's own (itself included), 1 for the
    most likely token. ``ties_by_id``: as :func:`top_logprobs`."""
    chosen = logp.gather(1, token_ids.unsqueeze(1))
    ranks = (logp >= chosen).sum(dim=-1)
    top_vals, top_ids = top_logprobs(logp, k, ties_by_id) if k > 0 else (None, None)
    return chosen.squeeze(1), ranks, top_ids, top_vals


def _unrestricted(params, vocab_size: int) -> bool:
    """True when a row draws from its whole vocabulary: no top-k below it, no top-p below 1 (sample_plain's rows)."""
    return (params.top_k <= 0 or params.top_k >= vocab_size) and params.top_p >= 1.0


class Sampler:
    """Samples one token per row of a logits matrix.

    Args:
        generator: the engine's RNG for rows without a per-request seed.
    """

    def __init__(self, generator: torch.Generator):
        self.generator = generator
        self._plain_temps: tuple[list[float], torch.Tensor | None] = ([], None)  # plain_inputs' last temperatures
        # per-row penalties, min_p, logit_bias, allowed_token_ids, bad_words (the model runner sets it; logits_state.py)
        self.processors: LogitsProcessorState | None = None
        # batch-invariant mode (the model runner sets it): rows without top-k / top-p are always drawn by sample_plain
        # and the others by the sorted path, so a row's draw does not depend on which kinds of rows share its batch
        self.batch_invariant = False
        # the C++ draw (cpu_kernels.sample_plain) for plain rows; the model runner sets it to whether its device is the
        # CPU: a GPU engine samples its (CPU-side) logits in PyTorch and never builds the CPU kernels for it
        self.use_cpu_kernels = True

    def _uniforms(self, seqs: list[Sequence]) -> torch.Tensor:
        """One uniform in [0, 1) per row: unseeded rows from one call on the engine's RNG, seeded rows from the
        request's own RNG (one scalar each), so a seeded request draws the same values whatever its batch."""
        u = torch.rand(len(seqs), generator=self.generator)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                u[i] = torch.rand((), generator=s.generator)
        return u

    def plain_inputs(self, seqs: list[Sequence], vocab_size: int, rows: np.ndarray | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(temperatures [N] float32, uniforms [N]) for :func:`~tokenfab.kernels.cpu.ops.sampling.sample_plain` when
        every row is plain (no logprobs asked, no top-k / top-p), else None. The uniforms are the ones
        :meth:`__call__` would draw for these rows (none from any generator when all rows are greedy), so drawing
        them here, before the forward, leaves every RNG stream where ``__call__`` would. Lets a caller run the LM
        head and the draw in one C++ call after the forward (engine/cpu_decode_stack.py). ``rows`` [N] int64: the
        sequences' persistent rows; None, also when a row uses penalties, min_p, logit_bias, allowed_token_ids or
        bad_words (they need :meth:`__call__`)."""
        if rows is not None and self.processors is not None and self.processors.any_active(rows):
            return None
        params = [s.params for s in seqs]
        if any(p.logprobs is not None or not _unrestricted(p, vocab_size) for p in params):
            return None
        temp_list = [p.temperature for p in params]
        if temp_list != self._plain_temps[0]:  # steady decoding keeps its batch: reuse the tensor
            self._plain_temps = (temp_list, torch.tensor(temp_list, dtype=torch.float32))
        temps = self._plain_temps[1]
        if all(t < 1e-5 for t in temp_list):
            return temps, torch.zeros(len(seqs))
        return temps, self._uniforms(seqs)

    def draw_on_device(self, logits: torch.Tensor, seqs: list[Sequence], rows: np.ndarray) -> SamplerOutput | None:
        """The draw of a batch whose rows are all plain (:meth:`plain_inputs`: no logprobs, top-k / top-p or logits
        processors; the caller has checked min_tokens) where ``logits`` [N, V] float32 live (a GPU): greedy rows
        take their argmax, the others sample logits / temperature by :func:`inverse_cdf_sample` (float64 cdf) from
        the uniforms :meth:`plain_inputs` draws on the host, exactly those :meth:`__call__` would draw. Only the ids
        come back to the host: SamplerOutput with token_ids int64 [N] on the CPU. Batches with top-k / top-p rows
        take :meth:`_sorted_draw` on the device, and rows with logprobs get them there (:meth:`_restricted_on_device`;
        not with logits processors or in batch-invariant mode), with the uniforms and the tokens :meth:`__call__`
        would give them: the [N, V] logits never cross to the host, where sorting them took far longer than the
        step. None, drawing nothing and leaving every RNG where it was, when some row needs the host sampler."""
        plain = self.plain_inputs(seqs, logits.shape[-1], rows)
        if plain is None:
            return self._restricted_on_device(logits, seqs, rows)
        temps, u = plain
        if all(p.params.temperature < 1e-5 for p in seqs):
            return self._ids_to_host(logits.argmax(dim=-1))
        dev = logits.device
        t = to_device(temps, dev)
        greedy = t < 1e-5
        x = logits / torch.where(greedy, torch.ones_like(t), t).unsqueeze(1)
        ids = inverse_cdf_sample(x.softmax(dim=-1), to_device(u, dev), torch.float64)
        return self._ids_to_host(torch.where(greedy, logits.argmax(dim=-1), ids))

    def _restricted_on_device(self, logits: torch.Tensor, seqs: list[Sequence],
                              rows: np.ndarray | None) -> SamplerOutput | None:
        """:meth:`draw_on_device` for a batch with top-k / top-p or logprobs rows (:meth:`__call__`'s draw of such a
        batch without the CPU kernel, on the logits' device; logprobs from the log-softmax there, copied back with
        the ids); None where a row uses logits processors, or in batch-invariant mode."""
        if self.batch_invariant or (rows is not None and self.processors is not None
                                    and self.processors.any_active(rows)):
            return None
        params = [s.params for s in seqs]
        if all(p.temperature < 1e-5 for p in params):
            ids = logits.argmax(dim=-1)
        else:
            ids = self._sorted_draw(logits, params, self._uniforms(seqs))
        if all(p.logprobs is None for p in params):
            return self._ids_to_host(ids)
        return self._to_host(self._with_logprobs(ids, logits, params))  # batch-invariant mode never comes here

    def on_device(self, logits: torch.Tensor, seqs: list[Sequence], raw_logits: torch.Tensor, rows: np.ndarray,
                  lengths: np.ndarray) -> SamplerOutput:
        """:meth:`__call__` where ``logits`` [N, V] float32 live (a GPU), for the batches :meth:`draw_on_device`
        leaves: rows with logits processors (penalties, min_p, logit_bias, allowed_token_ids, bad words, structured
        outputs) or below min_tokens (``logits`` then carry the caller's mask; ``raw_logits`` do not). The
        processors' row state stays on the host and reaches the device by non-blocking copies
        (:meth:`LogitsProcessorState.apply`), the draw is :meth:`__call__`'s, so the tokens and logprobs are the
        host sampler's up to the device's float rounding. Only the ids (and the logprobs asked for) come back:
        SamplerOutput on the CPU through pinned tensors (:meth:`_to_host`, :meth:`SamplerOutput.wait`)."""
        out = self(logits, seqs, raw_logits=raw_logits, rows=rows, lengths=lengths)
        if out.logprobs is None:
            return self._ids_to_host(out.token_ids)
        return self._to_host(out)

    @staticmethod
    def _to_host(out: SamplerOutput) -> SamplerOutput:
        """``out`` (device tensors: ids, and any logprobs, ranks, top ids / logprobs) on the host: on CUDA copied
        into fresh pinned tensors (PyTorch's caching host allocator, which reuses a block only once the copies into
        it completed) without waiting, an event marking the copies (:meth:`SamplerOutput.wait`), so a step launches
        without draining the device and, with async scheduling, the next step's copy never lands in a buffer this
        one is still read from; elsewhere plain copies."""
        fields = (out.token_ids, out.logprobs, out.top_ids, out.top_logprobs, out.ranks)
        if out.token_ids.device.type != "cuda":
            return SamplerOutput(*(None if t is None else t.cpu() for t in fields))
        host = []
        for t in fields:
            if t is None:
                host.append(None)
                continue
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            host.append(h)
        ready = torch.cuda.Event()
        ready.record()
        return SamplerOutput(*host, ready=ready, device_ids=out.token_ids)

    def _ids_to_host(self, ids: torch.Tensor) -> SamplerOutput:
        """SamplerOutput of device ids [N] int64 on the host (:meth:`_to_host`: on CUDA without waiting)."""
        return self._to_host(SamplerOutput(ids, None, None, None))

    @staticmethod
    def _sorted_draw(logits: torch.Tensor, params: list, u: torch.Tensor) -> torch.Tensor:
        """Rows of ``logits`` [N, V] float32 drawn with their temperature, top-k and top-p (``params``, one
        SamplingParams per row) from uniforms ``u`` [N] by :func:`inverse_cdf_sample`; greedy rows take their
        first argmax. Returns int64 [N]."""
        V = logits.shape[-1]
        dev = logits.device
        put = lambda t: to_device(t, dev)  # noqa: E731
        temp_list = [p.temperature for p in params]
        temps = put(torch.tensor(temp_list, dtype=torch.float32))
        greedy = temps < 1e-5
        any_greedy = any(t < 1e-5 for t in temp_list)
        if any_greedy or any(t != 1.0 for t in temp_list):
            x = logits / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(1)
        else:  # all at temperature 1: dividing by 1 is exact, skip it
            x = logits
        ks = [p.top_k for p in params]
        ps = [p.top_p for p in params]
        top_k = put(torch.tensor([k if 0 < k < V else V for k in ks])) if any(0 < k < V for k in ks) else None
        top_p = put(torch.tensor(ps, dtype=torch.float32)) if any(p < 1.0 for p in ps) else None
        if top_k is not None or top_p is not None:
            x = apply_top_k_top_p(x, top_k, top_p)
        # on a GPU the cdf in float64 (inverse_cdf_sample: its float32 scan adds in another order)
        sampled = inverse_cdf_sample(x.softmax(dim=-1), put(u), None if dev.type == "cpu" else torch.float64)
        return torch.where(greedy, logits.argmax(dim=-1), sampled) if any_greedy else sampled

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], raw_logits: torch.Tensor | None = None,
                 rows: np.ndarray | None = None, lengths: np.ndarray | None = None) -> SamplerOutput:
        """logits [N, V] float32 for sequences ``seqs`` (len N) -> SamplerOutput. ``raw_logits`` (default: logits)
        are the model's logits before constraints such as min_tokens; returned logprobs come from them. ``rows`` /
        ``lengths`` [N] int64 (persistent rows, tokens known per sequence) enable the logits processors
        (logits_processors.py): masks, bias and penalties before temperature, min_p after it."""
        N, V = logits.shape
        if raw_logits is None:
            raw_logits = logits
        params = [s.params for s in seqs]
        temp_list = [p.temperature for p in params]  # decisions on Python floats: no tensor ops on cold caches
        proc = self.processors.batch(rows) if rows is not None and self.processors is not None else None
        if proc is not None:  # some row uses penalties / bias / masks / min_p; None costs one numpy gather
            logits = self.processors.apply(logits.clone() if logits is raw_logits else logits, proc, lengths)
            if proc.min_p is not None and not all(t < 1e-5 for t in temp_list):  # greedy rows: min_p keeps argmax
                # min_p after temperature T is min_p ** T before it (apply_min_p), so the draw below stays fused
                temps = torch.tensor([t if t >= 1e-5 else 1.0 for t in temp_list], dtype=torch.float32)
                logits = apply_min_p(logits, to_device(proc.min_p.pow(temps), logits.device))
        plain = [_unrestricted(p, V) for p in params]
        greedy = all(t < 1e-5 for t in temp_list)
        plain_ok = (not greedy and self.use_cpu_kernels
                    and dispatch.sample_plain_applies(logits))  # asked after greedy: an argmax needs no kernels
        if greedy:
            token_ids = logits.argmax(dim=-1)
        elif plain_ok and all(plain):
            temps = torch.tensor(temp_list, dtype=torch.float32)  # one pass per row in C++
            token_ids = dispatch.sample_plain(logits, temps, self._uniforms(seqs))
        elif plain_ok and self.batch_invariant and any(plain):  # each kind of row by its own draw
            u = self._uniforms(seqs)
            pm = torch.tensor(plain)
            pi, ri = pm.nonzero().squeeze(1), (~pm).nonzero().squeeze(1)
            token_ids = torch.empty(N, dtype=torch.int64)
            token_ids[pi] = dispatch.sample_plain(logits[pi], torch.tensor(temp_list, dtype=torch.float32)[pi],
                                                  u[pi])
            token_ids[ri] = self._sorted_draw(logits[ri], [params[i] for i in ri.tolist()], u[ri])
        else:
            token_ids = self._sorted_draw(logits, params, self._uniforms(seqs))
        if proc is not None:  # penalty counts that advance at the draw (async scheduling: draw_time_counts.py)
            self.processors.advance(proc, token_ids)
        return self._with_logprobs(token_ids, raw_logits, params)

    def _with_logprobs(self, token_ids: torch.Tensor, raw_logits: torch.Tensor, params: list) -> SamplerOutput:
        """SamplerOutput of the drawn ``token_ids`` [N] with, for rows asking for them, the logprobs of
        ``raw_logits`` [N, V] (chosen token, rank, top-k), on the logits' device."""
        want = [p.logprobs for p in params if p.logprobs is not None]
        if not want:
            return SamplerOutput(token_ids, None, None, None)
        logp = torch.log_softmax(raw_logits, dim=-1)
        chosen, ranks, top_ids, top_vals = token_logprobs(logp, token_ids, max(want), self.batch_invariant)
        return SamplerOutput(token_ids, chosen, top_ids, top_vals, ranks)
