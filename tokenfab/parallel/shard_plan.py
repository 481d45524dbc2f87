"""Which rank owns which heads, experts, intermediate rows and vocabulary rows, for any world size.

Uneven splits are the normal case (a model served on 6 devices although its 64 heads, 384 experts and 163,840
vocabulary rows do not divide by 6). Every sharded dimension is cut with :func:`split_range`: contiguous
``[start, end)`` ranges whose sizes differ by at most one, larger ranges first.

Placement assumed (one process group of ``world_size`` ranks, tensor parallel = expert parallel = world size):

========================  =========================================  =============================================
plan field                unit                                       tensors (HF names) and the dim that is split
========================  =========================================  =============================================
``heads[r]``              query heads (MLA heads for DeepSeek-V3)     column-parallel, dim 0 (output rows):
                                                                     ``q_proj`` / ``q_b_proj`` (rows = heads x
                                                                     qk_head_dim), MLA ``kv_b_proj`` (rows = heads x
                                                                     (qk_nope_head_dim + v_head_dim)), q/k/v bias.
                                                                     row-parallel, dim 1 (input columns):
                                                                     ``o_proj`` (cols = heads x v_head_dim).
``kv_heads[r]``           KV heads (GQA/MHA only)                    column-parallel, dim 0: ``k_proj``, ``v_proj``
                                                                     (rows = kv_heads x head_dim). Ranges of ranks
                                                                     that share a KV head overlap (replication).
``intermediate[r]``       dense-MLP intermediate channels            ``gate_proj``/``up_proj`` column-parallel dim 0;
                                                                     ``down_proj`` row-parallel dim 1.
``experts[r]``            routed experts (expert parallel)           whole experts: ``mlp.experts.{j}.*`` (or the
                                                                     fused ``[E, ...]`` tensors, dim 0).
``shared_intermediate``   shared-expert intermediate channels        ``mlp.shared_experts.gate_proj/up_proj`` dim 0;
                          (moe_intermediate_size x n_shared_experts)  ``mlp.shared_experts.down_proj`` dim 1.
``vocab[r]``              vocabulary rows                            ``embed_tokens`` (vocab-parallel embedding)
                                                                     and ``lm_head`` (column-parallel), dim 0.
``kda_heads[r]``          Kimi KDA heads (own split, not MLA heads)  KDA layers' ``q/k/v/g/g_b/f_b_proj``,
                                                                     ``q/k/v_conv1d``, ``dt_bias`` (rows = heads x
                                                                     head_dim), ``b_proj`` (rows = heads) dim 0;
                                                                     ``o_proj`` dim 1. ``A_log`` read whole (may be
                                                                     padded / 4-D), sliced by the model.
(replicated)              --                                         all RMSNorm weights, the router
                                                                     (``mlp.gate.weight`` and
                                                                     ``e_score_correction_bias``), the MLA
                                                                     down-projections ``q_a_proj`` and
                                                                     ``kv_a_proj_with_mqa``, row-parallel biases.
========================  =========================================  =============================================

GQA rule (query heads stay with their KV head; ``G = num_attention_heads / num_key_value_heads``):

* ``world_size <= num_key_value_heads``: KV heads are split with ``split_range(K, world_size)`` and each rank takes
  the query heads of its KV heads, ``heads[r] = (kv_start * G, kv_end * G)``. Every rank keeps the group size G.
* ``world_size > num_key_value_heads``: each KV head is replicated on a contiguous group of ranks (group sizes from
  ``split_range(world_size, K)``) and its G query heads are split across that group with ``split_range(G, n)``; each
  rank holds exactly one KV head (as vLLM does when tp > kv_heads, but for any world size). Ranks beyond the number
  of query heads hold no heads and an empty KV range.

MLA (DeepSeek-V3 / Kimi-K2): heads are split, but the compressed KV latent is shared by all heads, so every rank
holds the full latent (``kv_lora_rank + qk_rope_head_dim`` per token per layer) for every token: ``kv_heads[r]`` is
``(0, 1)`` on every rank that has heads (``(0, 0)`` on ranks beyond the number of heads). This plan assumes tensor-parallel attention; data-parallel attention (each rank holding
the latent only for its own requests) is not modelled.

FP8 block scales (``weight_scale_inv`` ``[ceil(out/128), ceil(in/128)]``) and packed INT4 tensors
(``weight_packed`` ``[out, in/8]`` int32, ``weight_scale`` ``[out, in/group]``) are cut along the same dim as their
weight: a rank takes every block or group that overlaps its element range, so a block straddling two ranks is held
by both (see :meth:`ShardPlan.shard_tensor`). An FP8 shard whose range starts inside a block is kept packed with
that offset (:meth:`ShardPlan.element_range`, tokenfab/quant/fp8_block_shard.py).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterable

# The checkpoint tensor listing (tokenfab/model_tensors.py), re-exported for callers that import it from here.
from tokenfab.model_tensors import (  # noqa: F401
    WEIGHT_FORMATS,
    TensorRecord,
    count_parameters,
    expert_tensors,
    model_tensors,
)

# Tensor classes used in byte accounting (keys of the per-rank dicts).
TENSOR_CLASSES = ("embed", "lm_head", "attn_q", "attn_kv", "attn_o", "attn_latent", "mlp", "shared_experts",
                  "experts", "router", "norms", "other")
REPLICATED_CLASSES = ("attn_latent", "router", "norms", "other")

Range = tuple[int, int]


def split_range(n: int, world_size: int) -> list[Range]:
    """Cut ``[0, n)`` into ``world_size`` contiguous ``[start, end)`` ranges, larger first.

    Sizes are ``ceil(n / w)`` for the first ``n % w`` ranks and ``floor(n / w)`` for the rest, so they differ by at
    most one (16 over 6 -> 3, 3, 3, 3, 2, 2). When ``n < world_size`` the last ranks get empty ranges ``(n, n)``.

    Raises:
        ValueError: ``n < 0`` or ``world_size < 1``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if n < 0:
        raise ValueError(f"cannot split a negative size {n}")
    base, extra = divmod(n, world_size)
    out, start = [], 0
    for r in range(world_size):
        size = base + (1 if r < extra else 0)
        out.append((start, start + size))
        start += size
    return out


