"""Model weights and the KV pool moved into 2 MiB transparent huge pages (CPU).

A decode step streams every weight once (~71 MB for the default DeepSeek model): with 4 KiB pages that is ~17,000
pages, each a TLB miss and a page walk, and a hardware prefetch stream that stops at every page boundary. Linux backs
memory with 2 MiB pages only where a program asks (``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` on
most distributions), and PyTorch asks only for single allocations of 2 MiB or more, and only when
``THP_MEM_ALLOC_ENABLE=1``: most of a layer's weights are smaller than that. So after loading, every storage the
model holds is copied into arenas of ~64 MiB that are ``madvise(MADV_HUGEPAGE)``'d before they are written, and
each tensor is re-pointed at its copy with ``Tensor.set_`` (views of one storage keep sharing it; nothing that holds
the tensor object, Python or C++, needs to change). llama.cpp gets the same effect by mapping its weights; vLLM's
CPU backend leaves it to the allocator. Measured in benchmarks/NOTES.md entry 48.
"""
from __future__ import annotations

import ctypes
import logging
import os

import torch

logger = logging.getLogger("tokenfab")

HUGE_PAGE = 2 << 20  # bytes
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def thp_mode() -> str | None:
    """The kernel's transparent huge page setting ('always', 'madvise' or 'never'), or None off Linux."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return None


def _madvise_huge(addr: int, length: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), ctypes.c_int(_MADV_HUGEPAGE)) == 0
    except (OSError, AttributeError):
        return False


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor a module tree holds: parameters, buffers and plain tensor attributes (packed weights kept
    outside the parameter list), including tensors in list / tuple attributes."""
    found: list[torch.Tensor] = []
    for m in module.modules():
        for v in list(m._parameters.values()) + list(m._buffers.values()) + list(vars(m).values()):
            items = v if isinstance(v, (list, tuple)) else (v,)
            found.extend(t for t in items if isinstance(t, torch.Tensor))
    return found


@torch.no_grad()
def move_to_hugepages(tensors: list, min_bytes: int = 64 << 10, chunk_bytes: int = 64 << 20) -> int:
    """Copy the CPU storages behind ``tensors`` into arenas backed by 2 MiB pages and re-point every given tensor
    at its copy (same values, shapes, strides, and aliasing between the given views of one storage).

    Storages are packed into arenas of about ``chunk_bytes`` (a larger storage gets its own), one arena at a time,
    so the extra memory at any moment is one arena, not a second copy of the model. Only the tensor objects given
    are re-pointed: another tensor object viewing a moved storage keeps the old memory alive and stops seeing
    writes, so pass every holder of a storage that is written later (the KV pool: right after it is allocated).

    Args:
        tensors: tensors (non-CPU, non-strided and None entries are skipped); storages under ``min_bytes`` stay.

    Returns:
        Bytes moved; 0, with the tensors untouched, when the kernel has transparent huge pages off, the
        ``TOKENFAB_HUGEPAGES=0`` environment variable is set, or ``madvise`` fails.
    """
    if thp_mode() not in ("always", "madvise") or os.environ.get("TOKENFAB_HUGEPAGES", "1") == "0":
        return 0
    storages: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
            continue
        s = t.untyped_storage()
        if s.nbytes() < min_bytes:
            continue
        entry = storages.setdefault(s.data_ptr(), (s, []))
        if not any(u is t for u in entry[1]):
            entry[1].append(t)
    chunks: list[tuple[list[int], list[int], int]] = []  # per arena: storage keys, their offsets, total bytes
    for key, (s, _) in storages.items():
        size = -(-s.nbytes() // 64) * 64  # 64-byte aligned, as PyTorch's allocator gives
        if not chunks or (chunks[-1][0] and chunks[-1][2] + size > chunk_bytes):
            chunks.append(([], [], 0))
        keys, offsets, total = chunks[-1]
        keys.append(key)
        offsets.append(total)
        chunks[-1] = (keys, offsets, total + size)
    moved = 0
    for keys, offsets, total in chunks:
        span = -(-total // HUGE_PAGE) * HUGE_PAGE
        arena = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)  # untouched: advised before any page fault
        start = -arena.data_ptr() % HUGE_PAGE
        if not _madvise_huge(arena.data_ptr() + start, span):
            logger.info("madvise(MADV_HUGEPAGE) failed: weights stay in 4 KiB pages")
            return moved
        new_storage = arena.untyped_storage()
        for key, off0 in zip(keys, offsets):
            s, users = storages.pop(key)  # the old storage is freed when its last user moves
            off = start + off0
            arena[off: off + s.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(s))
            for t in users:
                item = t.element_size()
                t.set_(new_storage, (off + t.storage_offset() * item) // item, t.size(), t.stride())
            moved += s.nbytes()
            del s, users
    return moved
