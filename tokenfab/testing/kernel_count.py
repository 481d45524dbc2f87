"""Count the device kernels a forward would launch on a GPU, from a run of the GPU code path on CPU (tests).

The run: CPU tensors under ``TRITON_INTERPRET=1`` and ``TOKENFAB_TRITON=interpret-gpu-path`` (the seam then takes
every GPU choice, kernels/gpu/support.py::gpu_path), the C++ CPU kernels absent as on a GPU machine, Triton kernels
executed by Triton's interpreter. Counting rule (one entry per launch a GPU would see):

- every Triton kernel launch counts 1, under the kernel's name (``triton:<name>``); the ATen ops the interpreter
  itself runs to move arguments in and out of numpy are not counted (they do not exist on a GPU);
- every ATen op that reaches the dispatcher counts 1 (``aten:<op>``), except (a) ops whose schema lets their result
  alias an input (view, reshape, as_strided, t, transpose, slice, select, split, unsqueeze, expand, detach, alias,
  ``to``, ``contiguous``, ...) when, in this call, every result does share an input's storage (a view or a no-op:
  nothing launched); the same op counts when it made new memory (a reshape that copied, a ``to`` that cast),
  (b) pure allocations without a fill (empty, empty_strided, empty_like, new_empty, new_empty_strided, resize_,
  set_), and (c) ``_unsafe_view`` / ``_reshape_alias`` (views by construction). In-place and ``out=`` ops always
  count, and so do ``_to_copy``, ``copy_``, ``fill_`` / ``zeros`` / ``full``, ``clone``, ``index_copy_``, ``cat``
  ... Under ``torch.inference_mode`` composite ops such as ``linear`` reach the dispatcher whole and count 1 (one
  GEMM on a GPU, bias fused);
- a host sync counts 1 and is also listed in ``syncs``: ``.item()`` / ``int()`` / ``bool()`` of a tensor
  (``aten._local_scalar_dense``, or ``aten.item`` under inference mode), and, caught before dispatch since CPU tensors never dispatch them,
  ``.tolist()``, ``.numpy()``, ``.cpu()`` and ``.to(<cpu device>)`` (on a GPU each is a device-to-host copy).

Usage::

    with KernelCounter() as kc:
        with kc.scope("layer0"):
            ...
    kc.counts["layer0"]  # Counter of names

:func:`decode_step_syncs` lists the host syncs of an engine's first decode-only forward (what a CUDA graph
captures: a sync there fails the capture on a GPU).
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
NO_KERNEL = {
    _aten._unsafe_view.default, _aten._reshape_alias.default,
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
    _aten.new_empty.default, _aten.new_empty_strided.default, _aten.resize_.default,
    _aten.set_.source_Storage_storage_offset, _aten.set_.source_Tensor, _aten.lift_fresh.default,
}


def _storages(tree) -> set[int]:
    from torch.utils._pytree import tree_leaves
    return {t.untyped_storage().data_ptr() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}


def may_alias(func) -> bool:
    """Whether ``func``'s schema lets a result alias an input without writing it (views, reshape, to, ...)."""
    schema = func._schema
    return not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)


def launches_kernel(func, args=(), kwargs=None, out=None) -> bool:
    """Whether this call of the ATen overload ``func`` launches a device kernel under the rule above (``out``: its
    result, needed for the ops of :func:`may_alias`)."""
    if func in NO_KERNEL:
        return False
    if may_alias(func):
        return not _storages(out) <= _storages((args, kwargs or {}))
    return True


class _Mode(TorchDispatchMode):
    def __init__(self, counter: "KernelCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c = self.counter
        out = func(*args, **(kwargs or {}))
        if c.depth == 0 and c.scope_name is not None and launches_kernel(func, args, kwargs, out):
            name = f"aten:{func.overloadpacket.__name__}"
            c.counts.setdefault(c.scope_name, Counter())[name] += 1
            if func in (_aten._local_scalar_dense.default, _aten.item.default):
                c.syncs.append((c.scope_name, name))
        return out


_HOST_READS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy", torch.Tensor.cpu: "cpu"}


def _to_host(args, kwargs) -> bool:
    """Whether a ``Tensor.to`` call names the CPU as its device."""
    for a in list(args[1:]) + [kwargs.get("device")]:
        if (isinstance(a, str) and a.startswith("cpu")) or (isinstance(a, torch.device) and a.type == "cpu"):
            return True
    return False


class _HostReads(TorchFunctionMode):
    def __init__(self, counter: "KernelCounter"):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.counter
        name = _HOST_READS.get(func) or ("to(cpu)" if func is torch.Tensor.to and _to_host(args, kwargs) else None)
        if name is not None and c.depth == 0 and c.scope_name is not None:
            c.counts.setdefault(c.scope_name, Counter())[f"host:{name}"] += 1
            c.syncs.append((c.scope_name, f"host:{name}"))
        return func(*args, **kwargs)


class KernelCounter:
    """Counts kernels per named scope (see the module docstring). ``counts[scope]`` is a Counter of kernel names;
    ops outside any scope are not counted."""

    def __init__(self):
        self.counts: dict[str, Counter] = {}
        self.syncs: list[tuple[str, str]] = []
        self.scope_name: str | None = None
        self.depth = 0  # > 0 inside a Triton launch (the interpreter's own tensor traffic)
        self._stack = contextlib.ExitStack()

    @contextlib.contextmanager
    def scope(self, name: str):
        prev, self.scope_name = self.scope_name, name
        try:
            yield
        finally:
            self.scope_name = prev

    def total(self, scope: str) -> int:
        return sum(self.counts.get(scope, Counter()).values())

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction
        counter = self
        orig = InterpretedFunction.run

        def run(fn_self, *args, **kwargs):
            if counter.scope_name is not None and not kwargs.get("warmup", False) and counter.depth == 0:
                name = getattr(getattr(fn_self, "fn", None), "__name__", "kernel")
                counter.counts.setdefault(counter.scope_name, Counter())[f"triton:{name}"] += 1
            counter.depth += 1
            try:
                return orig(fn_self, *args, **kwargs)
            finally:
                counter.depth -= 1

        self._stack.enter_context(_patched(InterpretedFunction, "run", run))
        self._stack.enter_context(_Mode(self))
        self._stack.enter_context(_HostReads(self))
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)


@contextlib.contextmanager
def _patched(obj, attr, value):
    orig = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, orig)


def breakdown(c: Counter) -> str:
    """'name x n' lines, most frequent first."""
    return "\n".join(f"  {n:>3} x {name}" for name, n in c.most_common())


@contextlib.contextmanager
def decode_step_syncs(llm, out: list):
    """While active, ``llm``'s first decode-only model forward (what a CUDA graph captures) is counted
    (:class:`KernelCounter`'s rule) and ``{"syncs": [...], "launches": n}`` appended to ``out``: after a run that
    decoded, ``out[0]["syncs"] == []`` with ``launches > 0`` means a counted step without a host read. ``llm``: a
    :class:`tokenfab.LLM` on one process."""
    model = llm.llm_engine.runner.model
    kc, scopes = KernelCounter(), []

    def on(_mod, args):
        if not out and not scopes and args[3].prefill is None and args[3].decode is not None:
            kc.__enter__()
            scopes.append(kc.scope("step"))
            scopes[0].__enter__()

    def off(_mod, _args, _out):
        if scopes and not out:
            scopes[0].__exit__(None, None, None)
            kc.__exit__(None, None, None)
            out.append({"syncs": list(kc.syncs), "launches": kc.total("step")})
    hooks = [model.register_forward_pre_hook(on), model.register_forward_hook(off)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
