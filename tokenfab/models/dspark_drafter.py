"""The DSpark draft network (block-parallel drafter published for Kimi K3), given the target's tapped hidden states.

Shapes: B draft blocks (one per sequence), N = block_size query slots, L context positions, Ht the target's hidden
size, n = len(target_layer_ids), D the drafter's hidden size, C = kv_lora_rank, R = qk_rope_head_dim.

1. Context: the target's hidden states tapped after each layer of ``target_layer_ids`` at every verified position,
   concatenated [L, n * Ht], -> ``ctx = hidden_norm(fc(taps))`` [L, D]. Every MLA draft layer turns ctx into
   latent key rows ``[kv_a_layernorm(c) | rope(k_pe)]`` [L, C + R] with its own ``kv_a_proj_with_mqa`` (ctx is
   *not* passed through the layer's input_layernorm: DFlash's target_hidden injection); the proposer keeps those
   rows in a paged cache so each position is projected once.
2. One pass over the block ``x = embed([anchor, mask x (N - 1)])`` at positions p .. p + N - 1 (p = L, the anchor's
   position), through pre-norm residual layers (input_layernorm -> attention -> + x; post_attention_layernorm ->
   SiLU-GLU MLP -> + x), then ``norm``:
   * MLA layers: queries from the block, keys/values = [context rows (positions < p) | the block's own rows],
     non-causal within the block (every slot sees every slot, as DFlash's training mask: context before the anchor
     plus the whole block). Absorbed form: scores = [q_nope W_UK | rope(q_pe)] . [c | k_pe] * scale, out =
     softmax . c W_UV; ``o_proj(out * sigmoid(g_proj x))`` with the output gate. Same weights and names as tokenfab's
     K3 MLA (:class:`tokenfab.layers.mla.MLAttention`), plus RoPE on the R slice.
   * KDA layers: tokenfab's KDA (:class:`tokenfab.layers.kda.KimiDeltaAttention` weights) over the N slots only,
     from a zero recurrent state and a zero conv state: the state resets every block (SpecForge's K3 hybrid
     drafter injects context through its one MLA layer).
3. Logits: the target's lm_head on the normed block hidden states [B, N, V]; draft j (j = 0 .. m - 1) reads slot
   j (sample_from_anchor) or j + 1, plus the Markov bias ``markov_w2(markov_w1[prev])`` of the token before it
   (the anchor for j = 0, else draft j - 1), so drafts are drawn in order (:meth:`DSparkDrafter.markov_bias`).

The embedding and lm_head are the target's (passed in, never copied). The confidence head's weights are loaded and
not used (every block is verified whole).
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenfab.errors import WeightLoadError
from tokenfab.layers.attention_metadata import AttentionGroup
from tokenfab.layers.kda import KimiDeltaAttention, kda_chunked, kda_log_decay, l2norm
from tokenfab.layers.linear import Linear
from tokenfab.layers.mla import MLAttention
from tokenfab.layers.mlp import GatedMLP
from tokenfab.layers.norm import RMSNorm
from tokenfab.layers.paged_attention import write_cache
from tokenfab.spec_decode.dspark_config import DSparkConfig

_FP32_PARAMS = ("conv1d.weight", "A_log", "dt_bias")  # kept in float32 (as tokenfab's KDA keeps them)


def rope_rotate(x: torch.Tensor, positions: torch.Tensor, theta: float, interleave: bool) -> torch.Tensor:
    """RoPE on the last dim of x [..., heads, R] at positions [...] (int64), computed in float32, cast back.

    interleave: rotate adjacent pairs (x[2i], x[2i+1]) in place (SpecForge ``rope_interleave``); else halves
    (x[i], x[i + R/2]). Angle of pair i at position t: t * theta^(-2i / R).
    """
    R = x.shape[-1]
    if R == 0:
        return x
    inv = 1.0 / (theta ** (torch.arange(0, R, 2, dtype=torch.float32, device=x.device) / R))
    ang = positions.float().unsqueeze(-1) * inv  # [..., R/2]
    cos, sin = ang.cos().unsqueeze(-2), ang.sin().unsqueeze(-2)  # [..., 1, R/2]
    xf = x.float()
    if interleave:
        a, b = xf[..., 0::2], xf[..., 1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2).to(x.dtype)
    a, b = xf[..., : R // 2], xf[..., R // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


@dataclass
class PagedDraftContext:
    """Where a draft pass's MLA layers read their keys in place: each layer's paged context-row cache, addressed by
    the target's block tables, plus per sequence a *tail* of spare blocks past the pool's (never a real block).

    The tail's first block starts as a copy of the block holding the anchor's position p (its rows before p are
    context), and the block's N own rows are written after them, at positions p .. p + N - 1: each sequence's keys
    are then positions 0 .. p + N - 1 of one block table, and the N block slots attend as N x H query heads of one
    decode row over the latent rows (the GQA-style grouping the paged decode kernels take: every key row is read
    once per sequence, not once per slot; FlashMLA folds query length into heads the same way).

    Attributes (B sequences, W table width, N block slots):
        block_tables: [B, W] int64: the sequence's blocks for positions below (p // bs) * bs, then its tail blocks.
        context_lens: [B] int64, p + N (context plus the block).
        query_pos: [B, 1] int64, p + N - 1 (the gathered fallback's mask: keys j <= p + N - 1 visible).
        max_context: W * bs.
        tail_src: [B] int64, the block holding position p (copied to the tail's first block; any block when
            p % bs == 0, as no row of it is read).
        tail_dst: [B] int64, the tail's first block.
        slots: [B * N] int64, flat slots of the block's own rows in the tail.
    """

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_pos: torch.Tensor
    max_context: int
    tail_src: torch.Tensor
    tail_dst: torch.Tensor
    slots: torch.Tensor

    def group(self) -> AttentionGroup:
        """The decode-group view the paged attention functions take (one query row per sequence)."""
        return AttentionGroup(token_index=self.query_pos, query_pos=self.query_pos, block_tables=self.block_tables,
                              context_lens=self.context_lens, q_len=1, max_context=self.max_context)


def paged_context_tables(block_tables: np.ndarray, rows: np.ndarray, start: np.ndarray, *, num_blocks: int,
                         block_size: int, block_len: int, num_tail: int, width: int | None = None
                         ) -> tuple[np.ndarray, ...]:
    """The host arrays of a :class:`PagedDraftContext` for sequences at scheduler ``rows`` [B] whose anchors sit at
    positions ``start`` [B] (int64).

    Args:
        block_tables: [>= max(rows) + 1, max_blocks] int64, the block manager's tables (rows past the scheduler's
            may be zeros: a padding row's context is empty).
        num_blocks: the pool's blocks; row r's tail blocks are num_blocks + r * num_tail + (0 .. num_tail - 1).
        block_size: tokens per block; block_len: N, the drafter's block slots; num_tail: tail blocks per row.
        width: table columns W (>= max(start // block_size) + num_tail); None: exactly that.

    Returns:
        (tables [B, W], context_lens [B] = start + N, query_pos [B] = start + N - 1, tail_src [B], tail_dst [B],
        slots [B, N]), int64. Table columns below the anchor's block are the sequence's blocks, then its tail
        blocks, then 0 (never read: past the context length).

    Raises:
        ValueError: ``width`` too narrow for an anchor's block plus the tail.
    """
    bs, N, nt = block_size, block_len, num_tail
    B = len(rows)
    bt = block_tables[rows]  # [B, max_blocks]
    first = start // bs  # the block index holding the anchor's position
    need = int(first.max()) + nt if B else nt
    W = need if width is None else width
    if W < need:
        raise ValueError(f"paged_context_tables: width {W} < {need} (anchor block {int(first.max())} + {nt} tail).")
    tail = num_blocks + rows[:, None] * nt + np.arange(nt)[None, :]  # [B, nt] consecutive block ids
    cols = np.arange(W)[None, :]
    table = np.zeros((B, W), dtype=np.int64)
    w = min(W, bt.shape[1])
    table[:, :w] = np.where(cols[:, :w] < first[:, None], bt[:, :w], 0)
    off = cols - first[:, None]
    in_tail = (off >= 0) & (off < nt)
    table[in_tail] = tail[np.nonzero(in_tail)[0], off[in_tail]]
    src = bt[np.arange(B), np.minimum(first, bt.shape[1] - 1)]
    slots = (tail[:, :1] * bs + start[:, None] % bs) + np.arange(N)[None, :]  # [B, N]
    return table, start + N, start + N - 1, src, tail[:, 0].copy(), slots


class DraftMLAttention(MLAttention):
    """A DSpark MLA draft layer's attention (tokenfab's MLA weights, optional K3 output gate, RoPE on k_pe/q_pe)."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__(cfg, rotary=None)
        if self.q_lora_rank is not None:
            self.q_a_layernorm.eps = cfg.rms_norm_eps
        self.kv_a_layernorm.eps = cfg.rms_norm_eps
        self.g_proj = Linear(cfg.hidden_size, self.num_heads * self.v_dim) if cfg.mla_use_output_gate else None
        self.theta, self.interleave = cfg.rope_theta, cfg.rope_interleave

    def latent_rows(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Key rows of x [T, D] at positions [T]: [kv_a_layernorm(c) | rope(k_pe)] [T, C + R] in x's dtype."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope_dim], dim=-1)
        k_pe = rope_rotate(k_pe.unsqueeze(-2), positions, self.theta, self.interleave).squeeze(-2)
        return torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1)

    def block_forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: torch.Tensor | None,
                      ctx_valid: torch.Tensor | None) -> torch.Tensor:
        """x [B, N, D] (normed block), positions [B, N], ctx [B, L, C + R] context key rows with ctx_valid [B, L]
        (bool; False = padding) or None -> [B, N, D]. Attention in float32, non-causal within the block: the
        reference form (:meth:`paged_forward` reads the rows in place)."""
        B, N, _ = x.shape
        H, nope, R, C, vd = self.num_heads, self.nope, self.rope_dim, self.kv_lora, self.v_dim
        xf = x.reshape(B * N, -1)
        q_nope, q_pe = self._queries(xf, positions)
        rows = self.latent_rows(xf, positions.reshape(-1)).view(B, N, C + R)
        keys = rows if ctx is None else torch.cat([ctx.to(rows.dtype), rows], dim=1)  # [B, L + N, C + R]
        w = self.kv_b_proj.weight.view(H, nope + vd, C).float()
        q_lat = torch.cat([torch.einsum("bnhd,hdc->bnhc", q_nope.float(), w[:, :nope]), q_pe.float()], dim=-1)
        kf = keys.float()
        scores = torch.einsum("bnhc,blc->bhnl", q_lat, kf) * self.scale
        if ctx is not None:
            ok = torch.cat([ctx_valid, ctx_valid.new_ones(B, N)], dim=1)
            scores = scores.masked_fill(~ok[:, None, None, :], float("-inf"))
        o_lat = torch.einsum("bhnl,blc->bnhc", scores.softmax(-1), kf[..., :C])
        o = torch.einsum("bnhc,hvc->bnhv", o_lat, w[:, nope:]).to(x.dtype).reshape(B * N, H * vd)
        return self._output(o, xf).view(B, N, -1)

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK / W_UV^T of the absorbed form (:meth:`MLAttention._absorb`), made at the first paged pass (after the
        weights are loaded and moved); the projections stay as loaded (latent_rows reads kv_a_proj_with_mqa)."""
        if getattr(self, "_w_uk", None) is None:
            self._absorb()
        return self._w_uk, self._w_uv_t

    def _queries(self, xf: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """xf [B * N, D], positions [B, N] -> (q_nope [B, N, H, nope], rope(q_pe) [B, N, H, R]) in xf's dtype."""
        B, N = positions.shape
        q = self.q_proj(xf) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(xf)))
        q = q.view(B, N, self.num_heads, self.nope + self.rope_dim)
        return q[..., : self.nope], rope_rotate(q[..., self.nope:], positions, self.theta, self.interleave)

    def _output(self, o: torch.Tensor, xf: torch.Tensor) -> torch.Tensor:
        """o [B * N, H * v] -> o_proj(o * sigmoid(g_proj(xf))) [B * N, D] (no gate without g_proj)."""
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(xf))
        return self.o_proj(o)

    def paged_forward(self, x: torch.Tensor, positions: torch.Tensor, paged: PagedDraftContext,
                      cache: torch.Tensor) -> torch.Tensor:
        """:meth:`block_forward` with the keys read in place from ``cache`` [blocks, bs, C + R] (this layer's
        context rows plus ``paged``'s tail blocks; x's dtype): the tail is filled (one block copy per sequence, the
        block's rows written after the context), then absorbed decode attention over the latent pool as the target's
        MLA decodes (:meth:`MLAttention.latent_decode`: the Triton kernel on a GPU, the C++ kernel on CPU; where
        neither applies, the gathered context). x [B, N, D], positions [B, N] -> [B, N, D].

        Differences from the reference form: the absorbed queries are rounded to x's dtype (as the target's decode
        rounds them) and the kernels' softmax order; in float32 the two agree to rounding."""
        B, N, _ = x.shape
        H, C, R = self.num_heads, self.kv_lora, self.rope_dim
        xf = x.reshape(B * N, -1)
        q_nope, q_pe = self._queries(xf, positions)
        rows = self.latent_rows(xf, positions.reshape(-1))  # [B * N, C + R]
        cache.index_copy_(0, paged.tail_dst, cache.index_select(0, paged.tail_src))
        write_cache(cache, paged.slots, rows)
        w_uk, w_uv_t = self._absorbed_weights()
        q_lat = self._latent_queries(q_nope.reshape(B * N, H, -1), q_pe.reshape(B * N, H, R), w_uk)
        q_lat = q_lat.view(B, N * H, C + R)  # the block's slots x heads: query heads of one decode row
        o_lat = self.latent_decode(q_lat, cache, paged.group())
        o = self._value_heads(o_lat.reshape(B * N, H, C), w_uv_t)  # [B * N, H, v]
        return self._output(o.reshape(B * N, H * self.v_dim), xf).view(B, N, -1)


