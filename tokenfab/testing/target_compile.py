"""Compile the Triton kernels that a CPU test launched in Triton's interpreter for real GPU targets (NVIDIA sm_90,
AMD gfx942), with no GPU: the interpreter runs kernel bodies as Python and accepts code the compiler refuses (a
variable re-bound to another shape inside a branch, a scalar in a mask, a dtype the backend lacks), so a kernel
checked only there can still fail its first launch on a GPU.

:class:`LaunchRecorder` records every interpreted launch as (module, kernel name, argument types, constexpr values,
launch options); :func:`compile_for_targets` compiles each distinct one through Triton's own compiler (frontend,
the backend's passes, and for NVIDIA ptxas) in a fresh Python process where ``TRITON_INTERPRET`` is unset, so the
kernels are ordinary ``JITFunction`` objects there. Pointer alignment is not specialized (the compiler then assumes
less, never more, than a real launch would).
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys

import torch

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
          torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
          torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _arg_type(v) -> str:
    if isinstance(v, torch.Tensor):
        return "*" + _TYPES[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"no Triton type for a {type(v).__name__} argument")


class LaunchRecorder:
    """Context manager: while active, every launch of an interpreted Triton kernel is recorded in :attr:`launches`
    (distinct ones only) as a JSON-able dict {module, name, signature, constexprs, options}."""

    def __init__(self):
        self.launches: list[dict] = []
        self._seen: set[str] = set()
        self._stack = contextlib.ExitStack()

    def _record(self, fn_self, args, kwargs) -> None:
        fn = fn_self.fn
        params = inspect.signature(fn).parameters
        names = list(params)
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in params})
        sig, const = {}, {}
        for name in names:
            if name not in bound:  # a default
                continue
            v = bound[name]
            ann = params[name].annotation
            if "constexpr" in str(ann):
                sig[name] = "constexpr"
                const[name] = v.value if hasattr(v, "value") else v
            elif v is None:
                sig[name] = "constexpr"
                const[name] = None
            else:
                sig[name] = _arg_type(v)
        opts = {k: kwargs[k] for k in _OPTIONS if kwargs.get(k) is not None}
        entry = {"module": fn.__module__, "name": fn.__name__, "signature": sig, "constexprs": const,
                 "options": opts}
        key = json.dumps(entry, sort_keys=True, default=str)
        if key not in self._seen:
            self._seen.add(key)
            self.launches.append(entry)

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction
        recorder = self
        orig = InterpretedFunction.run

        def run(fn_self, *args, **kwargs):
            if not kwargs.get("warmup", False):
                recorder._record(fn_self, args, kwargs)
            return orig(fn_self, *args, **kwargs)

        InterpretedFunction.run = run
        self._stack.callback(setattr, InterpretedFunction, "run", orig)
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)


# constexprs the kernels set True only under Triton's interpreter, which has no bfloat16 (float32 dots on 16-bit
# data): a GPU launch of the same 16-bit tensors has them False
INTERPRETER_FLAGS = ("DOT_F32", "IEEE")


def gpu_variants(launches: list[dict]) -> list[dict]:
    """``launches`` plus, for each launch over 16-bit tensors with an :data:`INTERPRETER_FLAGS` constexpr True, the
    launch a GPU makes instead (those flags False), so the 16-bit code paths the interpreter never runs compile."""
    out = list(launches)
    seen = {json.dumps(l, sort_keys=True, default=str) for l in launches}
    for l in launches:
        half = any(t in ("*bf16", "*fp16") for t in l["signature"].values())
        flags = [f for f in INTERPRETER_FLAGS if l["constexprs"].get(f) is True]
        if half and flags:
            v = dict(l, constexprs={**l["constexprs"], **{f: False for f in flags}})
            key = json.dumps(v, sort_keys=True, default=str)
            if key not in seen:
                seen.add(key)
                out.append(v)
    return out


_CHILD = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
targets = {"sm90": GPUTarget("cuda", 90, 32), "gfx942": GPUTarget("hip", "gfx942", 64)}
jobs = json.load(sys.stdin)
failures = []
for job in jobs:
    fn = getattr(importlib.import_module(job["module"]), job["name"])
    while not isinstance(fn, triton.runtime.jit.JITFunction):  # autotune / heuristics wrappers
        fn = fn.fn
    for t in job["targets"]:
        try:
            triton.compile(ASTSource(fn=fn, signature=job["signature"], constexprs=job["constexprs"]),
                           target=targets[t], options=job["options"])
        except Exception as e:
            failures.append({"kernel": job["module"] + "." + job["name"], "target": t,
                             "signature": job["signature"], "constexprs": job["constexprs"],
                             "error": (str(e).strip().splitlines() or [""])[-1][:400]})
json.dump(failures, sys.stdout)
"""


def compile_for_targets(launches: list[dict], targets: tuple[str, ...] = ("sm90", "gfx942"),
                        timeout: float = 900.0) -> list[dict]:
    """Compile each recorded launch for each of ``targets`` ("sm90", "gfx942") in a child process without
    ``TRITON_INTERPRET``. Returns the failures, each {kernel, target, signature, constexprs, error}; [] when every
    one compiled.

    Raises:
        RuntimeError: the child process itself failed (its stderr's tail in the message).
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    jobs = [dict(l, targets=list(targets)) for l in launches]
    proc = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(jobs), capture_output=True, text=True,
                          env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"target compile process failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout)
