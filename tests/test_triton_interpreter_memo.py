"""The two memoizations and the dropped overflow check tests/conftest.py installs into Triton's interpreter
(tokenfab/testing/triton_interpreter.py) change no result: the builtin names it patches are those the interpreter's
own walk finds, its numpy dtypes are the interpreter's own, and kernels give bit-identical outputs with the
interpreter's original functions and options put back."""
from __future__ import annotations

import inspect

import pytest
import torch

from tokenfab.kernels.gpu import support as triton_support

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


def test_memoized_lookups_equal_the_interpreters_own(interpret):
    import triton.language as tl
    import triton.runtime.interpreter as ti

    from tokenfab.testing import triton_interpreter

    assert triton_interpreter.speed_up()  # installed by conftest; a second call is a no-op
    assert ti._get_np_dtype is not triton_interpreter.ORIGINALS["_get_np_dtype"]
    orig = triton_interpreter.ORIGINALS["_get_np_dtype"]
    types = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.int32, tl.uint32, tl.int64, tl.float16, tl.bfloat16,
             tl.float32, tl.float64, tl.float8e4nv, tl.float8e5, tl.pointer_type(tl.float32),
             tl.block_type(tl.bfloat16, [4, 8]), tl.block_type(tl.pointer_type(tl.int8), [16])]
    for _ in range(2):  # the first call fills the cache, the second reads it
        assert [ti._get_np_dtype(t) for t in types] == [orig(t) for t in types]
    # The names were listed before any kernel ran. The interpreter's walk lists the members that are builtins now
    # (a @triton.jit helper's call inside a kernel patches the language without undoing it, so after earlier
    # kernels fewer remain): each must be among the listed names, which the memo patches when still builtins.
    for pkg in (tl, tl.core, tl.math, tl.tensor):
        listed = set(triton_interpreter.BUILTIN_NAMES[id(pkg)])
        assert {n for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)} <= listed and listed
    # the overflow check is off only while debug is (device_assert drops it then)
    opts = ti.interpreter_builder.options
    assert not opts.sanitize_overflow and not opts.debug and triton_interpreter.ORIGINALS["options"].sanitize_overflow


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_bit_identical_with_the_interpreters_original_functions(interpret, monkeypatch, dtype):
    """RMSNorm (a kernel calling a @triton.jit helper, whose call patches the language again inside the launch)
    and SiTU-GLU, memoized and with the interpreter's own functions put back: identical bits."""
    import triton.runtime.interpreter as ti

    from tokenfab.kernels.gpu.norm_activation import rms_norm, situ_and_mul
    from tokenfab.testing import triton_interpreter

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 100, generator=g).to(dtype)
    w = torch.randn(100, generator=g).to(dtype)
    gu = torch.randn(3, 2 * 70, generator=g).to(dtype)

    def run():
        return rms_norm(x, w, 1e-6), situ_and_mul(gu, 4.0, 2.0)

    fast = run()
    for name, fn in triton_interpreter.ORIGINALS.items():
        monkeypatch.setattr(ti.interpreter_builder if name == "options" else ti, name, fn)
    assert ti.interpreter_builder.options.sanitize_overflow  # the interpreter's own: the check computed again
    slow = run()
    for a, b in zip(fast, slow):
        assert a.dtype == dtype and torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                                b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
