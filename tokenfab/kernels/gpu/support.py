"""When the Triton kernels (kernels/gpu/decode_attention.py, kernels/gpu/moe.py) run.

On CUDA/ROCm tensors they replace the eager PyTorch paths when the ``triton`` package imports. On CPU they never
run in serving; tests run them through Triton's interpreter (``TRITON_INTERPRET=1`` set before ``triton`` is
imported, plus ``TOKENFAB_TRITON=interpret``) against the PyTorch paths, which stay the reference and the fallback.
``TOKENFAB_TRITON=0`` turns them off everywhere. ``TOKENFAB_TRITON=interpret-gpu-path`` (tests only, with
``TRITON_INTERPRET=1``) goes further: the seam treats CPU tensors as a GPU's for every op family, so a whole model
runs the GPU code path in the interpreter (:func:`gpu_path`; tests/test_gpu_kernel_count.py counts its launches).
:func:`launch_linear` is the row scaffolding the Triton linears (kernels/gpu/fp8_linear.py, kernels/gpu/gguf_linear.py)
share, :func:`autotune_configs` and :func:`quick_bench` their autotuning.
"""
from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=1)
def triton_importable() -> bool:
    """True when ``import triton`` works (the package ships with CUDA builds of torch)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install without a driver
        return False
    return True


def interpreting() -> bool:
    """True when Triton kernels are asked to run on CPU tensors in Triton's interpreter (tests only)."""
    return (os.environ.get("TOKENFAB_TRITON") in ("interpret", "interpret-gpu-path")
            and os.environ.get("TRITON_INTERPRET") == "1")


def gpu_path(x: torch.Tensor) -> bool:
    """Whether the layers should take the GPU code path for ``x``: a CUDA / ROCm tensor with Triton importable
    (``TOKENFAB_TRITON`` not 0), or, in tests only, a CPU tensor under ``TOKENFAB_TRITON=interpret-gpu-path`` with
    ``TRITON_INTERPRET=1`` (the same choices a GPU makes, every Triton kernel run by the interpreter). Plain
    ``interpret`` keeps CPU tensors on the CPU kernels except where a caller asks :func:`applies` itself."""
    if x.device.type == "cpu":
        return os.environ.get("TOKENFAB_TRITON") == "interpret-gpu-path" and applies(x)
    return applies(x)


def check_env() -> None:
    """Raise EngineConfigError for a ``TOKENFAB_TRITON`` value other than 1 (default), 0 or interpret, or a
    ``TOKENFAB_TRITON_AUTOTUNE`` other than 0 / 1 (checked once when an engine starts, so a typo is not silently
    read as "on")."""
    mode = os.environ.get("TOKENFAB_TRITON", "1")
    if mode not in ("1", "0", "interpret", "interpret-gpu-path"):
        from tokenfab.errors import EngineConfigError
        raise EngineConfigError(f"TOKENFAB_TRITON='{mode}' is not understood; use 1 (Triton kernels on GPUs, the "
                                "default), 0 (off) or interpret / interpret-gpu-path (tests: Triton's interpreter "
                                "on CPU).")
    autotune_enabled()  # raises for a TOKENFAB_TRITON_AUTOTUNE value other than 0 / 1


def applies(x: torch.Tensor) -> bool:
    """Whether the Triton kernels should handle tensors on ``x``'s device."""
    mode = os.environ.get("TOKENFAB_TRITON", "1")
    if mode == "0":
        return False
    if x.device.type == "cuda":  # ROCm builds of torch report "cuda" too
        return triton_importable()
    return x.device.type == "cpu" and interpreting() and triton_importable()


def launch_linear(x: torch.Tensor, out_features: int, launch, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The row scaffolding of the Triton linears: x [..., K] flattened to contiguous rows x2 [M, K], an output
    y [M, out_features] in ``out_dtype`` (default x's dtype; float32 for logits) on x's device,
    ``launch(x2, y, block_m)`` filling y (not called when M == 0;
    ``block_m``: 16 rows up to M = 16, 32 up to 64, else 64), and y returned as [..., out_features]."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    M = x2.shape[0]
    y = torch.empty(M, out_features, dtype=out_dtype or x.dtype, device=x.device)
    if M:
        launch(x2, y, 16 if M <= 16 else 32 if M <= 64 else 64)
    return y.reshape(*lead, out_features)


def autotune_enabled() -> bool:
    """Whether the Triton kernels tune their tiles on a GPU (``triton.autotune`` at each new shape's first call):
    only with ``TOKENFAB_TRITON_AUTOTUNE=1``, read when a kernel module is imported. By default (and always in
    Triton's interpreter) each kernel runs its first config for the call (the fused MoE's: the first that fills the
    SMs, ``moe_gemm.untuned_config``), so start-up compiles one config per
    shape instead of benchmarking several (dozens of shapes: minutes on a real model, which the GPU check and a
    server's start-up cannot afford); ``benchmarks/gpu_kernels.py`` turns tuning on for the kernel table.

    Raises:
        EngineConfigError: a value other than 0 or 1.
    """
    mode = os.environ.get("TOKENFAB_TRITON_AUTOTUNE", "0")
    if mode not in ("0", "1"):
        from tokenfab.errors import EngineConfigError
        raise EngineConfigError(f"TOKENFAB_TRITON_AUTOTUNE='{mode}' is not understood; use 1 (tune each kernel's "
                                "tiles at its first call on a GPU) or 0 (the default: each kernel's first config).")
    return mode == "1" and os.environ.get("TRITON_INTERPRET") != "1"


def autotune_configs(configs: list) -> list:
    """The ``triton.autotune`` config space of a kernel: all of ``configs`` when tuning (:func:`autotune_enabled`),
    else only the first (in Triton's interpreter timing means nothing; one config skips the benchmarking)."""
    return list(configs) if autotune_enabled() else configs[:1]


def quick_bench(kernel_call, quantiles):
    """``triton.autotune``'s ``do_bench`` for the linears: 5 ms of warm-up and 20 ms of timed calls per config
    (Triton's default is 25 / 100 ms), so tuning a new shape costs well under a second per config."""
    import triton.testing
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)
