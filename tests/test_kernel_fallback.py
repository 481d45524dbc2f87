"""Without a working C++ compiler the fused CPU kernels are reported unavailable (once: the failure is remembered per
compiler) and generation still works on the PyTorch paths, with the same greedy tokens as the kernels give."""
from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, sys
from tokenfab import LLM, SamplingParams
from tokenfab.kernels.cpu import build as cpu_build
llm = LLM(sys.argv[1], max_model_len=64, progress=False)
out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10]}], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
print(json.dumps({"loaded": cpu_build.load() is not None, "error": cpu_build.load_error(),
                  "tokens": out[0].outputs[0].token_ids}))
"""


def _run(path, env):
    r = subprocess.run([sys.executable, "-c", SCRIPT, path], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_no_compiler_falls_back(tiny_model, tmp_path):
    path = tiny_model("deepseek_v3")
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), TOKENFAB_KERNEL_CACHE=str(tmp_path / "kc"))
    broken, stderr = _run(path, env)
    assert not broken["loaded"] and broken["error"]
    assert "using the PyTorch paths" in stderr and "!! WARNING !!" not in stderr
    again, stderr2 = _run(path, env)  # the failure is remembered: no second build attempt, no second warning
    assert not again["loaded"] and again["error"] == broken["error"]
    assert "building the fused CPU kernels" not in stderr2 and "unavailable" not in stderr2
    assert again["tokens"] == broken["tokens"]
    off, _ = _run(path, dict(os.environ, TOKENFAB_CPU_KERNELS="0"))
    assert not off["loaded"] and "TOKENFAB_CPU_KERNELS=0" in off["error"]
    on, _ = _run(path, dict(os.environ))
    assert broken["tokens"] == off["tokens"]
    if on["loaded"]:
        assert on["tokens"] == off["tokens"]  # float32 tiny model: kernels and PyTorch paths agree


LOAD = r"""
import json
from tokenfab.kernels.cpu import build as cpu_build
print(json.dumps({"loaded": cpu_build.load() is not None, "error": cpu_build.load_error()}))
"""


def test_stale_build_lock_is_removed(tmp_path):
    """A build killed midway leaves torch's ``lock`` file in the build folder; without the flock guard every later
    load waits on it forever. A copy of this checkout's built folder with such a file still loads (no rebuild)."""
    import shutil
    import pytest
    from tokenfab.kernels.cpu import build
    if build.load() is None:
        pytest.skip(f"kernels not built here: {build.load_error()}")
    src = build._build_dir()
    env = dict(os.environ, TOKENFAB_KERNEL_CACHE=str(tmp_path / "kc"))
    r = subprocess.run([sys.executable, "-c", "from tokenfab.kernels.cpu import build as b; print(b._build_dir())"],
                       capture_output=True, text=True, env=env, timeout=120)
    dst = r.stdout.strip().splitlines()[-1]
    assert dst.startswith(str(tmp_path)) and os.path.basename(dst) == os.path.basename(src)
    for f in os.listdir(src):
        if os.path.isfile(os.path.join(src, f)) and f not in ("lock", "build.flock"):
            shutil.copy2(os.path.join(src, f), dst)
    open(os.path.join(dst, "lock"), "w").close()  # what a killed build leaves
    r = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["loaded"], got["error"]
    assert not os.path.exists(os.path.join(dst, "lock"))
    assert "building the fused CPU kernels" not in r.stderr  # the copied build was reused, not rebuilt


def test_prune_keeps_the_newest_builds(tmp_path):
    """After a fresh build the cache keeps the KEEP_BUILDS most recently used build folders: older ones go, but not
    the folder just built, one whose build lock another process holds, or anything not named as a build."""
    import fcntl
    from tokenfab.kernels.cpu import build
    names = [f"torch2.13.0+cpu-4fd9865e40-{i:010x}" for i in range(10)]
    for i, n in enumerate(names):  # mtimes 1000, 1100, ...: names[9] the most recently used
        d = tmp_path / n
        d.mkdir()
        (d / "tokenfab_cpu_kernels.so").write_bytes(b"x")
        (d / "build.flock").write_bytes(b"")  # every build has one (made first: a new file dates its folder)
        os.utime(d, (1000 + 100 * i, 1000 + 100 * i))
    other = tmp_path / "notes"
    other.mkdir()
    os.utime(other, (1, 1))
    current = tmp_path / names[1]  # an old folder, just loaded by this process
    with open(tmp_path / names[2] / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another build in progress there
        removed = build.prune(str(current), keep=4)
    assert sorted(os.path.basename(p) for p in removed) == [names[0], names[3], names[4], names[5]]
    assert sorted(os.listdir(tmp_path)) == sorted([names[1], names[2], "notes"] + names[6:])
