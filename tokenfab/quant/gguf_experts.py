"""Routed experts of a GGUF file kept in their GGUF block type (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K): the packed-experts
seam's ``gguf`` format.

llama.cpp stores a layer's experts as three stacks ``ffn_{gate,up,down}_exps`` [E, out, in], each in one block type
(a Q4_K_M file: gate / up Q4_K, down Q4_K or Q6_K). The loader (loader/gguf_packed.py) hands each expert's rows over
as a :class:`~tokenfab.quant.gguf_weight.GGUFWeight`; this stack keeps them as one tiles buffer ``packed``
[E, ceil(out / 16), in / block_size, 16 * block_bytes] (gate's tiles then up's: gate rows must fill whole 16-row
tiles, as Qwen3-MoE's 768 do), the bytes of the file, never a float copy. Each expert is multiplied by the GGUF
linear kernels a :class:`GGUFWeight` runs (the AVX512-BF16 GEMV / brgemm, the AVX2 GEMV, Triton on a GPU, else the
float32 reference), one call per active expert and projection over that expert's tokens; the routed counts are read
on the host, so a model with these stacks decodes without CUDA graphs (engine/cuda_graph_runner.py).
"""
from __future__ import annotations

import torch

from tokenfab.errors import WeightLoadError
from tokenfab.quant.gguf_blocks import TILE, BlockType
from tokenfab.quant.gguf_weight import GGUFWeight
from tokenfab.quant.packed_experts import PackedExperts


class GGUFExperts(PackedExperts):
    """E expert weights W_e [out_features, in_features] in one GGUF block type, as GGUF tiles.

    ``packed`` (uint8 [E, ceil(out / 16), in / block_size, 16 * block_bytes]) is made by the first
    :meth:`load_part`, whose weight fixes the block type; ``scale`` is an empty [E, out, 0] buffer (the scales
    live inside the blocks)."""

    format_name = "gguf"
    checkpoint_parts = ("weight",)
    graph_safe = False  # one call per active expert: the routed counts are read on the host each step

    def __init__(self, num_experts: int, out_features: int, in_features: int):
        super().__init__(num_experts, out_features, in_features)
        self.block: BlockType | None = None
        self.register_buffer("packed", torch.zeros(num_experts, 0, dtype=torch.uint8), persistent=False)
        self.register_buffer("scale", torch.zeros(num_experts, out_features, 0, dtype=torch.uint8), persistent=False)
        self._views: list[GGUFWeight] | None = None

    def load_part(self, e: int, row0: int, part: str, t, name: str) -> None:
        """Copy expert ``e``'s rows [row0, row0 + t.out_features) from ``t`` (a :class:`GGUFWeight`, ``part``
        "weight") into the stack's tiles.

        Raises:
            WeightLoadError: not a GGUF weight, a block type other than the stack's (gate and up of one layer in two
                types), rows that do not start on a 16-row tile or do not fit, another in_features; named ``name``.
        """
        if part != "weight" or not isinstance(t, GGUFWeight):
            raise WeightLoadError(f"{name}: GGUF experts load whole GGUF weights, got {part} {type(t).__name__}")
        if t.in_features != self.in_features or row0 % TILE or row0 + t.out_features > self.out_features:
            raise WeightLoadError(f"{name}: GGUF expert rows [{row0}, {row0 + t.out_features}) x {t.in_features} do "
                                  f"not fit 16-row tiles of an expert weight [{self.out_features}, "
                                  f"{self.in_features}]")
        if self.block is None:
            self.block = t.block
            shape = (self.num_experts, -(-self.out_features // TILE), *t.tiles.shape[1:])
            self.packed = torch.zeros(shape, dtype=torch.uint8, device=t.tiles.device)
        elif t.block is not self.block:
            raise WeightLoadError(f"{name}: {t.block.name}, but this layer's other expert rows in the same stack "
                                  f"are {self.block.name} (one block type per stack; gate and up alike)")
        self.packed[e, row0 // TILE:row0 // TILE + t.tiles.shape[0]].copy_(t.tiles)

    def expert(self, e: int) -> GGUFWeight:
        """Expert ``e`` as a :class:`GGUFWeight` over this stack's tiles (a view, no copy; prepared once by
        :meth:`prepare`, made here when asked before it)."""
        if self._views is not None:
            return self._views[e]
        return GGUFWeight(self.packed[e], self.block, self.out_features, self.in_features)

    def dequantize_rows(self, e: int, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of expert ``e`` as float32 [end - start, in_features] (gguf's block formulas)."""
        return self.expert(e).dequantize_rows(start, end)

    def prepare(self) -> None:
        """One :class:`GGUFWeight` view per expert over the stack's tiles, each choosing its kernel for the
        device the stack is on now (GGUFWeight.prepare; called once after loading)."""
        self._views = [GGUFWeight(self.packed[e], self.block, self.out_features, self.in_features)
                       for e in range(self.num_experts)]
        for v in self._views:
            v.prepare()

    def grouped_linear(self, x: torch.Tensor, experts: list[int], counts: list[int]) -> torch.Tensor:
        """Rows of ``x`` [N, in_features] sorted by expert (``counts[i]`` rows for local expert ``experts[i]``)
        times their expert's W^T -> [N, out_features] in x's dtype: one GGUF linear per active expert."""
        y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        b = 0
        for e, n in zip(experts, counts):
            if n:
                y[b:b + n] = self.expert(e).linear(x[b:b + n], None)
                b += n
        return y
