"""Packed weights without a kernel on this CPU (the ``avx2`` level) keep a float32 copy made once at load, within a
process-wide budget (quant/packed_weight.py, ``TOKENFAB_DENSE_FALLBACK_GIB``): the copy holds the format's own
dequantized values, the products equal the per-call path's, the budget is honoured and released, and a bad value
is refused by name."""
from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("gguf")

from test_gguf_linear import random_blocks  # noqa: E402
from tokenfab.errors import EngineConfigError  # noqa: E402
from tokenfab.quant import packed_weight  # noqa: E402
from tokenfab.quant.gguf_weight import GGUFWeight  # noqa: E402


def _weight(seed: int, n: int = 80, k: int = 64) -> GGUFWeight:
    return GGUFWeight.from_rows(torch.from_numpy(random_blocks("Q4_1", n, k, seed=seed)), "Q4_1", k)


@pytest.fixture
def no_kernel(monkeypatch):
    """The packed GEMV unavailable, as at the avx2 level (TOKENFAB_CPU_LINEAR=torch selects the same path)."""
    monkeypatch.setenv("TOKENFAB_CPU_LINEAR", "torch")
    monkeypatch.setattr(packed_weight, "_DENSE_BYTES", [0])


def test_copy_holds_the_dequantized_values_and_gives_the_same_products(no_kernel, monkeypatch):
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    monkeypatch.setenv(packed_weight.DENSE_FALLBACK_ENV, "0")
    per_call = _weight(3)
    per_call.prepare()
    assert per_call._dense is None
    monkeypatch.setenv(packed_weight.DENSE_FALLBACK_ENV, "1")
    dense = _weight(3)
    dense.prepare()
    assert dense._dense is not None and torch.equal(dense._dense, dense.dequantize())
    assert packed_weight._DENSE_BYTES[0] == 80 * 64 * 4
    assert torch.equal(dense.linear(x, None), per_call.linear(x, None))  # one 1,024-row chunk: the same F.linear
    assert torch.equal(dense.linear_f32(x), per_call.linear_f32(x))

    def no_dequantization(*_):
        raise AssertionError("the copy holder dequantized rows again")

    monkeypatch.setattr(dense, "dequantize_rows", no_dequantization)
    assert torch.equal(dense.linear(x, None), per_call.linear(x, None))  # the copy is what runs


def test_budget_is_honoured_and_released(no_kernel, monkeypatch):
    monkeypatch.setenv(packed_weight.DENSE_FALLBACK_ENV, str(1.5 * 80 * 64 * 4 / 2 ** 30))  # room for one copy
    a, b = _weight(1), _weight(2)
    a.prepare()
    b.prepare()
    assert a._dense is not None and b._dense is None
    del a
    gc.collect()
    assert packed_weight._DENSE_BYTES[0] == 0
    b.prepare()
    assert b._dense is not None


@pytest.mark.parametrize("value", ["-1", "lots", "nan"])
def test_bad_budget_is_refused_by_name(no_kernel, monkeypatch, value):
    monkeypatch.setenv(packed_weight.DENSE_FALLBACK_ENV, value)
    with pytest.raises(EngineConfigError, match="TOKENFAB_DENSE_FALLBACK_GIB"):
        _weight(1).prepare()


def test_engine_refuses_a_bad_budget_before_loading(monkeypatch, tiny_model):
    from tokenfab import LLM
    monkeypatch.setenv(packed_weight.DENSE_FALLBACK_ENV, "four")
    with pytest.raises(EngineConfigError, match="TOKENFAB_DENSE_FALLBACK_GIB='four'"):
        LLM(tiny_model("llama"), dtype="float32", progress=False)
