"""Weights and the KV pool moved into 2 MiB pages (tokenfab/engine/hugepages.py): same values, same aliasing, writes
seen by every holder, and the engine's tokens unchanged."""
from __future__ import annotations

import pytest
import torch

from tokenfab.engine.hugepages import HUGE_PAGE, module_tensors, move_to_hugepages, thp_mode

needs_thp = pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off here")


def _huge_kib_of(t: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mapping that holds t's first byte, from /proc/self/smaps."""
    addr, cur = t.data_ptr(), None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                cur = lo <= addr < hi
            elif cur and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


@needs_thp
def test_move_keeps_values_views_and_writes():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3000, 700, generator=g)  # 8.4 MB: its own arena
    view = a[100:200, 5:50]                    # a strided view of a's storage
    b = torch.randn(200, 300, generator=g).bfloat16()  # packed with others into one arena
    small = torch.randn(10, generator=g)       # under min_bytes: stays
    ref = [x.clone() for x in (a, view, b, small)]
    small_ptr = small.data_ptr()
    expected = a.untyped_storage().nbytes() + b.untyped_storage().nbytes()
    moved = move_to_hugepages([a, view, b, small, None], chunk_bytes=1 << 20)
    assert moved == expected
    for x, r in zip((a, view, b, small), ref):
        assert torch.equal(x, r)
    assert small.data_ptr() == small_ptr
    assert view.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()  # still one storage
    assert view.stride() == (700, 1) and view.data_ptr() == a.data_ptr() + (100 * 700 + 5) * 4
    a[150, 10] = 123.0  # a write through one holder is seen by the other
    assert view[50, 5].item() == 123.0
    assert a.data_ptr() % 64 == 0 and b.data_ptr() % 64 == 0
    # a's arena starts on a 2 MiB boundary and was advised before it was written: huge pages back it
    assert a.data_ptr() % HUGE_PAGE == 0
    if _huge_kib_of(a) == 0:  # THP in madvise mode may hand out no huge page under memory pressure
        pytest.skip("the kernel backed the advised arena with no huge page (AnonHugePages 0 kB) on this run")


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("TOKENFAB_HUGEPAGES", "0")
    a = torch.randn(100000)
    p = a.data_ptr()
    assert move_to_hugepages([a]) == 0 and a.data_ptr() == p


def test_module_tensors_finds_parameters_buffers_and_packed_attributes():
    m = torch.nn.Linear(4, 4)
    m.register_buffer("buf", torch.zeros(3))
    m.packed = torch.ones(2)
    m.per_expert = [torch.ones(1), torch.ones(1)]
    found = module_tensors(m)
    for t in (m.weight, m.bias, m.buf, m.packed, *m.per_expert):
        assert any(t is u for u in found)


@needs_thp
def test_engine_tokens_and_cache_unchanged(tiny_model, monkeypatch):
    """Greedy tokens and logprobs of the engine with its weights and KV pool moved equal those without the move
    (same arithmetic, other pages), and the move really happened."""
    from tokenfab import LLM, SamplingParams
    path = tiny_model("deepseek_v3")
    sp = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1)
    prompts = [[5, 9, 77, 31, 2, 8, 100], [41, 42, 43]]
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("TOKENFAB_HUGEPAGES", flag)
        llm = LLM(path, max_model_len=64, max_num_seqs=4, progress=False)
        assert (llm.llm_engine.runner.hugepage_bytes > 0) == (flag == "1")
        outs[flag] = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for a, b in zip(outs["1"], outs["0"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