def _gqa_ranges(num_heads: int, num_kv_heads: int, world_size: int) -> tuple[list[Range], list[Range]]:
    """(query-head ranges, KV-head ranges) per rank under the GQA rule in the module docstring."""
    g = num_heads // num_kv_heads
    if world_size <= num_kv_heads:
        kv = split_range(num_kv_heads, world_size)
        return [(s * g, e * g) for s, e in kv], kv
    heads: list[Range] = []
    kv_out: list[Range] = []
    for kv_head, (r0, r1) in enumerate(split_range(world_size, num_kv_heads)):
        for s, e in split_range(g, r1 - r0):
            heads.append((kv_head * g + s, kv_head * g + e))
            kv_out.append((kv_head, kv_head + 1) if e > s else (kv_head, kv_head))
    return heads, kv_out


@dataclass(frozen=True)
class TensorShard:
    """What one rank holds of one checkpoint tensor.

    ``dim is None``: the whole tensor (replicated, or an expert this rank owns) when ``owned``; nothing otherwise.
    Else the rank holds ``tensor.narrow(dim, start, end - start)`` (stored coordinates, i.e. already converted to
    scale blocks / packed columns for quantized tensors).
    """

    tensor_class: str
    owned: bool = True
    dim: int | None = None
    start: int = 0
    end: int = 0

    def local_bytes(self, shape: tuple[int, ...] | list[int], nbytes: int) -> int:
        """Bytes this rank holds of a tensor of ``shape`` taking ``nbytes`` in full: nbytes x (end - start) / shape[dim]."""
        if not self.owned:
            return 0
        if self.dim is None:
            return nbytes
        return nbytes * (self.end - self.start) // shape[self.dim]


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")


