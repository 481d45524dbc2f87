"""A Linear weight in a GGUF block type (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), kept packed and multiplied packed.

Fast path: ``cpu_gguf.gguf_linear`` (kernels/cpu/csrc/gguf_linear.cpp) on CPUs whose kernels have AVX512-BF16: a
decode GEMV that unpacks nibbles and scales in registers and a prefill GEMM that dequantizes 32 weight rows at a
time into a thread-local buffer for oneDNN's brgemm. On CPUs without AVX512-BF16 (the ``avx2`` ISA level) the AVX2
kernel (``cpu_gguf.gguf_gemv_avx2``, csrc/gguf_gemv_avx2.cpp; every type here): decode rows (up to
``AVX2_GEMV_MAX_ROWS``) on the packed bytes, a fifth to a seventh of a float32 copy's, prefill through panels
dequantized into a float32 GEMM; no float32 copy is kept (it served prefill 1.0-1.1x faster at twice the resident
memory: NOTES 84). Reference / fallback (no kernels, another device, ``TOKENFAB_CPU_LINEAR=torch``): a float32 copy
within its budget (:meth:`~tokenfab.quant.packed_weight.PackedWeight.keep_dense_copy`), else dequantize 1024 rows at
a time and ``F.linear`` in float32. On CUDA/ROCm the Triton kernels
(kernels/gpu/gguf_linear.py, and kernels/gpu/gguf_kquant_linear.py for the K-quants) read the same tiles.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenfab.kernels.cpu import build as cpu_build
from tokenfab.kernels.cpu.ops import gguf_embedding as cpu_gguf_embedding
from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf
from tokenfab.kernels import dispatch
from tokenfab.quant import gguf_blocks
from tokenfab.quant.gguf_blocks import TILE, BlockType
from tokenfab.quant.packed_weight import PackedWeight


class GGUFWeight(PackedWeight):
    """W [out_features, in_features] in GGUF block type ``block`` as tiles (:func:`gguf_blocks.pack_tiles`).

    Build with :meth:`from_rows` from the file's bytes. ``tiles`` is a uint8 buffer
    [ceil(out / 16), in / block_size, 16 * block_bytes] (block_size 32, or 256 for K-quants).
    """

    def __init__(self, tiles: torch.Tensor, block: BlockType, out_features: int, in_features: int):
        super().__init__(out_features, in_features)
        if tiles.dtype != torch.uint8 or tiles.shape != (-(-out_features // TILE), in_features // block.block_size,
                                                         block.tile_block_bytes):
            raise ValueError(f"GGUFWeight: tiles {tuple(tiles.shape)} {tiles.dtype} do not hold a {block.name} weight "
                             f"[{out_features}, {in_features}]")
        self.block = block
        self.register_buffer("tiles", tiles, persistent=False)
        self._kernel = False
        self._gemv_avx2 = False  # the AVX2 kernel for every row (prepare)

    @classmethod
    def from_rows(cls, raw: torch.Tensor, block: BlockType | str | int, in_features: int) -> GGUFWeight:
        """From GGUF rows: raw [out, in / 32 * block_bytes] uint8 (one tensor's data as stored in the file, rows =
        output features).

        Raises:
            ValueError: ``in_features`` not a multiple of the block size (32; 256 for K-quants), or raw's row
                length not matching it.
        """
        bt = block if isinstance(block, BlockType) else gguf_blocks.block_type(block)
        bs = bt.block_size
        if in_features % bs or raw.dim() != 2 or raw.shape[1] != in_features // bs * bt.block_bytes:
            raise ValueError(f"GGUF {bt.name} rows {tuple(raw.shape)} do not hold {in_features} inputs per row "
                             f"(in_features must be a multiple of {bs}, {bt.block_bytes} bytes per {bs})")
        return cls(gguf_blocks.pack_tiles(raw, bt), bt, raw.shape[0], in_features)

    @property
    def nbytes(self) -> int:
        return self.tiles.numel()

    def rows(self, t0: int = 0, t1: int | None = None) -> torch.Tensor:
        """The GGUF rows of tiles [t0, t1) as in the file (raw uint8; the inverse of :meth:`from_rows`)."""
        return gguf_blocks.unpack_tiles(self.tiles, self.block, self.out_features, t0, t1)

    def dequantize_rows(self, start: int, end: int) -> torch.Tensor:
        t0, t1 = start // TILE, -(-end // TILE)
        w = gguf_blocks.dequantize_rows(self.rows(t0, t1), self.block)
        return w[start - t0 * TILE:end - t0 * TILE]

    def prepare(self) -> None:
        """Use the C++ kernel when it runs here: CPU tensors, built kernels with AVX512-BF16 and a CPU linear backend
        other than ``torch`` (``TOKENFAB_CPU_LINEAR``); on a CPU without it, the AVX2 kernel where it is built, else
        a float32 copy within the budget (:meth:`~tokenfab.quant.packed_weight.PackedWeight.keep_dense_copy`)."""
        from tokenfab.layers.linear import cpu_linear_backend
        on_cpu = self.tiles.device.type == "cpu" and cpu_linear_backend() != "torch"
        self._kernel = on_cpu and cpu_gguf.gguf_linear_applies()
        self._gemv_avx2 = on_cpu and not self._kernel and cpu_gguf.gguf_gemv_avx2_applies(self.block.ggml_type)
        if not self._kernel and not self._gemv_avx2:
            self.keep_dense_copy()

    def _avx2_rows(self, x: torch.Tensor) -> bool:
        """Whether x's rows run the AVX2 kernel: it applies (:meth:`prepare`) and x is bf16 or float32."""
        return self._gemv_avx2 and x.dtype in (torch.bfloat16, torch.float32)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self._avx2_rows(x):
            return dispatch.gguf_gemv_avx2(x, self.tiles, self.block, self.out_features, bias).to(x.dtype)
        y = dispatch.gguf_linear(x, self.tiles, self.block, self.out_features, bias, self._kernel)
        return y if y is not None else self.reference_linear(x, bias)

    def linear_f32(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`linear`, float32 outputs from the kernel's accumulator (the LM head of a GGUF file)."""
        if self._avx2_rows(x):
            return dispatch.gguf_gemv_avx2(x, self.tiles, self.block, self.out_features, bias)
        y = dispatch.gguf_linear(x, self.tiles, self.block, self.out_features, bias, self._kernel, out_f32=True)
        return y if y is not None else self.reference_linear(x, bias, out_dtype=torch.float32)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` dequantized: ``cpu_gguf_embedding.gguf_embedding`` where the kernels are built (CPU tiles,
        bf16 / float32), else the tiles holding them unpacked and dequantized in PyTorch: the same values (gguf's
        float32 ones, one rounding to ``dtype``).

        Raises:
            IndexError: an id outside [0, out_features), off the GPU path (on it, ids are not read on the host)."""
        if (self.tiles.device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)
                and cpu_build.load() is not None and hasattr(cpu_build.load(), "gguf_embedding")):
            return cpu_gguf_embedding.gguf_embedding(self.tiles, self.block.ggml_type, self.out_features, ids.long(),
                                                     dtype)
        flat = ids.reshape(-1).long()
        # checked on the host off the GPU path; on it (a CUDA graph captures this) no host read: the engine's ids are
        # validated at admission and the tile gather below asserts on the device for ids past the table
        if flat.numel() and not dispatch.gpu_path(flat) and (int(flat.min()) < 0
                                                             or int(flat.max()) >= self.out_features):
            raise IndexError(f"embedding ids must lie in [0, {self.out_features})")
        raw = gguf_blocks.unpack_tiles(self.tiles[flat // TILE], self.block, flat.numel() * TILE)
        raw = raw.reshape(flat.numel(), TILE, -1)[torch.arange(flat.numel(), device=flat.device), flat % TILE]
        return gguf_blocks.dequantize_rows(raw, self.block).to(dtype).reshape(*ids.shape, self.in_features)

    @classmethod
    def concat(cls, weights: Sequence[PackedWeight]) -> GGUFWeight | None:
        """Rows of several GGUF weights of one block type and in_features joined (q|k|v, gate|up); None otherwise."""
        first = weights[0]
        if not all(isinstance(w, GGUFWeight) and w.block is first.block and w.in_features == first.in_features
                   for w in weights):
            return None
        if all(w.out_features % TILE == 0 for w in weights[:-1]):  # whole tiles: join them as they are
            tiles = torch.cat([w.tiles for w in weights])
        else:
            tiles = gguf_blocks.pack_tiles(torch.cat([w.rows() for w in weights]), first.block)
        out = cls(tiles, first.block, sum(w.out_features for w in weights), first.in_features)
        out._kernel, out._gemv_avx2 = first._kernel, first._gemv_avx2
        return out

    def extra_repr(self) -> str:
        return f"{self.block.name}, " + super().extra_repr()