class DraftKDAttention(KimiDeltaAttention):
    """A DSpark KDA draft layer's attention: tokenfab's KDA over the block slots only, zero initial state."""

    def block_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N, D] -> [B, N, D]: causal short conv (zero history), gated delta rule from S = 0 over N slots."""
        B, N, _ = x.shape
        H, Dh, K = self.num_heads, self.head_dim, self.kernel
        xf = x.reshape(B * N, -1)
        qkv, g_raw, b_raw, gate = self._project(xf)  # separate or joined projections (KimiDeltaAttention.fuse)
        qkv = qkv.reshape(B, N, -1)
        w = self.conv_weight().unsqueeze(1)  # [3HD, 1, K] float32
        full = F.pad(qkv.transpose(1, 2).to(w.dtype), (K - 1, 0))
        y = F.silu(F.conv1d(full, w, groups=w.shape[0])).to(x.dtype).transpose(1, 2)  # [B, N, 3HD]
        q, k, v = (t.reshape(B, N, H, Dh).float() for t in y.split(H * Dh, dim=-1))
        q, k = l2norm(q) * Dh ** -0.5, l2norm(k)
        gpre = g_raw.float() + self.dt_bias.float()
        g = kda_log_decay(gpre.view(B, N, H, Dh), self.A_log, self.lower_bound)
        beta = torch.sigmoid(b_raw.float()).view(B, N, H)  # in float32, as Moonshot's b_proj(x).float().sigmoid()
        tr = lambda t: t.transpose(1, 2)
        S = torch.zeros(B, H, Dh, Dh, dtype=torch.float32, device=x.device)
        o, _ = kda_chunked(tr(q), tr(k), tr(v), tr(g), tr(beta), S)
        o = tr(o).to(x.dtype)  # [B, N, H, Dh]
        out = self.o_norm(o.reshape(B * N, H, Dh), gate.reshape(B * N, H, Dh)).reshape(B * N, H * Dh)
        return self.o_proj(out).view(B, N, -1)


class DSparkDraftLayer(nn.Module):
    """Pre-norm residual draft layer: x + attn(input_layernorm(x)); then + mlp(post_attention_layernorm(.))."""

    def __init__(self, cfg: DSparkConfig, kind: str):
        super().__init__()
        self.kind = kind
        self.self_attn = DraftMLAttention(cfg) if kind == "mla" else DraftKDAttention(cfg)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x, positions, ctx, ctx_valid, paged: PagedDraftContext | None = None):
        """x [B, N, D], positions [B, N]; an MLA layer's keys: ``ctx`` [B, L, C + R] with ``ctx_valid`` (reference
        form), or with ``paged`` its cache [blocks, bs, C + R] as ``ctx`` (read in place) -> [B, N, D]."""
        h = self.input_layernorm(x)
        if self.kind != "mla":
            a = self.self_attn.block_forward(h)
        elif paged is not None:
            a = self.self_attn.paged_forward(h, positions, paged, ctx)
        else:
            a = self.self_attn.block_forward(h, positions, ctx, ctx_valid)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class DSparkDrafter(nn.Module):
    """The DSpark draft network (see the module docstring for the formulas).

    Args:
        cfg: the drafter's :class:`~tokenfab.spec_decode.dspark_config.DSparkConfig`.
        embed: the target's token embedding (ids [...] -> [..., D]); D must equal the target's hidden size.
        lm_head: the target's head (hidden [T, D] -> logits [T, V] float32), e.g. ``target.compute_logits``.
    """

    def __init__(self, cfg: DSparkConfig, embed, lm_head):
        super().__init__()
        self.cfg = cfg
        D = cfg.hidden_size
        self.fc = Linear(len(cfg.target_layer_ids) * cfg.target_hidden_size, D)
        self.hidden_norm = RMSNorm(D, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DSparkDraftLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(D, eps=cfg.rms_norm_eps)
        self.markov_w1 = self.markov_w2 = None
        if cfg.markov_rank:
            self.markov_w1 = nn.Parameter(torch.empty(cfg.vocab_size, cfg.markov_rank), requires_grad=False)
            self.markov_w2 = Linear(cfg.markov_rank, cfg.vocab_size)
        self.confidence_proj = None
        if cfg.enable_confidence_head:  # loaded, not used at inference
            width = D + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
            self.confidence_proj = Linear(width, 1, bias=True)
        self._embed, self._lm_head = [embed], [lm_head]  # lists: not registered as submodules (target-owned)
        self.mla_layers = [i for i, t in enumerate(cfg.layer_types) if t == "mla"]

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [T, n * Ht] (the tapped hidden states, concatenated in target_layer_ids order) -> ctx [T, D]."""
        return self.hidden_norm(self.fc(taps))

    def context_rows(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """ctx [T, D] at positions [T] -> one [T, C + R] key-row tensor per MLA draft layer (in layer order)."""
        return [self.layers[i].self_attn.latent_rows(ctx, positions) for i in self.mla_layers]

    def block(self, anchor_ids: torch.Tensor, start: torch.Tensor, ctx_rows: list[torch.Tensor] | None,
              ctx_valid: torch.Tensor | None, paged: PagedDraftContext | None = None) -> torch.Tensor:
        """One draft pass.

        Args:
            anchor_ids: [B] int64, the last sampled token of each sequence (block slot 0).
            start: [B] int64, the anchor's position p (= context length).
            ctx_rows: per MLA layer [B, L, C + R] context key rows (positions 0 .. L - 1, padded), or None; with
                ``paged``: per MLA layer its paged cache [blocks, bs, C + R] (context rows and tail blocks).
            ctx_valid: [B, L] bool, True where a context row is real (position < p), or None (None with paged).
            paged: the block tables and tails of the paged form (:class:`PagedDraftContext`), or None.

        Returns:
            [B, N, D] normed hidden states of the N block slots.
        """
        B, N = anchor_ids.shape[0], self.cfg.block_size
        ids = torch.full((B, N), self.cfg.mask_token_id, dtype=torch.int64, device=anchor_ids.device)
        ids[:, 0] = anchor_ids
        x = self._embed[0](ids)
        positions = start.view(B, 1) + torch.arange(N, device=start.device).view(1, N)
        it = iter(ctx_rows) if ctx_rows is not None else None
        for layer in self.layers:
            ctx = next(it) if (it is not None and layer.kind == "mla") else None
            x = layer(x, positions, ctx, ctx_valid if ctx is not None else None, paged)
        return self.norm(x)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, N, D] block hidden states -> [B, m, V] float32 base logits of the m = num_drafts drafts (slots
        0 .. N - 1 with sample_from_anchor, else 1 .. N - 1), before the Markov bias."""
        h = hidden if self.cfg.sample_from_anchor else hidden[:, 1:]
        B, m, D = h.shape
        return self._lm_head[0](h.reshape(B * m, D)).float().view(B, m, -1)

    def markov_bias(self, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """prev_ids [B] int64 (the token before each draft) -> [B, V] float32 = markov_w2(markov_w1[prev]), or
        None without a Markov head."""
        if self.markov_w1 is None:
            return None
        return self.markov_w2(self.markov_w1[prev_ids]).float()


# ---- weights ---------------------------------------------------------------------------------------------------
_IGNORED = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight", "t2d", "d2t")


def _canonical(name: str) -> str:
    """Published tensor names -> this module's: ``model.`` prefix dropped, ``markov_head.markov_w*`` /
    ``markov_w*``, ``confidence_head.proj`` -> ``confidence_proj``, K3 runtime KDA names."""
    if name.startswith("model."):
        name = name[len("model."):]
    name = name.replace("markov_head.", "")
    if name == "markov_w1.weight":
        return "markov_w1"
    name = name.replace("confidence_head.proj.", "confidence_proj.").replace("confidence_head.", "confidence_proj.")
    return name.replace(".self_attn.forget_gate.", ".self_attn.")


def set_param_dtypes(drafter: DSparkDrafter, dtype: torch.dtype) -> None:
    """Give the drafter's parameters the dtypes :func:`load_dspark_weights` gives them: ``dtype``, except the KDA
    conv kernels, A_log and dt_bias (float32). Used after dummy weights (spec_decode/dspark_proposer.py)."""
    for name, p in drafter.named_parameters():
        p.data = p.data.to(torch.float32 if any(name.endswith(s) for s in _FP32_PARAMS) else dtype)


def load_dspark_weights(drafter: DSparkDrafter, path: str, dtype: torch.dtype) -> list[str]:
    """Fill ``drafter`` from the ``*.safetensors`` files in ``path`` (both published layouts' names).

    The drafter's parameters become ``dtype`` except the KDA conv kernels, A_log and dt_bias (float32). A SpecForge
    conv kernel [channels, K] is read as [channels, 1, K]; a padded A_log keeps its first num_heads entries.

    Returns:
        names skipped on purpose (the embedding / lm_head copies: the target's are used).

    Raises:
        WeightLoadError: no safetensors file, a tensor this drafter has no place for, a shape mismatch, or missing
            tensors (all named).
    """
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise WeightLoadError(f"DSpark drafter {path}: no *.safetensors file.")
    params = dict(drafter.named_parameters())
    loaded, skipped = set(), []
    for fn in files:
        with safe_open(fn, framework="pt") as f:
            for raw in f.keys():
                if any(raw.endswith(s) and (raw == s or raw.endswith("." + s)) for s in _IGNORED):
                    skipped.append(raw)
                    continue
                name = _canonical(raw)
                p = params.get(name)
                if p is None:
                    raise WeightLoadError(f"DSpark drafter {path}: tensor '{raw}' has no place in a "
                                          f"{drafter.cfg.layout} drafter with layers {drafter.cfg.layer_types}.")
                t = f.get_tensor(raw)
                if name.endswith("conv1d.weight") and t.dim() == 2:
                    t = t.unsqueeze(1)
                if name.endswith("A_log"):
                    t = t.reshape(-1)[: p.shape[0]]
                if tuple(t.shape) != tuple(p.shape):
                    raise WeightLoadError(f"DSpark drafter {path}: '{raw}' has shape {list(t.shape)}, expected "
                                          f"{list(p.shape)}.")
                keep32 = any(name.endswith(s) for s in _FP32_PARAMS)
                p.data = t.to(torch.float32 if keep32 else dtype).contiguous()
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise WeightLoadError(f"DSpark drafter {path}: missing tensors {missing[:12]}"
                              f"{' ...' if len(missing) > 12 else ''}.")
    return skipped