@dataclass
class ShardPlan:
    """Per-rank ``[start, end)`` ranges of every sharded dimension of one model (see the module docstring).

    Index by rank: ``plan.heads[rank]``, ``plan.kv_heads[rank]``, ``plan.intermediate[rank]``,
    ``plan.experts[rank]``, ``plan.shared_intermediate[rank]``, ``plan.vocab[rank]``. Units: heads, KV heads,
    intermediate channels (elements), experts, vocabulary rows. Dimensions a model lacks are ``(0, 0)`` everywhere.
    """

    world_size: int
    heads: list[Range]
    kv_heads: list[Range]
    intermediate: list[Range]
    experts: list[Range]
    shared_intermediate: list[Range]
    vocab: list[Range]
    # Widths used to turn unit ranges into tensor rows/cols (elements per unit along the split dim).
    q_head_width: int = 0        # rows of q_proj / q_b_proj per head (qk_head_dim or head_dim)
    kv_b_head_width: int = 0     # MLA kv_b_proj rows per head (qk_nope_head_dim + v_head_dim)
    kv_head_width: int = 0       # GQA k_proj / v_proj rows per KV head (head_dim)
    o_head_width: int = 0        # o_proj input cols per head (v_head_dim or head_dim)
    kda_head_width: int = 0      # Kimi KDA rows per KDA head (kda_head_dim); 0 when the model has no KDA layers
    is_mla: bool = False
    num_hidden_layers: int = 0
    quant_block: tuple[int, int] = (128, 128)
    totals: dict = field(default_factory=dict)  # full size of each unit dimension, e.g. {"heads": 64}
    # Kimi Linear / K3: KDA heads per rank (their own split, independent of the MLA heads) and the 0-indexed
    # layers whose ``self_attn.*`` tensors are KDA tensors (checkpoint names do not say which layers are KDA).
    kda_heads: list[Range] = field(default_factory=list)
    kda_layer_ids: frozenset = field(default_factory=frozenset)

    @classmethod
    def for_model(cls, model_config, world_size: int) -> "ShardPlan":
        """Build the plan for a :class:`tokenfab.config.ModelConfig` on ``world_size`` ranks.

        Raises:
            ValueError: ``world_size < 1``.
        """
        mc = model_config
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if mc.is_mla:
            heads = split_range(mc.num_attention_heads, world_size)
            kv = [(0, 1) if e > s else (0, 0) for s, e in heads]
            q_w, kvb_w, kv_w, o_w = mc.qk_head_dim, mc.qk_nope_head_dim + mc.v_head_dim, 0, mc.v_head_dim
        else:
            heads, kv = _gqa_ranges(mc.num_attention_heads, mc.num_key_value_heads, world_size)
            q_w, kvb_w, kv_w, o_w = mc.head_dim, 0, mc.head_dim, mc.head_dim
        shared = mc.moe_intermediate_size * mc.n_shared_experts if mc.is_moe else 0
        kda_heads = int(getattr(mc, "kda_num_heads", 0) or 0)  # Kimi KDA heads, split on their own
        block = (128, 128)
        qc = (mc.raw or {}).get("quantization_config") or {}
        if isinstance(qc.get("weight_block_size"), (list, tuple)) and len(qc["weight_block_size"]) == 2:
            block = (int(qc["weight_block_size"][0]), int(qc["weight_block_size"][1]))
        return cls(
            world_size=world_size, heads=heads, kv_heads=kv,
            intermediate=split_range(mc.intermediate_size, world_size),
            experts=split_range(mc.num_experts, world_size),
            shared_intermediate=split_range(shared, world_size),
            vocab=split_range(mc.vocab_size, world_size),
            q_head_width=q_w, kv_b_head_width=kvb_w, kv_head_width=kv_w, o_head_width=o_w, is_mla=mc.is_mla,
            kda_head_width=getattr(mc, "kda_head_dim", 0) if kda_heads else 0,
            num_hidden_layers=mc.num_hidden_layers, quant_block=block,
            totals={"heads": mc.num_attention_heads, "kv_heads": 1 if mc.is_mla else mc.num_key_value_heads,
                    "intermediate": mc.intermediate_size, "experts": mc.num_experts,
                    "shared_intermediate": shared, "vocab": mc.vocab_size, "kda_heads": kda_heads},
            kda_heads=split_range(kda_heads, world_size),
            kda_layer_ids=frozenset(getattr(mc, "kda_layers", None) or ()),
        )

    # ----------------------------------------------------------------------------------------------- queries
    def num_heads(self, rank: int) -> int:
        """Query heads on ``rank``."""
        s, e = self.heads[rank]
        return e - s

    def num_kv_heads(self, rank: int) -> int:
        """KV heads stored in ``rank``'s cache (1 for MLA: the shared latent)."""
        s, e = self.kv_heads[rank]
        return e - s

    def expert_owner(self, expert: int) -> int:
        """The rank that holds routed expert ``expert``."""
        for r, (s, e) in enumerate(self.experts):
            if s <= expert < e:
                return r
        raise ValueError(f"expert {expert} is outside [0, {self.totals.get('experts', 0)})")

    def vocab_owner(self, token_id: int) -> int:
        """The rank whose embedding / lm_head shard holds row ``token_id``."""
        for r, (s, e) in enumerate(self.vocab):
            if s <= token_id < e:
                return r
        raise ValueError(f"token id {token_id} is outside [0, {self.totals.get('vocab', 0)})")

    def kv_head_ranks(self, kv_head: int) -> list[int]:
        """Ranks that store KV head ``kv_head`` (more than one when it is replicated)."""
        return [r for r, (s, e) in enumerate(self.kv_heads) if s <= kv_head < e]

    # ----------------------------------------------------------------------------------------- tensor rules
    def tensor_rule(self, name: str) -> tuple[str, str, int | None, str | None, int]:
        """How a checkpoint tensor is placed, from its Hugging Face name.

        Returns ``(tensor_class, kind, dim, range_field, unit_width)``: ``kind`` is ``"replicated"``, ``"split"``
        (``dim`` cut by ``getattr(self, range_field)`` with ``unit_width`` elements per unit), ``"expert"`` (one
        whole expert, id in the name), ``"expert_fused"`` (dim 0 indexes experts) or ``"skip"`` (MTP layers at
        index >= num_hidden_layers, which the engine does not load).
        """
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Kimi Linear / K3 published names (dense MLPs too)
        m = _LAYER_RE.search(name)
        if m and self.num_hidden_layers and int(m.group(1)) >= self.num_hidden_layers:
            return "mtp", "skip", None, None, 0
        base = name
        for suffix in (".weight_scale_inv", ".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape",
                       ".input_scale", ".weight", ".bias", ".e_score_correction_bias"):
            if base.endswith(suffix):
                base = base[: -len(suffix)]
                break
        is_bias = name.endswith(".bias")
        leaf = base.rsplit(".", 1)[-1]
        if leaf == "embed_tokens":
            return "embed", "split", 0, "vocab", 1
        if leaf == "lm_head" or base.endswith("shared_head.head"):
            return "lm_head", "split", 0, "vocab", 1
        if "norm" in leaf:
            return "norms", "replicated", None, None, 0
        if ".experts." in name or base.endswith(".experts"):
            if _EXPERT_RE.search(name):
                return "experts", "expert", None, None, 0
            return "experts", "expert_fused", 0, "experts", 1
        if ".shared_expert" in base:
            if leaf in ("gate_proj", "up_proj"):
                return "shared_experts", "split", 0, "shared_intermediate", 1
            if leaf == "down_proj":
                return ("shared_experts", "replicated", None, None, 0) if is_bias else \
                    ("shared_experts", "split", 1, "shared_intermediate", 1)
        if leaf == "gate" and ".mlp." in name or name.endswith("e_score_correction_bias"):
            return "router", "replicated", None, None, 0
        if ".mlp." in name:
            if leaf in ("gate_proj", "up_proj"):
                return "mlp", "split", 0, "intermediate", 1
            if leaf == "down_proj":
                return ("mlp", "replicated", None, None, 0) if is_bias else ("mlp", "split", 1, "intermediate", 1)
        kda = ".kda_attn." in name or (m is not None and "model.layers." in name and ".self_attn." in name
                                       and int(m.group(1)) in self.kda_layer_ids)
        if kda and self.kda_head_width:
            # Kimi KDA layers: checkpoint names ``model.layers.{i}.self_attn.*`` of a KDA layer i (transformers-5
            # runtime names ``self_attn.forget_gate.*`` too), or the listing's ``kda_attn.*`` (model_tensors.py).
            # Per-head tensors split by ``kda_heads``; A_log (1-D, padded, or legacy 4-D [1, 1, H, 1]) and the fused
            # runtime ``conv1d`` [3HD, 1, K] are read whole and sliced by the model (KimiLinearForCausalLM
            # ._map_weights / _a_log_slice); f_a_proj / g_a_proj (rank D) and o_norm are replicated.
            w = self.kda_head_width
            if leaf in ("q_proj", "k_proj", "v_proj", "g_proj", "g_b_proj", "f_b_proj", "q_conv1d", "k_conv1d",
                        "v_conv1d", "dt_bias"):
                return "attn_q", "split", 0, "kda_heads", w
            if leaf == "b_proj":
                return "attn_q", "split", 0, "kda_heads", 1
            if leaf == "o_proj":
                return "attn_o", "split", 1, "kda_heads", w
            return "other", "replicated", None, None, 0
        if ".self_attn." in name:
            if leaf in ("q_a_proj", "kv_a_proj_with_mqa"):
                return "attn_latent", "replicated", None, None, 0
            if leaf in ("q_proj", "q_b_proj"):
                return "attn_q", "split", 0, "heads", self.q_head_width
            if leaf == "kv_b_proj":
                return "attn_kv", "split", 0, "heads", self.kv_b_head_width
            if leaf == "g_proj":  # Kimi K3 gated MLA output gate [heads x v_head_dim, hidden]
                return "attn_q", "split", 0, "heads", self.o_head_width
            if leaf in ("k_proj", "v_proj"):
                return "attn_kv", "split", 0, "kv_heads", self.kv_head_width
            if leaf == "o_proj":
                return ("attn_o", "replicated", None, None, 0) if is_bias else \
                    ("attn_o", "split", 1, "heads", self.o_head_width)
        return "other", "replicated", None, None, 0

    def element_range(self, name: str, rank: int) -> tuple[int, int, int] | None:
        """``(dim, start, end)``: the elements ``[start, end)`` along dim ``dim`` of checkpoint tensor ``name``
        (unpacked coordinates: rows / columns of the weight matrix, not scale blocks) that ``rank`` holds, or None
        when the tensor is not split (replicated, whole experts, skipped). The FP8 loader reads a shard's offset
        inside its first 128-block from it (``start % 128``; tokenfab/quant/fp8_block_shard.py)."""
        _, kind, dim, field_name, width = self.tensor_rule(name)
        if kind != "split":
            return None
        s, e = getattr(self, field_name)[rank]
        return dim, s * width, e * width

    def shard_tensor(self, name: str, shape: Iterable[int], rank: int) -> TensorShard:
        """What ``rank`` holds of checkpoint tensor ``name`` whose stored shape is ``shape``.

        For split tensors the element range ``[s * width, e * width)`` along the split dim is mapped to stored
        coordinates: identity when the stored dim equals the logical one; otherwise with block factor ``b``
        (``weight_scale_inv``: the FP8 block size, default 128; packed / group tensors: logical / stored) the rank
        holds stored indices ``[floor(s_el / b), ceil(e_el / b))``.

        Raises:
            ValueError: the stored dim is larger than the model config allows (config and weights disagree).
        """
        shape = tuple(int(x) for x in shape)
        cls, kind, dim, field_name, width = self.tensor_rule(name)
        if kind == "skip":
            return TensorShard(cls, owned=False)
        if kind == "replicated":
            return TensorShard(cls)
        if kind == "expert":
            j = int(_EXPERT_RE.search(name).group(1))
            s, e = self.experts[rank]
            return TensorShard(cls, owned=s <= j < e)
        if not shape or dim >= len(shape):
            # 1-D tensor split along dim 1 (cannot happen for a well-formed name), or a scalar: keep it whole.
            return TensorShard(cls)
        ranges = getattr(self, field_name)
        s, e = ranges[rank]
        total_units = self.totals[field_name]
        logical = total_units * width
        stored = shape[dim]
        s_el, e_el = s * width, e * width
        if stored == logical:
            return TensorShard(cls, dim=dim, start=s_el, end=e_el)
        if stored > logical:
            raise ValueError(f"tensor '{name}': dim {dim} has {stored} entries but the model config implies "
                             f"{logical} ({field_name} {total_units} x {width}); config.json and weights disagree")
        if name.endswith("_scale_inv"):
            b = self.quant_block[dim] if dim < 2 else 128
        elif logical % stored == 0:
            b = logical // stored
        else:
            b = math.ceil(logical / stored)
        if e_el <= s_el:
            return TensorShard(cls, dim=dim, start=s_el // b, end=s_el // b)
        return TensorShard(cls, dim=dim, start=s_el // b, end=min(stored, -(-e_el // b)))

    def describe(self) -> list[dict]:
        """One dict per rank with every range, for printing and JSON."""
        return [{"rank": r, "heads": self.heads[r], "kv_heads": self.kv_heads[r],
                 "intermediate": self.intermediate[r], "experts": self.experts[r],
                 "shared_intermediate": self.shared_intermediate[r], "vocab": self.vocab[r]}
                for r in range(self.world_size)]


def _empty_classes() -> dict[str, int]:
    return {c: 0 for c in TENSOR_CLASSES}


class WeightInventory:
    """Tensor records aggregated for fast per-rank byte accounting under many plans.

    Routed-expert bytes are kept per expert id (summed over layers and over weight / scale tensors), everything
    else as aggregated records; ``skipped_bytes`` counts tensors the engine does not load (MTP layers).
    """

    def __init__(self, records: Iterable[TensorRecord], model_config):
        self.model_config = model_config
        probe = ShardPlan.for_model(model_config, 1)
        self.records: list[TensorRecord] = []
        self.expert_bytes = [0] * max(model_config.num_experts, 0)
        self.skipped_bytes = 0
        self.total_bytes = 0
        self.class_totals = _empty_classes()
        agg: dict[tuple, int] = {}
        for r in records:
            cls, kind, *_ = probe.tensor_rule(r.name)
            b = r.nbytes * r.count
            if kind == "skip":
                self.skipped_bytes += b
                continue
            self.total_bytes += b
            self.class_totals[cls] += b
            if kind == "expert":
                j = int(_EXPERT_RE.search(r.name).group(1))
                if j >= len(self.expert_bytes):
                    raise ValueError(f"tensor '{r.name}': expert {j} but config.json has n_routed_experts/"
                                     f"num_experts = {len(self.expert_bytes)}")
                self.expert_bytes[j] += b
            elif kind == "expert_fused":
                per = r.nbytes // r.shape[0]
                for j in range(min(r.shape[0], len(self.expert_bytes))):
                    self.expert_bytes[j] += per * r.count
            else:
                key = (_LAYER_RE.sub(".layers.{L}.", "." + r.name)[1:], r.shape, r.nbytes)
                agg[key] = agg.get(key, 0) + r.count
        self.records = [TensorRecord(n, s, b, c) for (n, s, b), c in agg.items()]
        self._prefix = [0]
        for b in self.expert_bytes:
            self._prefix.append(self._prefix[-1] + b)

    def per_rank(self, plan: ShardPlan) -> list[dict[str, int]]:
        """Bytes each rank holds, by tensor class (replicated classes counted on every rank)."""
        out = []
        for rank in range(plan.world_size):
            d = _empty_classes()
            for r in self.records:
                sh = plan.shard_tensor(r.name, r.shape, rank)
                d[sh.tensor_class] += sh.local_bytes(r.shape, r.nbytes) * r.count
            s, e = plan.experts[rank] if self.expert_bytes else (0, 0)
            d["experts"] += self._prefix[e] - self._prefix[s]
            out.append(d)
        return out

    def replicated_bytes(self) -> int:
        """Bytes of one copy of the replicated tensor classes (norms, router, MLA down-projections, others)."""
        return sum(self.class_totals[c] for c in REPLICATED_CLASSES)


def weight_bytes_per_rank(model_config, world_size: int, weight_format: str | int = "bfloat16", *,
                          records: Iterable[TensorRecord] | None = None) -> list[dict[str, int]]:
    """Per-rank weight bytes by tensor class under :meth:`ShardPlan.for_model`.

    ``weight_format`` is a bytes-per-parameter int or a format of :func:`model_tensors`; pass ``records`` (e.g. read
    from safetensors headers by :mod:`tokenfab.planner`) to account real dtypes instead. Sum over ranks =
    total bytes + (world_size - 1) x replicated bytes + duplicated KV heads / straddling scale blocks.
    """
    recs = list(records) if records is not None else model_tensors(model_config, weight_format)
    return WeightInventory(recs, model_config).per_rank(ShardPlan.for_model(model_config, world_size))
