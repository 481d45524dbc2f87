"""Kimi Delta Attention (KDA): gated linear attention with a per-channel decay and the delta rule, batched over the
engine's decode group and padded prefill group, with per-request state slots (tokenfab/engine/state_cache.py).

Per head (D = head_dim, key width = value width = D), for token t of one sequence:

    q_t, k_t, v_t = silu(causal_conv_K(W_q x)), ...          depthwise causal short conv of K taps over the sequence
    q_t <- l2norm(q_t) * D^-0.5 ; k_t <- l2norm(k_t)            l2norm(x) = x / sqrt(sum x^2 + 1e-6)   (FLA, fp32)
    beta_t = sigmoid(b_proj x_t)                                one scalar per head
    g_t = -exp(A_log) * softplus(f_b(f_a x_t) + dt_bias)        per-channel log-decay [D] (softplus(x) = x for x > 20)
        or, with ``gate_lower_bound`` lb:  lb * sigmoid(exp(A_log) * (f_b(f_a x_t) + dt_bias))
    S_t = diag(exp(g_t)) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T      S: [D_k, D_v] float32
    o_t = S_t^T q_t
    y_t = o_proj( RMSNorm_D(o_t) * sigmoid(gate_t) )           gate = g_b(g_a x) (low rank) or g_proj x (full rank)

Sources: transformers 5 ``modeling_kimi_linear.py`` (``KimiLinearDeltaAttention``, ``KimiLinearForgetGate``,
``recurrent_kimi_delta_attention``, ``chunk_kimi_delta_attention``, ``KimiLinearRMSNormGated``, ``l2norm``); the
bounded gate follows transformers' ``Glm5NextTextForgetGate`` (``safe_gate_lower_bound * sigmoid(exp(A_log) * g)``,
FLA ``fla/ops/kda/gate.py``).

Decode runs the recurrence one token at a time (vectorized over sequences); prefill runs the chunkwise (WY)
form in chunks of 64 tokens, vectorized over the sequences of the padded prefill group, with bounded memory
(one chunk's [B, H, C, C, D] decay tensor at a time). Padded positions get q = k = v = 0, beta = 0, g = 0, which
leaves the state unchanged. These PyTorch forms are the reference; on the GPU code path (kernels/dispatch.py) the
fused recurrent kernel (kernels/gpu/kda.py: gate activation, beta sigmoid, l2norms and the recurrence in one launch,
state slots updated in place) runs decode and prefill groups, and fla-core's chunked kernels
(kernels/gpu/kda_chunk.py, optional) run bfloat16 / float16 prefills of 64 tokens or more where installed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab.kernels import dispatch
from tokenfab.layers.attention_metadata import AttentionGroup, AttentionMetadata
from tokenfab.layers.linear import Linear, can_pack

KDA_CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's form: + eps, not max(., eps))."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_log_decay(g: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """Per-channel log-decay from the gate pre-activation.

    Args:
        g: [..., H, D] float32 = f_b(f_a x) + dt_bias.
        a_log: [H] float32 (this rank's heads).
        lower_bound: None -> -exp(A_log) * softplus(g) (softplus(g) = g where g > 20, else log(1 + exp(g)));
            else lower_bound * sigmoid(exp(A_log) * g) (values in (lower_bound, 0)).

    Returns:
        [..., H, D] float32 log-decay (<= 0).
    """
    a = a_log.float().exp().view(-1, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * g)
    return -a * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))


def kda_recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for a batch of sequences.

    Args (float32): q, k [B, H, Dk] (normalized, q scaled); v [B, H, Dv]; g [B, H, Dk] log-decay; beta [B, H];
        state [B, H, Dk, Dv].

    Returns:
        (o [B, H, Dv], new state [B, H, Dk, Dv]).
    """
    state = state * g.exp().unsqueeze(-1)
    kv_mem = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(dim=-2), state


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, chunk_size: int = KDA_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over L tokens in chunks (WY form), equal to L recurrent steps.

    Within a chunk (G = cumulative log-decay from the chunk start, all per channel):
        M[i, j] = sum_d beta_i k_i[d] k_j[d] exp(G_i[d] - G_j[d])  (j < i);  T = (I + M)^-1
        U = T (beta v);  W = T (beta k exp(G))
        v_new = U - W S;  o = (q exp(G)) S + tril(q k^T exp(G_i - G_j)) v_new
        S <- exp(G_last) S + (k exp(G_last - G))^T v_new
    which is transformers' ``chunk_kimi_delta_attention`` with the forward substitution done by a unit-lower-
    triangular solve.

    Args (float32): q, k [B, H, L, Dk] (normalized, q scaled); v [B, H, L, Dv]; g [B, H, L, Dk]; beta [B, H, L];
        state [B, H, Dk, Dv] initial state.

    Returns:
        (o [B, H, L, Dv], final state [B, H, Dk, Dv]).
    """
    B, H, L, Dk = k.shape
    C = chunk_size
    pad = (-L) % C
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    dev = q.device
    strict_upper = torch.triu(torch.ones(C, C, dtype=torch.bool, device=dev), diagonal=1)
    upper = torch.triu(torch.ones(C, C, dtype=torch.bool, device=dev), diagonal=0)
    eye = torch.eye(C, dtype=torch.float32, device=dev)
    out = torch.empty(B, H, L + pad, v.shape[-1], dtype=torch.float32, device=dev)
    S = state
    for c0 in range(0, L + pad, C):
        qc, kc, vc = q[:, :, c0:c0 + C], k[:, :, c0:c0 + C], v[:, :, c0:c0 + C]
        bc = beta[:, :, c0:c0 + C].unsqueeze(-1)
        G = g[:, :, c0:c0 + C].cumsum(dim=-2)
        kb, vb = kc * bc, vc * bc
        decay = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(strict_upper[..., None], float("-inf")).exp()
        M = (kb.unsqueeze(-2) * kc.unsqueeze(-3) * decay).sum(-1).masked_fill(upper, 0.0)
        Tinv = torch.linalg.solve_triangular(eye + M, eye.expand_as(M), upper=False, unitriangular=True)
        U = Tinv @ vb
        W = Tinv @ (kb * G.exp())
        Aqk = (qc.unsqueeze(-2) * kc.unsqueeze(-3) * decay).sum(-1).masked_fill(strict_upper, 0.0)
        v_new = U - W @ S
        out[:, :, c0:c0 + C] = (qc * G.exp()) @ S + Aqk @ v_new
        g_last = G[:, :, -1:]
        S = S * g_last.transpose(-1, -2).exp() + (kc * (g_last - G).exp()).transpose(-1, -2) @ v_new
    return out[:, :, :L], S


class ShortConvWeight(nn.Module):
    """Holds a depthwise causal conv kernel ``weight`` [channels, 1, kernel] float32 (checkpoint name
    ``*_conv1d.weight``). Kept in float32 whatever the engine dtype, as Moonshot's checkpoints store it and its
    modeling code convolves: the short conv then runs in float32 and its output is rounded once."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=torch.float32), requires_grad=False)


class GatedRMSNorm(nn.Module):
    """RMSNorm over the head dim in float32, times sigmoid(gate) (transformers ``KimiLinearRMSNormGated``).

    x, gate [..., D] -> [..., D] in x's dtype: (w * x / sqrt(mean(x^2) + eps)) * sigmoid(gate), all float32.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight.float() * h
        return (h * torch.sigmoid(gate.float())).to(dtype)


class KimiDeltaAttention(nn.Module):
    """A KDA layer: x [T, hidden] -> [T, hidden]; its cache entry is a :class:`KDAStateCache`.

    Args:
        cfg: a :class:`tokenfab.config_kimi.KimiConfig`.
        head_range: [h0, h1) of the KDA heads this module owns (tensor parallel); default all heads. Per-head
            tensors (q/k/v/g rows, conv channels, f_b rows, dt_bias, b_proj rows, A_log entries, o_proj columns) are
            sliced by head; ``A_log`` (stored 1-D, padded or legacy 4-D) is sliced explicitly by the loader
            (``KimiLinearForCausalLM._a_log_slice``: the first num_heads entries are real, this module takes
            [h0, h1) of them).
    """

    def __init__(self, cfg, head_range: tuple[int, int] | None = None):
        super().__init__()
        self.total_heads = cfg.kda_num_heads
        self.h0, self.h1 = head_range or (0, cfg.kda_num_heads)
        H, D = self.h1 - self.h0, cfg.kda_head_dim
        self.num_heads, self.head_dim, self.kernel = H, D, cfg.kda_conv_kernel
        hd = H * D
        hid = cfg.hidden_size
        self.q_proj, self.k_proj, self.v_proj = Linear(hid, hd), Linear(hid, hd), Linear(hid, hd)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (ShortConvWeight(hd, self.kernel) for _ in range(3))
        self.f_a_proj = Linear(hid, D)
        self.f_b_proj = Linear(D, hd)
        self.dt_bias = nn.Parameter(torch.empty(hd, dtype=torch.float32), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32), requires_grad=False)
        self.b_proj = Linear(hid, H)
        self.full_rank_gate = cfg.use_full_rank_gate
        if self.full_rank_gate:
            self.g_proj = Linear(hid, hd)
        else:
            self.g_a_proj = Linear(hid, D)
            self.g_b_proj = Linear(D, hd)
        self.o_norm = GatedRMSNorm(D, cfg.rms_norm_eps)
        self.o_proj = Linear(hd, hid)
        self.lower_bound = cfg.gate_lower_bound
        self.in_proj: Linear | None = None  # q|k|v|f_a|gate|b in one GEMM after loading (:meth:`fuse`)
        self._conv_w: torch.Tensor | None = None  # [3HD, K] float32 taps q|k|v (:meth:`conv_weight`)
        self._fg_b: torch.Tensor | None = None  # [2, HD, D]: f_b and g_b stacked for one bmm (:meth:`fuse`)

    def fuse(self) -> None:
        """After loading: the six projections that read x (q, k, v, f_a, g_a or g_proj, b) become one GEMM over
        their concatenated rows (``in_proj``, as vLLM's merged KDA projection; each output column is the same dot
        product as before), unless their formats cannot be joined (then they stay separate). With a low-rank gate
        and plain weights that are not packed for a CPU kernel (GPUs), f_b and g_b, which read the adjacent f_a and
        g_a columns, become one batched GEMM (two launches -> one)."""
        self._conv_w = None  # re-made from the loaded taps on first use
        if self.num_heads and self.in_proj is None:
            gate = self.g_proj if self.full_rank_gate else self.g_a_proj
            self.in_proj = Linear.concat([self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, gate, self.b_proj])
        fb, gb = self.f_b_proj, getattr(self, "g_b_proj", None)
        if (self.in_proj is not None and gb is not None and self._fg_b is None and fb.qweight is None
                and gb.qweight is None and fb.weight is not None and gb.weight is not None
                and fb.weight.shape == gb.weight.shape and fb.weight.dtype == gb.weight.dtype
                and not can_pack(fb.weight)):  # CPU bf16 keeps its two packed GEMVs
            self._fg_b = torch.stack([fb.weight.detach(), gb.weight.detach()])  # [2, HD, D]
            fb.weight = gb.weight = None

    def conv_weight(self) -> torch.Tensor:
        """The q | k | v short-conv taps as one [3 * H * D, K] float32 contiguous tensor (made once)."""
        if self._conv_w is None:
            w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], 0)
            self._conv_w = w.reshape(w.shape[0], w.shape[-1]).float().contiguous()
        return self._conv_w

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (qkv [T, 3HD], g_raw [T, HD] = f_b(f_a x), b_raw [T, H] = b_proj x, gate [T, HD]) in
        the activation dtype; with ``in_proj`` qkv and b_raw are column slices of its output (strided rows)."""
        H, D = self.num_heads, self.head_dim
        hd = H * D
        if self.in_proj is None:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
            f_a, b_raw = self.f_a_proj(x), self.b_proj(x)
            gate = self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))
            return qkv, self.f_b_proj(f_a), b_raw, gate
        y = self.in_proj(x)
        qkv, f_a = y[:, :3 * hd], y[:, 3 * hd:3 * hd + D]
        if self._fg_b is not None:  # f_b(f_a x) and g_b(g_a x) in one batched GEMM (f_a, g_a adjacent columns)
            both = torch.bmm(y[:, 3 * hd:3 * hd + 2 * D].view(-1, 2, D).transpose(0, 1), self._fg_b.transpose(1, 2))
            return qkv, both[0], y[:, y.shape[1] - H:], both[1]
        g = y[:, 3 * hd + D:y.shape[1] - H]
        gate = g if self.full_rank_gate else self.g_b_proj(g)
        return qkv, self.f_b_proj(f_a), y[:, y.shape[1] - H:], gate

    def make_state_cache(self, num_slots: int, dtype: torch.dtype, device):
        from tokenfab.engine.state_cache import KDAStateCache
        return KDAStateCache(num_slots, 3 * self.num_heads * self.head_dim, self.kernel, self.num_heads,
                             self.head_dim, dtype, device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cache, meta: AttentionMetadata) -> torch.Tensor:
        if meta.state_rows is None:
            raise RuntimeError("KDA layers need AttentionMetadata.state_rows (the scheduler rows of the batch).")
        T, H, D = x.shape[0], self.num_heads, self.head_dim
        if H == 0:  # tensor parallel with more ranks than KDA heads: contributes nothing to the sum
            return x.new_zeros(T, self.o_proj.out_features)
        qkv, g_raw, b_raw, gate = self._project(x)
        gates = _Gates(self, g_raw, b_raw)
        core = x.new_empty(T + 1, H, D)
        if meta.state_group is not None:  # the decode-graph buffers' verification rows: one [B, Q] group
            groups, d = ((meta.state_group, True),), meta.state_group.num_seqs
        else:
            groups, d = ((meta.decode, True), (meta.prefill, False)), (meta.decode.num_seqs if meta.decode else 0)
        part = lambda a, first: None if a is None else (a[:d] if first else a[d:])
        dec = meta.decode
        normed = None  # a decode-only step: the fused decode launch applies the output norm too (into normed)
        if (meta.state_group is None and meta.prefill is None and dec is not None and dec.q_len == 1 and d == T
                and dispatch.gpu_path(x)):
            normed = x.new_empty(T + 1, H * D)
        for group, first in groups:
            if group is None:
                continue
            rows, hold = part(meta.state_rows, first), part(meta.state_hold, first)
            hold_h = part(meta.state_hold_host, first)
            if hold is not None and hold_h is not None and not hold_h.any():
                hold = None  # no verification row in this group
            deferred = None
            if hold is not None:  # its outputs now, its states at the commit (engine/state_commit.py)
                from tokenfab.engine.state_cache import DeferredStates
                deferred = DeferredStates(self, group.token_index, group.query_pos, rows, hold, qkv, gates,
                                          part(meta.state_rows_host, first), hold_h, part(meta.num_new_host, first))
                cache.deferred.append(deferred)
            norm = None if normed is None else (gate, self.o_norm.weight, self.o_norm.eps, normed)
            if self._run_group(group.token_index, group.query_pos, rows, qkv, gates, cache, core, hold, deferred,
                               norm):
                return self.o_proj(normed[:T])
        core = core[:T]
        out = dispatch.gated_rms_norm(core, gate, self.o_norm.weight, self.o_norm.eps)
        if out is None:
            out = self.o_norm(core, gate.reshape(T, H, D)).reshape(T, H * D)
        return self.o_proj(out)

    def _prep(self, y: torch.Tensor, valid: torch.Tensor, idx: torch.Tensor,
              gates: "_Gates") -> tuple[torch.Tensor, ...]:
        """The recurrence inputs of a group in float32, zero at padding: y [B, Q, 3HD] (the conv outputs), valid
        [B, Q], idx [B, Q] token rows -> q (normalized, scaled), k (normalized), v, g [B, Q, H, D]; beta [B, Q, H]."""
        B, Q = valid.shape
        H, D = self.num_heads, self.head_dim
        g_p, beta_p = gates.padded()
        vm = valid.view(B, Q, 1, 1)
        q, k, v = (t.reshape(B, Q, H, D).float() for t in y.split(H * D, dim=-1))
        q = torch.where(vm, l2norm(q) * D ** -0.5, 0.0)
        k = torch.where(vm, l2norm(k), 0.0)
        v = torch.where(vm, v, 0.0)
        g = torch.where(vm, g_p[idx], 0.0)  # [B, Q, H, D]
        beta = torch.where(valid.unsqueeze(-1), beta_p[idx], 0.0)  # [B, Q, H]
        return q, k, v, g, beta

    def commit_rows(self, e, cache, sel: torch.Tensor, kept: torch.Tensor, steps: int) -> None:
        """Write the states of the held rows ``sel`` [n] (indices into the entry's rows) of a deferred group ``e``
        (engine/state_cache.py ``DeferredStates``) as the states after their first ``kept`` [n] int64 tokens of
        that step (``steps`` >= their maximum, known on the host), from the states still in the slots (the forward
        held them) and what the forward computed (engine/state_commit.py). The GPU path runs the short-conv and
        recurrence kernels again over the kept tokens (two launches); the PyTorch path slices the conv state out of
        the forward's conv window and replays ``steps`` recurrence steps on its prepared k, v, g and beta (rows
        that keep fewer tokens masked with g = 0, beta = 0, which leaves S unchanged): the operations plain
        decoding runs on the same inputs."""
        rows = e.rows[sel]
        if e.prepared is None:
            self._rerun(e, cache, e.token_index[sel], e.query_pos[sel], rows, kept)
            return
        full, k, v, g, beta = (t[sel] for t in e.prepared)
        K = self.kernel
        if K > 1:
            take = (kept.view(-1, 1) + torch.arange(K - 1, device=kept.device).view(1, -1)).unsqueeze(1)
            conv = full.gather(2, take.expand(len(rows), full.shape[1], K - 1))
        else:
            conv = cache.conv[rows]
        S = cache.recurrent[rows]
        for j in range(steps):
            m = (kept > j).view(-1, 1, 1)  # rows still replaying; the others: g = 0, beta = 0 (S unchanged)
            _, S = kda_recurrent_step(k[:, j], k[:, j], v[:, j], torch.where(m, g[:, j], 0.0),
                                      torch.where(m.view(-1, 1), beta[:, j], 0.0), S)
        cache.write(rows, conv, S)

    def commit_all(self, e, cache, kept: torch.Tensor) -> None:
        """The commit over every row of a deferred group ``e`` at once, shapes fixed by the group (the decode-graph
        buffers' commit, engine/cuda_graph_runner.py, captured as a graph of its own): ``kept`` [B] int64 tokens per
        row, 0 for rows the forward did not hold and padding rows (their conv and recurrence then run over no token
        and write back the state they hold). Runs the conv and recurrence again over the kept tokens."""
        self._rerun(e, cache, e.token_index, e.query_pos, e.rows, kept)

    def _rerun(self, e, cache, idx: torch.Tensor, query_pos: torch.Tensor, rows: torch.Tensor,
               kept: torch.Tensor) -> None:
        """The group's conv and recurrence again over the first ``kept`` [B] tokens of rows ``rows`` [B] (token rows
        ``idx`` / positions ``query_pos`` [B, Q] of the deferred entry ``e``), states written; outputs discarded."""
        Q = idx.shape[1]
        qp = torch.where(torch.arange(Q, device=kept.device).view(1, Q) < kept.view(-1, 1), query_pos, -1)
        scratch = e.qkv.new_empty(e.qkv.shape[0] + 1, self.num_heads, self.head_dim)  # outputs: unused
        self._run_group(idx, qp.contiguous(), rows, e.qkv, e.gates, cache, scratch)

    def _run_group(self, idx: torch.Tensor, query_pos: torch.Tensor, rows: torch.Tensor, qkv: torch.Tensor,
                   gates: "_Gates", cache, core: torch.Tensor, hold: torch.Tensor | None = None,
                   deferred=None, norm: tuple | None = None) -> bool:
        """KDA for one padded group (``idx`` [B, Q] token rows, ``query_pos`` [B, Q] positions, -1 at padding;
        ``rows`` [B] state slots): stores its tokens' outputs in ``core`` [T + 1, H, D] (activation dtype) at their
        token rows and its states in ``cache``; ``qkv`` [T, 3HD] the projections (rows may be strided). On the GPU
        path a decode group (one token a row, no held rows) is one launch (dispatch.kda_decode_fused); two launches
        do verification rows or a short prefill: the short conv with its state update
        (kernels/gpu/short_conv.py) and the fused recurrence (kernels/gpu/kda.py); long bfloat16 prefills run fla's
        chunked kernels (kernels/gpu/kda_chunk.py) after the same conv kernel (no float32 [B, 3HD, K - 1 + Q] window
        is built); elsewhere the PyTorch forms here (the reference). ``hold`` [B] bool: rows (speculative
        verification) whose states are not written, committed later (engine/state_commit.py); the PyTorch forms
        write their old states back and leave the commit their conv window and recurrence inputs
        (``deferred.prepared``). ``norm`` (gate, weight, eps, y): the fused decode launch also stores the group's
        gated output norm in y (kernels/gpu/kda.py ``kda_decode_fused``); returns True when it did (then ``core``
        holds the un-normed outputs, y the layer's o_proj input), else False (the caller norms ``core``)."""
        B, Q = idx.shape
        H, D, K = self.num_heads, self.head_dim, self.kernel
        if (Q == 1 and hold is None and dispatch.kda_decode_fused(
                qkv, gates.g_raw, self.dt_bias, self.A_log, self.lower_bound, gates.b_raw, idx, query_pos, rows,
                cache, self.conv_weight(), core, D ** -0.5, norm)):
            return norm is not None  # a decode group on the GPU path: conv, states, recurrence (and norm): one launch
        kernel = dispatch.kda_recurrent_applies(qkv, cache.recurrent)
        chunk = kernel and Q >= KDA_CHUNK and dispatch.kda_chunk_applies(qkv, Q)
        conv = None
        if kernel and dispatch.kda_short_conv_applies(qkv, cache.conv, self.conv_weight(), query_pos):
            conv = dispatch.kda_short_conv(qkv, idx, query_pos, rows, cache.conv, self.conv_weight(), hold)
        if conv is not None and not chunk:
            y, n = conv
            dispatch.kda_recurrent(y, gates.g_raw, self.dt_bias, self.A_log, self.lower_bound, gates.b_raw, idx,
                                   n, query_pos[:, 0], rows, cache.recurrent, core, D ** -0.5, hold)
            return False
        valid = query_pos >= 0  # [B, Q]
        fresh = query_pos[:, 0] == 0
        held = None if hold is None else hold.view(B, 1, 1)
        if conv is not None:  # a long prefill: the conv kernel's outputs (state written) into fla's chunked kernels
            q, k, v, g, beta = self._prep(conv[0], valid, idx, gates)
            S0 = cache.read_recurrent(rows, fresh)
            o, S = dispatch.kda_chunk(q, k, v, g, beta, S0)
            cache.write_recurrent(rows, S if held is None else torch.where(held.unsqueeze(-1), S0, S))
            core[idx.reshape(-1)] = o.to(core.dtype).reshape(B * Q, H, D)
            return False
        if kernel:
            conv_state, S = cache.read_conv(rows, fresh), None
        else:
            conv_state, S = cache.read(rows, fresh)
        qkv_p = torch.cat([qkv, qkv.new_zeros(1, qkv.shape[1])], 0)  # row T: padding
        # depthwise causal conv over [conv state | this step's inputs]; padded inputs are zero rows (after the
        # valid ones, so they never reach a valid output)
        xg = qkv_p[idx]  # [B, Q, 3HD]
        w = self.conv_weight().unsqueeze(1)  # [3HD, 1, K]
        full = torch.cat([conv_state.to(xg.dtype), xg.transpose(1, 2)], dim=-1)  # [B, 3HD, K-1+Q]
        y = F.silu(F.conv1d(full.to(w.dtype), w, groups=w.shape[0])).to(xg.dtype).transpose(1, 2)  # [B, Q, 3HD]
        n = valid.sum(1)
        if K > 1:
            take = (n.view(B, 1) + torch.arange(K - 1, device=n.device).view(1, -1)).unsqueeze(1)
            new_conv = full.gather(2, take.expand(B, full.shape[1], K - 1))
            if held is not None:
                new_conv = torch.where(held, conv_state.to(new_conv.dtype), new_conv)
        else:
            new_conv = conv_state
        if kernel and not chunk:  # one launch: gates, l2norms, recurrence, outputs into core, states in place
            cache.write_conv(rows, new_conv)
            dispatch.kda_recurrent(y, gates.g_raw, self.dt_bias, self.A_log, self.lower_bound, gates.b_raw, idx, n,
                                   query_pos[:, 0], rows, cache.recurrent, core, D ** -0.5, hold)
            return False
        q, k, v, g, beta = self._prep(y, valid, idx, gates)
        if deferred is not None:
            deferred.prepared = (full, k, v, g, beta)
        S0 = S
        if chunk:
            S0 = cache.read_recurrent(rows, fresh)
            o, S = dispatch.kda_chunk(q, k, v, g, beta, S0)
        elif Q == 1:
            o, S = kda_recurrent_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S)
            o = o.unsqueeze(1)
        else:
            tr = lambda t: t.transpose(1, 2)
            # one chunk of Q when Q < 64 (verification rows of 1 + k tokens, short prefills): the [B, H, C, C, D]
            # decay tensor of a 64-token chunk would be mostly padding
            o, S = kda_chunked(tr(q), tr(k), tr(v), tr(g), tr(beta), S, chunk_size=min(KDA_CHUNK, Q))
            o = tr(o)
        if held is not None:
            S = torch.where(held.unsqueeze(-1), S0, S)
        cache.write(rows, new_conv, S)
        core[idx.reshape(-1)] = o.to(core.dtype).reshape(B * Q, H, D)
        return False


class _Gates:
    """One layer call's gate inputs: ``g_raw`` [T, H * D] = f_b(f_a x) and ``b_raw`` [T, H] = b_proj x in the
    activation dtype, as the fused kernel reads them; :meth:`padded` computes the float32 log-decay and beta of the
    PyTorch forms once, on first use."""

    def __init__(self, layer: KimiDeltaAttention, g_raw: torch.Tensor, b_raw: torch.Tensor):
        self.layer, self.g_raw, self.b_raw = layer, g_raw, b_raw
        self._padded = None

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(g [T + 1, H, D] float32 log-decay, beta [T + 1, H] float32), row T zero (padding)."""
        if self._padded is None:
            L = self.layer
            T = self.g_raw.shape[0]
            gpre = self.g_raw.float() + L.dt_bias.float()
            g = kda_log_decay(gpre.view(T, L.num_heads, L.head_dim), L.A_log, L.lower_bound)
            beta = torch.sigmoid(self.b_raw.float())  # Moonshot: self.b_proj(x).float().sigmoid()
            pad1 = lambda t: torch.cat([t, t.new_zeros(1, *t.shape[1:])], 0)
            self._padded = (pad1(g), pad1(beta))
        return self._padded
