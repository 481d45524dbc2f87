"""A step's integer inputs to the device in one copy: the arrays packed into one host buffer (pinned on CUDA, so the
copy is asynchronous), one host-to-device copy into a fresh device tensor, and device views of it handed back.

Without it an eager GPU step sends each input (ids, positions, slots, block tables, context lengths, query indices
of each attention group, state rows) with its own synchronous copy from pageable memory. The host buffer is reused
across steps; before it is rewritten the previous copy's CUDA event is waited on (normally long complete: every step
reads its sampled ids back). The device tensor is new each step (the caching allocator's, no cudaMalloc), so no
tensor a previous step handed out is overwritten. On the CPU the arrays are wrapped as they are (no copy). The
decode graphs' static inputs use the same host buffer (:class:`PinnedHostBuffer`) to feed their fixed device buffer.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class PinnedHostBuffer:
    """An int64 host buffer (pinned on CUDA) that sends its first n values to the device without blocking, and
    is rewritten only after its previous send has landed (a CUDA event; normally long complete: every step reads its
    sampled ids back). Shared by :class:`InputStager` and the decode graphs' static inputs (cuda_graph_runner.py).

    Args:
        n: int64 values it holds; device: the device its sends go to.
    """

    def __init__(self, n: int, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.tensor = torch.zeros(n, dtype=torch.int64, pin_memory=self.cuda)
        self.array = self.tensor.numpy()  # the same memory, filled with numpy
        self._sent = None

    def writable(self) -> np.ndarray:
        """:attr:`array`, once the previous :meth:`send` no longer reads it."""
        if self._sent is not None:
            self._sent.synchronize()
        return self.array

    def send(self, dst: torch.Tensor, n: int) -> None:
        """dst[:n] = the first n values (dst: a 1-D int64 device tensor); non-blocking on CUDA."""
        if self.cuda:
            dst[:n].copy_(self.tensor[:n], non_blocking=True)
            self._sent = torch.cuda.Event()
            self._sent.record()
        else:
            dst[:n].copy_(self.tensor[:n])


class InputStager:
    """Stages int64 arrays for one device (decode graphs keep their own static buffers: cuda_graph_runner.py).

    Args:
        device: where the model runs.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._host: PinnedHostBuffer | None = None
        self.copies = 0  # host-to-device copies made (tests)

    def stage(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Device int64 tensors holding ``arrays`` (any shapes; values cast to int64), in order.

        On the CPU each is a tensor over the array's memory (int64 arrays are not copied). On CUDA: one
        non-blocking copy of all of them; the results are views of one new device tensor.
        """
        arrs = [np.ascontiguousarray(a, dtype=np.int64) for a in arrays]
        if self.device.type != "cuda":
            return [torch.from_numpy(a) for a in arrs]
        total = sum(a.size for a in arrs)
        if self._host is None or self._host.array.size < total:  # grown (the old one's last send waited on)
            if self._host is not None:
                self._host.writable()
            self._host = PinnedHostBuffer(max(total, 2 * (0 if self._host is None else self._host.array.size), 4096),
                                          self.device)
        host = self._host.writable()
        off = 0
        for a in arrs:
            host[off:off + a.size] = a.reshape(-1)
            off += a.size
        dev = torch.empty(total, dtype=torch.int64, device=self.device)
        self._host.send(dev, total)
        self.copies += 1
        out, off = [], 0
        for a in arrs:
            out.append(dev[off:off + a.size].view(a.shape))
            off += a.size
        return out


def to_device(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """``t`` (a small host tensor: indices, per-row settings, uniforms) on ``device`` without waiting for the
    device (CUDA stages a pageable source and returns; see the CUDA runtime's "API synchronization behavior"):
    ``t`` itself where it already is, None for None. The samplers' and the verifier's inputs take this path to
    logits that stay on the GPU."""
    return None if t is None else t.to(device, non_blocking=True)
