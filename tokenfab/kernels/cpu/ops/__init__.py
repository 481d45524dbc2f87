"""Fused CPU kernels, one module per kernel family (csrc/: one file per kernel concept, entry points in
cpu_kernels.h, Python bindings in bindings.cpp), compiled on first use, with the PyTorch paths as the fallback.

Eager PyTorch spends most of a CPU decode step on dispatch and small-tensor passes (~150 ops per layer-step,
benchmarks/NOTES.md). These kernels fold the hottest chains into one call each:

=====================  ==================================================================================
module                 kernels
=====================  ==================================================================================
``support``            whether they apply: a built extension, the tensor's dtype, AVX512-BF16 dot products
``attention``          paged decode attention from the block table, prefill's causal softmax, flash prefill
``head_gemm``          MLA's per-head absorbed-decode matmuls (q_nope W_UK, o_lat W_UV)
``norms_activations``  RMSNorm (optionally with the residual add), SiLU-GLU
``rotary``             rotary position embedding
``decode_blocks``      a decode-only batch's attention in one call per layer (MLA, grouped-query)
``vnni_linear``        bf16 linears on VNNI-blocked weights (GEMV for decode, brgemm for prefill)
``moe``                routed experts over packed bf16 weights in one call; DeepSeek-V3 routing
``gguf_linear``        GGUF Q4_0 / Q4_1 / Q8_0 / K-quant linears kept packed (AVX512-BF16 and AVX2 kernels)
``gguf_embedding``     rows of a GGUF-packed weight, dequantized
``fp8_linear``         FP8 block-scaled linears and expert stacks (AVX512-BF16 and AVX2 kernels)
``packed_experts``     INT4 group-32 / MXFP4 expert stacks (AVX512-BF16 and AVX2 kernels)
``sampling``           sampling without top-k / top-p in one pass per row
``batch_invariant``    the per-thread batch-invariant mode and the routers' fixed-order GEMM
=====================  ==================================================================================

Callers import the family they use (``from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf``); this
package re-exports nothing, so a test that replaces a function patches the module that defines and calls it, and
reaches every caller. The extension itself comes from :mod:`tokenfab.kernels.cpu.build` (``build.load()`` /
``build.load_error()``; tests replace ``build.load`` to run without it), built with
``torch.utils.cpp_extension.load`` (needs a C++ compiler; ninja comes with tokenfab's dependencies; about 2 minutes
once on a quiet 2-core machine, longer when other jobs share the cores, then cached under
``~/.cache/tokenfab/kernels/<torch version>-<cpu>-<digest>``, override with ``TOKENFAB_KERNEL_CACHE``).
``TOKENFAB_CPU_KERNELS=0`` disables them; a failed build logs one warning and every caller keeps its PyTorch path.
Only CPU tensors take these paths; CUDA/ROCm use kernels/gpu/, and an engine there builds these kernels only when
routed experts run on the host (:func:`~tokenfab.kernels.cpu.build.wanted`). Layers reach both through
:mod:`tokenfab.kernels.dispatch`.
"""
