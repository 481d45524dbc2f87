"""Building and loading tokenfab's fused CPU kernels (the extension behind :mod:`tokenfab.kernels.cpu.ops`).

``torch.utils.cpp_extension.load`` compiles every ``.cpp`` in csrc/ once per checkout, CPU kind and torch version
into ``~/.cache/tokenfab/kernels/<torch version>-<cpu>-<digest of the checkout path and sources>`` (override with
``TOKENFAB_KERNEL_CACHE``), under an flock so concurrent processes build once. ``TOKENFAB_CPU_KERNELS=0`` disables
the kernels; a failed build is recorded beside the build and not retried until the compiler changes, and
:func:`load` then returns None (reason in :func:`load_error`) so every caller keeps its PyTorch path. Each source
change or upgrade makes a new folder (about 7 MB): after a fresh build the cache keeps the ``KEEP_BUILDS`` most
recently used and removes older ones (:func:`prune`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import shutil
import threading

import torch

log = logging.getLogger(__name__)
_lock = threading.Lock()
_module = None
_tried = False
_error: str | None = None
KEEP_BUILDS = 6  # build folders the cache keeps after a fresh build, the most recently used (prune)
_BUILD_NAME = re.compile(r"^torch.+-[0-9a-f]{10}-[0-9a-f]{10}$")  # _build_dir's names: nothing else is removed


def _cpu_tag() -> str:
    """A short id of this CPU's model and flags: the build uses -march=native, so it is cached per CPU kind."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [l for l in f if l.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return hashlib.sha1("".join(lines).encode()).hexdigest()[:10]


def _build_dir() -> str:
    root = os.environ.get("TOKENFAB_KERNEL_CACHE", os.path.expanduser("~/.cache/tokenfab/kernels"))
    h = hashlib.sha1(os.path.dirname(os.path.abspath(__file__)).encode())  # one folder per checkout: ninja's
    for src in _sources():  # build file holds absolute source paths, so two checkouts sharing one would rebuild it
        with open(src, "rb") as f:
            h.update(f.read())
    digest = h.hexdigest()[:10]
    path = os.path.join(root, f"torch{torch.__version__}-{_cpu_tag()}-{digest}")
    os.makedirs(path, exist_ok=True)
    return path


def _sources() -> list[str]:
    """The extension's C++ sources and headers: every ``.cpp`` and ``.h`` in csrc/, sorted (all of them hash into the
    build folder's name; the ``.cpp`` files are compiled, bindings.cpp holding the Python module)."""
    d = os.path.join(os.path.dirname(__file__), "csrc")
    return [os.path.join(d, f) for f in sorted(os.listdir(d)) if f.endswith((".cpp", ".h"))]


def wanted(device: torch.device | str, host_experts: bool = False) -> bool:
    """True when an engine on ``device`` runs the fused CPU kernels, so that it builds (or loads) them at start, not
    mid-request: a CPU device, or routed experts computed on the host (``host_experts`` / ``num_device_experts``)
    beside an accelerator. On CUDA/ROCm with every expert on the device no CPU path runs them, and nothing builds
    them (the build costs minutes on a fresh machine)."""
    return torch.device(device).type == "cpu" or bool(host_experts)


def load():
    """The compiled extension module, or None when disabled or the build failed (reason in :func:`load_error`)."""
    global _module, _tried, _error
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        if os.environ.get("TOKENFAB_CPU_KERNELS", "1") == "0":
            _error = "disabled by TOKENFAB_CPU_KERNELS=0"
        else:
            build_dir = _build_dir()
            failed = os.path.join(build_dir, "build-failed.json")
            compiler = _compiler_id()
            previous = _read_failure(failed)
            if previous is not None and previous.get("compiler") == compiler:
                _error = previous.get("error", "the build failed before")  # said once, when it failed
                log.info("[tokenfab] fused CPU kernels unavailable (%s; remove %s to retry)", _error, failed)
            else:
                _module, _error = _build(build_dir)
                if _module is not None:
                    try:
                        os.utime(build_dir)  # last use, which prune keeps the newest of
                    except OSError:
                        pass
                    from tokenfab.kernels.cpu import isa as cpu_isa
                    _module.set_isa_cap(cpu_isa.level_index())  # TOKENFAB_CPU_ISA (raises on a bad value)
                if _module is not None and previous is not None:
                    try:
                        os.remove(failed)  # an earlier failure with another compiler
                    except OSError:
                        pass
                if _module is None:
                    log.warning("[tokenfab] fused CPU kernels unavailable (%s); using the PyTorch paths (not retried "
                                "until the compiler changes)", _error)
                    try:
                        with open(failed, "w") as f:
                            json.dump({"error": _error, "compiler": compiler}, f)
                    except OSError:
                        pass
        _tried = True
        return _module


def _compiler() -> tuple[str, str | None]:
    """The C++ compiler a build would use: (CXX or "c++", its path on PATH or None)."""
    import shutil
    cxx = os.environ.get("CXX", "c++")
    return cxx, shutil.which(cxx)


