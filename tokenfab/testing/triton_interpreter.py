"""Two memoizations and one dead computation removed from Triton's interpreter, which runs every GPU kernel of the
test suite on CPU tensors.

The interpreter re-patches ``triton.language`` for every kernel launch and for every call of a ``@triton.jit``
helper inside a kernel (``triton/runtime/interpreter.py``: ``_patch_lang`` -> ``_patch_builtin``), and each patch
walks the modules with ``inspect.getmembers`` to find their builtins; it also rebuilds a dict of numpy dtypes on
every ``_get_np_dtype`` call. Both are pure lookups over state that does not change, so :func:`speed_up` makes them
lookups once:

- ``_patch_builtin``: the names of each package's builtins are listed once, from the unpatched modules; each patch
  then takes ``getattr`` of those names and, as before, patches those still builtins (a member already patched by an
  enclosing launch is a wrapper, not a builtin, and is skipped as the original skips it);
- ``_get_np_dtype``: memoized per Triton type (its value depends only on the type's equality).

And every integer add / sub / mul of 32 bits or fewer in a kernel also computed its overflow check
(``triton/language/semantic.py``: ``binary_op_sanitize_overflow_impl``, the operands cast to int64, the op again, two
compares and an and: six more interpreted ops), then handed it to ``device_assert``, which drops it unless the
options' ``debug`` is set, and the interpreter's builder never sets it. ``sanitize_overflow`` is turned off in the
interpreter's options while ``debug`` is off, so that check is not computed only to be dropped (with ``debug`` on,
nothing is changed).

What each kernel computes is unchanged. The memoizations made the interpreter-heavy tests about a quarter faster
(measured on one engine test, 20.5 s -> 14.9 s); dropping the check made the KDA engines' tests
(tests/test_kda_gpu_path.py, one process) 112 s -> 70 s. Applied only where the interpreter's functions have the
signatures these wrappers were written against (Triton 3.x); elsewhere nothing is changed.
"""
from __future__ import annotations

import dataclasses
import inspect
import os

_APPLIED = False
ORIGINALS: dict[str, object] = {}  # the interpreter's own functions, kept for tests/test_triton_interpreter_memo.py
BUILTIN_NAMES: dict[int, list[str]] = {}  # id(package) -> the names of its builtins, listed unpatched


def speed_up() -> bool:
    """Install the two memoizations into Triton's interpreter module and drop its unused overflow check, once per
    process.

    Must run after ``TRITON_INTERPRET=1`` is set and before any kernel runs (tests/conftest.py). Returns True when
    installed (or already installed), False where triton is not importable, the interpreter is off, or its
    internals differ from those this was written against (then nothing is changed). Raises nothing.
    """
    global _APPLIED
    if _APPLIED:
        return True
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.language as tl
        import triton.runtime.interpreter as ti
    except ImportError:
        return False
    patch_attr, patch_builtin, np_dtype = (getattr(ti, n, None) for n in ("_patch_attr", "_patch_builtin",
                                                                         "_get_np_dtype"))
    is_builtin = getattr(tl.core, "is_builtin", None)
    if (patch_attr is None or is_builtin is None or np_dtype is None or patch_builtin is None
            or patch_builtin.__code__.co_varnames[:3] != ("pkg", "builder", "scope")):
        return False
    names = BUILTIN_NAMES

    def builtin_names(pkg) -> list[str]:
        key = id(pkg)
        if key not in names:
            names[key] = [n for n, m in inspect.getmembers(pkg) if is_builtin(m)]
        return names[key]

    packages = [tl, tl.core, tl.math, tl.tensor, tl.core.tensor]
    if hasattr(tl.core, "tensor_descriptor_base"):
        packages.append(tl.core.tensor_descriptor_base)
    for pkg in packages:  # listed now, while nothing is patched
        builtin_names(pkg)

    def fast_patch_builtin(pkg, builder, scope):
        for name in builtin_names(pkg):
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    cache: dict = {}

    def fast_np_dtype(tt_dtype):
        try:
            return cache[tt_dtype]
        except KeyError:
            out = cache[tt_dtype] = np_dtype(tt_dtype)
            return out
        except TypeError:  # an unhashable type: the original lookup
            return np_dtype(tt_dtype)

    ORIGINALS.update(_patch_builtin=patch_builtin, _get_np_dtype=np_dtype)
    ti._patch_builtin = fast_patch_builtin
    ti._get_np_dtype = fast_np_dtype
    builder = getattr(ti, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and getattr(options, "sanitize_overflow", False) and not options.debug:
        ORIGINALS["options"] = options
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
    _APPLIED = True
    return True
