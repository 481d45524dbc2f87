"""Checkpoint tensors of an FP8 block-scaled checkpoint (DeepSeek-V3 / Kimi-K2 as published) as the model loads them.

Each quantized Linear is stored as ``<name>.weight`` float8_e4m3fn [out, in] and ``<name>.weight_scale_inv`` float32
[ceil(out / 128), ceil(in / 128)]. :class:`Fp8CheckpointWeights` pairs them into one
:class:`~tokenfab.quant.fp8_block_weight.Fp8BlockWeight` under ``<name>.weight``, which ``CausalLM.load_weights``
hands to the Linear (kept packed), or, for a routed expert (``.mlp.experts.<e>.{gate,up,down}_proj``), copies into
its layer's packed FP8 expert stack (tokenfab/quant/fp8_block_experts.py; dequantized there into the bf16 stacks
only when host experts are requested). One kind is dequantized once here instead, by the same formula, to float32
(the model's ``copy_`` rounds it once to its dtype): MLA's ``kv_b_proj``, which the absorbed decode splits per head
into W_UK / W_UV (``MLAttention.fuse``), as vLLM dequantizes it for the same reason.

Everything else (embeddings, norms, the router ``mlp.gate``, lm_head) is read as published (bf16 / float32).

Under tensor parallel the wrapped iterable yields this rank's slices (tokenfab/parallel/sharded_loading.py: the e4m3
rows / columns of its range and the scale blocks they overlap); given the :class:`~tokenfab.parallel.shard_plan.
ShardPlan`, a shard that starts inside a 128-block (or is empty) becomes an
:class:`~tokenfab.quant.fp8_block_shard.Fp8BlockShard`, which carries that offset. Whole experts (expert parallel)
and replicated weights are read whole. Tensors the rank does not read at all (the MTP layers, ``NOT_READ``
placeholders) pass through unpaired for the model to report as skipped.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import torch

from tokenfab.errors import WeightLoadError
from tokenfab.parallel.sharded_loading import NOT_READ
from tokenfab.quant.fp8_block_shard import Fp8BlockShard
from tokenfab.quant.fp8_block_weight import BLOCK, Fp8BlockWeight

logger = logging.getLogger("tokenfab")

_SCALE = ".weight_scale_inv"
_DEQUANTIZED = re.compile(r"\.self_attn\.kv_b_proj\.weight$")


def is_dequantized_at_load(name: str) -> bool:
    """True for the FP8 weights this loader dequantizes (MLA kv_b_proj) instead of keeping packed."""
    return _DEQUANTIZED.search(name) is not None


class Fp8CheckpointWeights:
    """Wraps a ``(name, tensor)`` iterable (:class:`~tokenfab.loader.safetensors_loader.CheckpointWeights`): yields
    ``(<name>.weight, Fp8BlockWeight)`` for each weight / weight_scale_inv pair (whatever their order or shard),
    float32 dequantized tensors for :func:`is_dequantized_at_load` names, every other tensor unchanged.

    ``plan`` / ``rank`` (tensor parallel): the ShardPlan whose ``rank`` slices ``weights`` holds; each split weight's
    offset inside its first 128-block is ``plan.element_range(name, rank)``'s start modulo 128.

    Raises (when iterated):
        WeightLoadError: a float8 weight without its weight_scale_inv or the reverse, or a pair whose shapes do not
            match (naming the tensors).
    """

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]], plan=None, rank: int = 0):
        self.weights = weights
        # tensor parallel: ``weights`` holds this rank's slices (parallel/sharded_loading.py) and ``plan`` (a
        # ShardPlan) says where each starts; a shard starting inside a 128-block becomes an Fp8BlockShard
        self.plan, self.rank = plan, rank
        self.packed = self.dequantized = 0  # parameters kept packed / dequantized once, counted while iterating

    def file_of(self, name: str) -> str | None:
        """The file that held ``name`` (or its ``weight_scale_inv``), when the wrapped iterable knows it."""
        f = getattr(self.weights, "file_of", None)
        return None if f is None else (f(name) or f(name + "_scale_inv"))

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | Fp8BlockWeight]]:
        self.packed = self.dequantized = 0
        weights: dict[str, torch.Tensor] = {}  # "<name>.weight" -> float8 tensor awaiting its scale
        scales: dict[str, torch.Tensor] = {}   # "<name>.weight" -> scale awaiting its weight
        for name, t in self.weights:
            if t is NOT_READ:  # a tensor this rank does not read (MTP layers under tensor parallel): no pair to make
                yield name, t
            elif name.endswith(_SCALE):
                key = name[: -len("_scale_inv")]
                if key in weights:
                    yield key, self._pair(key, weights.pop(key), t)
                else:
                    scales[key] = t
            elif t.dtype != torch.float8_e4m3fn and t.dtype.is_floating_point and t.element_size() == 1:
                raise WeightLoadError(f"FP8 checkpoint: {self._where(name)} is {str(t.dtype).removeprefix('torch.')}; "
                                      "tokenfab reads float8_e4m3fn weights (quantization_config fmt 'e4m3').")
            elif t.dtype == torch.float8_e4m3fn:
                if name in scales:
                    yield name, self._pair(name, t, scales.pop(name))
                else:
                    weights[name] = t
            else:
                yield name, t
        if weights or scales:
            lone = [f"{n} (no {n}_scale_inv)" for n in weights] + [f"{n}_scale_inv (no float8 {n})" for n in scales]
            raise WeightLoadError(f"FP8 checkpoint: {len(lone)} weight(s) without their pair: "
                                  + ", ".join(lone[:10]) + (" ..." if len(lone) > 10 else ""))
        if self.packed or self.dequantized:
            logger.info("FP8 checkpoint: %d parameters kept packed (float8_e4m3fn + block scales, routed experts "
                        "included); %d dequantized once at load (MLA kv_b_proj for the absorbed decode)",
                        self.packed, self.dequantized)

    def _where(self, name: str) -> str:
        f = self.file_of(name)
        return f"{name} (in {f})" if f else name

    def _pair(self, name: str, weight: torch.Tensor, scale: torch.Tensor):
        offsets = self._shard_offsets(name)
        try:  # own copies: safetensors' tensors may view its file mapping, which would stay resident as file pages
            if offsets is not None:
                w = Fp8BlockShard(weight.clone(), scale.clone(), *offsets, name=name)
            else:
                w = Fp8BlockWeight(weight.clone(), scale.clone(), name)
        except ValueError as e:
            raise WeightLoadError(f"FP8 checkpoint: {e}") from None
        if is_dequantized_at_load(name):
            self.dequantized += weight.numel()
            return w.dequantize()
        self.packed += weight.numel()
        return w

    def _shard_offsets(self, name: str) -> tuple[int, int] | None:
        """(row_offset, col_offset) of this rank's shard of ``name`` inside its first 128-block when the shard
        starts inside a block or is empty (an Fp8BlockShard), None for a whole weight or a block-aligned shard."""
        rng = None if self.plan is None else self.plan.element_range(name, self.rank)
        if rng is None:
            return None
        dim, start, end = rng
        if end <= start:
            return 0, 0  # no rows / columns here (a rank beyond the number of heads)
        if start % BLOCK == 0:
            return None
        return (start % BLOCK, 0) if dim == 0 else (0, start % BLOCK)
