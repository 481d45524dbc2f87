"""engine/input_staging.py on the CPU: every array comes back as int64 with its shape and values, int64 arrays
wrapped without a copy (the CUDA path packs them into one pinned buffer and one copy; it runs in the GPU checks)."""
from __future__ import annotations

import numpy as np
import torch

from tokenfab.engine.input_staging import InputStager


def test_stage_keeps_values_shapes_and_order():
    st = InputStager(torch.device("cpu"))
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    b = np.array([True, False, True])
    c = np.array([7, -1], dtype=np.int32)
    d = np.zeros((0,), dtype=np.int64)
    e = np.arange(12, dtype=np.int64).reshape(3, 4)[:, :2]  # a strided slice (block-table columns)
    out = st.stage([a, b, c, d, e])
    assert [tuple(t.shape) for t in out] == [(2, 3), (3,), (2,), (0,), (3, 2)]
    assert all(t.dtype == torch.int64 for t in out)
    assert out[0].tolist() == a.tolist() and out[1].tolist() == [1, 0, 1] and out[2].tolist() == [7, -1]
    assert out[4].tolist() == [[0, 1], [4, 5], [8, 9]]
    assert np.shares_memory(out[0].numpy(), a)  # int64 and contiguous: wrapped, not copied
    assert st.copies == 0


def test_pinned_host_buffer_sends_its_first_n_values():
    from tokenfab.engine.input_staging import PinnedHostBuffer
    buf = PinnedHostBuffer(6, torch.device("cpu"))
    dst = torch.full((8,), -1, dtype=torch.int64)
    buf.writable()[:] = [3, 1, 4, 1, 5, 9]
    buf.send(dst, 4)
    assert dst.tolist() == [3, 1, 4, 1, -1, -1, -1, -1]  # only the first 4, nothing past them
