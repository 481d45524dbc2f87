"""What batch-invariant mode (``EngineConfig.batch_invariant``) covers, checked once when the ModelRunner is built.

In that mode every step runs through the fused CPU decode stack (engine/cpu_decode_stack.py) with each token, of a
prompt chunk or a decode, as one query row over its own context (context length = its position + 1), in the
kernels' batch-invariant mode (``cpu_batch_invariant.batch_invariant``): linears of any number of rows on brgemm tiles
(never the GEMV, whose order differs), decode attention over the pool in absolute 16-token blocks without context
splits, routers on a fixed-order float32 dot. A token's hidden states, KV rows and logits then have the same bits
whatever else the step holds and wherever a chunk starts (docs/batch_invariance.md). Anything outside that path is refused here, by name,
instead of silently falling back to a path whose rounding depends on the batch.
"""
from __future__ import annotations

import torch

from tokenfab.errors import UnsupportedError
from tokenfab.kernels.cpu import build as cpu_build
from tokenfab.kernels.cpu.ops import support as cpu_support
from tokenfab.layers.linear import cpu_linear_backend
from tokenfab.quant.packed_weight import PackedWeight

_OFF = "or leave batch_invariant off"


def check_model(model: torch.nn.Module, device: torch.device, graph_mode: str | None) -> None:
    """Refuse a device, kernel build or model the batch-invariant path cannot run (before the stack is built).

    Raises:
        UnsupportedError: not CPU (or CUDA graphs on), no built kernels or no AVX512-BF16 in them, a
            ``TOKENFAB_CPU_LINEAR`` other than tokenfab, weights kept in a compressed format (GGUF blocks), or a
            model with recurrent (KDA) state.
    """
    if device.type != "cpu" or graph_mode is not None:
        raise UnsupportedError(f"batch_invariant=True runs on CPU only (device {device}); use device='cpu' {_OFF}.")
    if cpu_build.load() is None:
        raise UnsupportedError(f"batch_invariant=True needs tokenfab's fused CPU kernels, which are unavailable "
                               f"({cpu_build.load_error()}); install a C++ compiler and unset "
                               f"TOKENFAB_CPU_KERNELS=0, {_OFF}.")
    if not cpu_support.has_bf16_dot():
        raise UnsupportedError("batch_invariant=True needs a CPU with AVX512-BF16 (the fused decode stack and "
                               f"tokenfab's VNNI-blocked linears need it); {_OFF}.")
    backend = cpu_linear_backend()
    if backend != "tokenfab":
        raise UnsupportedError(f"batch_invariant=True runs tokenfab's own linears; TOKENFAB_CPU_LINEAR={backend} "
                               f"selects others: unset it, {_OFF}.")
    if any(isinstance(m, PackedWeight) for m in model.modules()):
        raise UnsupportedError("batch_invariant=True runs bf16 weights; this checkpoint's linears are kept in a "
                               "compressed format (GGUF blocks), whose prefill kernel rounds differently from its "
                               f"GEMV: load a bf16 checkpoint (e.g. the cached bf16 folder of the GGUF), {_OFF}.")
    if hasattr(model, "make_state_cache"):
        raise UnsupportedError("batch_invariant=True does not cover hybrid linear-attention (KDA) models: their "
                               f"chunked recurrence sums over the chunk a step holds; {_OFF}.")


def check_stack(stack) -> None:
    """Refuse a model whose layers or LM head the fused decode stack does not run (``stack`` from
    ``CpuDecodeStack.build``, None when the model is outside it).

    Raises:
        UnsupportedError: no stack, or a stack without the LM head.
    """
    if stack is None:
        raise UnsupportedError("batch_invariant=True runs every step through the fused CPU decode stack, which does "
                               "not cover this model (it covers single-device bf16 Llama, Qwen3, Qwen3-MoE and "
                               "DeepSeek-V3 / Kimi-K2 layers on tokenfab's VNNI linears; "
                               f"engine/cpu_decode_stack.py); {_OFF}.")
    if stack.vocab_size is None:
        raise UnsupportedError("batch_invariant=True needs the LM head on tokenfab's packed linear, and this "
                               f"model's could not be packed; {_OFF}.")
