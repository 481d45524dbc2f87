"""Which CPU instruction-set path the kernels take: the machine's best, or a lower one chosen by ``TOKENFAB_CPU_ISA``.

x86-64 machines differ (Intel Xeon with AMX tiles, AMD EPYC with AVX512-BF16 but no AMX, older CPUs with AVX2 only),
and each path rounds bf16 work in its own order. So that any machine can run, and test, the path another CPU would
take, the level is a setting, capped by what this CPU has:

========== ====================================================================================================
level      what runs
========== ====================================================================================================
amx        everything below plus AMX tile products (tokenfab's packed GGUF / FP8 prefill kernels, oneDNN's brgemm)
avx512_bf16 tokenfab's AVX512-BF16 kernels (VNNI linears, packed GEMVs, bf16 decode attention, the fused decode
           stack); oneDNN capped at ``AVX512_CORE_BF16`` (no AMX)
avx2       no AVX512-BF16 dot products: bf16 linears through oneDNN capped at ``AVX2``, attention and the other
           fused kernels on their float32 paths, PyTorch's own kernels at ``ATEN_CPU_CAPABILITY=avx2``. The fused
           kernels are still this machine's build (``-march=native``); their float32 code rounds as an AVX2 build's
========== ====================================================================================================

``TOKENFAB_CPU_ISA`` is ``native`` (default: this CPU's best level) or one of the levels. The library caps
(``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``) are set by :func:`apply_library_caps` when ``tokenfab`` is imported,
before either library reads them, and never over a value the user set. ``TOKENFAB_CPU_KERNELS=0`` (no fused kernels
at all) is independent of the level.
"""
from __future__ import annotations

import os

LEVELS = ("avx2", "avx512_bf16", "amx")  # lowest first; the index is the C++ kernels' cap (csrc/cpu_isa.h)
ENV = "TOKENFAB_CPU_ISA"
_ONEDNN_CAP = {"avx2": "AVX2", "avx512_bf16": "AVX512_CORE_BF16"}
_ATEN_CAP = {"avx2": "avx2"}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def machine_level(flags: set[str] | None = None) -> str:
    """The best level this CPU has (``/proc/cpuinfo`` flags; ``avx2`` where they cannot be read).

    Args:
        flags: CPU flags to judge instead of this machine's (tests).
    """
    flags = _cpu_flags() if flags is None else flags
    if {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    return "avx2"


def selected_level(flags: set[str] | None = None) -> str:
    """The level the kernels run at: ``TOKENFAB_CPU_ISA`` (``native`` or unset: :func:`machine_level`).

    Raises:
        EngineConfigError: an unknown value, or a level this CPU does not have (the message names both fixes).
    """
    value = os.environ.get(ENV, "native").strip().lower() or "native"
    best = machine_level(flags)
    if value == "native":
        return best
    if value not in LEVELS:
        from tokenfab.errors import EngineConfigError
        raise EngineConfigError(f"{ENV}={value!r} is not a CPU path; use native or one of {', '.join(LEVELS)}.")
    if LEVELS.index(value) > LEVELS.index(best):
        from tokenfab.errors import EngineConfigError
        raise EngineConfigError(f"{ENV}={value} needs a CPU with {value.upper()}; this one's best path is {best} "
                                f"(set {ENV} to {best} or lower, or unset it).")
    return value


def level_index(level: str | None = None) -> int:
    """:data:`LEVELS` index of ``level`` (default :func:`selected_level`): the cap handed to the C++ kernels."""
    return LEVELS.index(level or selected_level())


def apply_library_caps() -> None:
    """Cap oneDNN (``ONEDNN_MAX_CPU_ISA``) and PyTorch's vectorized kernels (``ATEN_CPU_CAPABILITY``) at the
    selected level when it is below this CPU's, unless the user set them. Called on ``import tokenfab``; an invalid ``TOKENFAB_CPU_ISA`` is left
    for :func:`selected_level` to report where the kernels load."""
    try:
        level = selected_level()
    except Exception:  # reported with its fix when the kernels load (EngineConfigError)
        return
    if level == machine_level():  # this CPU's own path: nothing to cap
        return
    if level in _ONEDNN_CAP:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _ONEDNN_CAP[level])
    if level in _ATEN_CAP:
        os.environ.setdefault("ATEN_CPU_CAPABILITY", _ATEN_CAP[level])
