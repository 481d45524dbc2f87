"""A step's integer inputs to the device in one copy: the arrays packed into one host buffer (pinned on CUDA, so the
copy is asynchronous), one host-to-device copy into a fresh device tensor, and device views of it handed back.

Without it an eager GPU step sends each input (ids, positions, slots, block tables, context lengths, query indices
of each attention group, state rows) with its own synchronous copy from pageable memory. The host buffer is reused
across steps; before it is rewritten the previous copy's CUDA event is waited on (normally long complete: every step
reads its sampled ids back). The device tensor is new each step (the caching allocator's, no cudaMalloc), so no
tensor a previous step handed out is overwritten. On the CPU the arrays are wrapped as they are (no copy).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class InputStager:
    """Stages int64 arrays for one device (decode graphs keep their own static buffers: cuda_graph_runner.py).

    Args:
        device: where the model runs.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._host: torch.Tensor | None = None
        self._copied = None  # CUDA event recorded after the last copy out of the host buffer
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
        if self._copied is not None:
            self._copied.synchronize()
        if self._host is None or self._host.numel() < total:
            self._host = torch.empty(max(total, 2 * (0 if self._host is None else self._host.numel()), 4096),
                                     dtype=torch.int64, pin_memory=True)
        host = self._host.numpy()
        off = 0
        for a in arrs:
            host[off:off + a.size] = a.reshape(-1)
            off += a.size
        dev = torch.empty(total, dtype=torch.int64, device=self.device)
        dev.copy_(self._host[:total], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        self.copies += 1
        out, off = [], 0
        for a in arrs:
            out.append(dev[off:off + a.size].view(a.shape))
            off += a.size
        return out
