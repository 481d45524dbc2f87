"""Running untrusted model-written Python (HumanEval completions) in a child process with limits.

Each program runs as ``python -I`` (isolated mode: no user site, no ``PYTHON*`` variables, script folder not on
the path) in a fresh temporary folder that is removed afterwards, with a minimal environment, in its own session
(the whole process group is killed at the timeout). Before the program starts, a small bootstrap in the child:

* sets ``resource`` limits: RLIMIT_AS (address space, ``memory_mb``), RLIMIT_CPU (``timeout_s`` + 1 s of CPU),
  RLIMIT_FSIZE (16 MiB written per file), RLIMIT_CORE 0, RLIMIT_NOFILE 64;
* cuts the network: ``unshare(CLONE_NEWNET)`` (root), else ``unshare(CLONE_NEWUSER | CLONE_NEWNET)`` (an
  unprivileged user namespace, where the kernel allows it) puts the process in an empty network namespace
  (not even loopback is up); where neither is allowed, ``socket.socket`` and ``socket.create_connection`` are
  replaced by functions that raise (a Python-level barrier only; ``network`` in the result says which held);
* leaves process spawning (``os.system``, ``subprocess``) available: the limits above bound what a child may
  do, and the session kill at the timeout reaches its children too.

This is defence in depth for benchmark code, not a security boundary for hostile code: run untrusted models'
completions in a container or VM as well.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

_BOOTSTRAP = r'''
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
lim = [(resource.RLIMIT_AS, cfg["mem"]), (resource.RLIMIT_CPU, cfg["cpu"]), (resource.RLIMIT_FSIZE, 16 << 20),
       (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 64)]
net = "python-level"
try:
    libc = ctypes.CDLL(None, use_errno=True)
    for flags in (0x40000000, 0x10000000 | 0x40000000):  # CLONE_NEWNET; CLONE_NEWUSER | CLONE_NEWNET
        if libc.unshare(flags) == 0:
            net = "namespace"
            break
except Exception:
    pass
import socket
def _no_network(*a, **k):
    raise OSError("network access is disabled in the tokenfab sandbox")
socket.socket = _no_network
socket.create_connection = _no_network
for which, value in lim:
    soft, hard = resource.getrlimit(which)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(which, (value, hard))
sys.stderr.write("@@network=" + net + "\n")
sys.stderr.flush()
sys.argv = ["program.py"]
src = open("program.py").read()
g = {"__name__": "__main__", "__file__": "program.py", "__builtins__": __builtins__}
exec(compile(src, "program.py", "exec"), g)
'''


def run_program(source: str, timeout_s: float = 10.0, memory_mb: int = 1024) -> dict:
    """Run ``source`` in the sandbox; returns ``{"passed": bool, "result": str, "network": str}``.

    ``passed``: the program exited 0 within ``timeout_s`` seconds (wall clock). ``result``: ``"passed"``,
    ``"timed out"``, or ``"failed: <last line of stderr>"`` (e.g. the AssertionError or MemoryError).
    ``network``: ``"namespace"`` (an empty network namespace) or ``"python-level"`` (socket functions
    replaced), as reported by the child.
    """
    tmp = tempfile.mkdtemp(prefix="tokenfab-sandbox-")
    try:
        with open(os.path.join(tmp, "program.py"), "w") as f:
            f.write(source)
        cfg = json.dumps({"mem": int(memory_mb) << 20, "cpu": int(timeout_s) + 1})
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
               "PYTHONHASHSEED": "0"}
        proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOTSTRAP, cfg], cwd=tmp, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            _, err = proc.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, err = proc.communicate()
            timed_out = True
        text = err.decode("utf-8", "replace")
        network = "namespace" if "@@network=namespace" in text else "python-level"
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("@@network=")]
        if timed_out:
            return {"passed": False, "result": "timed out", "network": network}
        if proc.returncode == 0:
            return {"passed": True, "result": "passed", "network": network}
        why = lines[-1] if lines else f"exit status {proc.returncode}"
        if proc.returncode < 0:
            why = f"killed by signal {-proc.returncode}" + (f" ({lines[-1]})" if lines else "")
        return {"passed": False, "result": f"failed: {why[:300]}", "network": network}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