def _compiler_id() -> str:
    """Which compiler a build would use, as recorded with a failed build: it is retried when this changes."""
    cxx, path = _compiler()
    return f"{cxx} -> {path}"


def _read_failure(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class _build_lock:
    """Exclusive ``flock`` on ``build_dir/build.flock`` around a build (POSIX; a no-op elsewhere).

    torch's ``cpp_extension.load`` guards a build folder with a ``lock`` file that it deletes when done; a build
    killed midway leaves it, and every later load waits on it forever. The flock is released by the OS when its
    holder dies, and every tokenfab build holds it, so a ``lock`` file found while holding it is a dead build's:
    it is removed before loading.
    """

    def __init__(self, build_dir: str):
        self.build_dir, self.f = build_dir, None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:
            return self
        self.f = open(os.path.join(self.build_dir, "build.flock"), "w")
        fcntl.flock(self.f, fcntl.LOCK_EX)
        stale = os.path.join(self.build_dir, "lock")
        if os.path.exists(stale):
            os.remove(stale)
        return self

    def __exit__(self, *exc):
        if self.f is not None:
            self.f.close()  # releases the flock


def _build(build_dir: str):
    """Compile (or load the cached build of) the csrc/ sources -> (module, None) or (None, one-line reason)."""
    import sys
    import time
    import warnings
    try:
        from torch.utils import cpp_extension
        bindir = os.path.dirname(sys.executable)  # pip's ninja lives beside python in a venv not on PATH
        if os.path.isfile(os.path.join(bindir, "ninja")) and bindir not in os.environ.get("PATH", ""):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        srcs = [f for f in _sources() if f.endswith(".cpp")]
        flags = ["-O3", "-fopenmp"]
        if platform.machine() in ("x86_64", "AMD64"):
            flags.append("-march=native")
        fresh = not any(f.endswith(".so") for f in os.listdir(build_dir))
        cxx, cxx_path = _compiler()
        if fresh and cxx_path is None:
            return None, f"no C++ compiler: '{cxx}' not found (install g++ or set CXX)"
        if fresh:
            print("[tokenfab] building the fused CPU kernels (once per checkout and torch version: about 2 minutes "
                  "on a quiet 2-core machine, longer when the cores are busy) ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        torch_log = logging.getLogger("torch.utils.cpp_extension")
        level = torch_log.level
        torch_log.setLevel(logging.ERROR)  # torch's multi-line compiler-ABI banner; a failure is reported below
        try:
            with warnings.catch_warnings(), _build_lock(build_dir):
                warnings.simplefilter("ignore")
                module = cpp_extension.load(name="tokenfab_cpu_kernels", sources=srcs, extra_cflags=flags,
                                            extra_ldflags=["-fopenmp"], build_directory=build_dir, verbose=False)
        finally:
            torch_log.setLevel(level)
        if fresh:
            print(f"[tokenfab] built the fused CPU kernels in {time.perf_counter() - t0:.0f} s", file=sys.stderr,
                  flush=True)
            removed = prune(build_dir)
            if removed:
                log.info("[tokenfab] removed %d older kernel builds from %s", len(removed), os.path.dirname(build_dir))
        return module, None
    except Exception as e:  # no compiler, no ninja, headers missing: keep the PyTorch paths
        lines = str(e).strip().splitlines() or [""]
        first = next((l for l in lines if "error:" in l or "not found" in l), lines[-1])  # the compiler's first error
        return None, f"{type(e).__name__}: {first.strip()}"


def prune(build_dir: str, keep: int = KEEP_BUILDS) -> list[str]:
    """Remove the build folders beside ``build_dir`` (the cache root) past the ``keep`` most recently used (folder
    mtime: :func:`load` touches its folder), never ``build_dir`` itself, never a folder whose build lock another
    process holds (a build in progress; a process that loaded a build keeps its mapped library after the file is
    gone), and only folders named as :func:`_build_dir` names them. Errors are ignored (a cache that cannot be
    cleaned stays as it is). Returns the removed paths."""
    root = os.path.dirname(os.path.abspath(build_dir))
    try:
        paths = [os.path.join(root, n) for n in os.listdir(root) if _BUILD_NAME.match(n)]
        paths = [p for p in paths if os.path.isdir(p)]
        paths.sort(key=os.path.getmtime, reverse=True)
    except OSError:
        return []
    removed = []
    for p in paths[keep:]:
        if os.path.abspath(p) != os.path.abspath(build_dir) and _remove_unlocked(p):
            removed.append(p)
    return removed


def _remove_unlocked(path: str) -> bool:
    """Remove the build folder ``path`` while holding its build lock without waiting; False when another process
    holds it (or on any error)."""
    try:
        import fcntl
        with open(os.path.join(path, "build.flock"), "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(path)
        return True
    except (ImportError, OSError):
        return False


def load_error() -> str | None:
    """Why :func:`load` returned None (None when the kernels loaded or were not tried yet)."""
    return _error
