"""The exactness and real-model tests on every other CPU path this machine can take (kernels/cpu/isa.py).

The suite itself runs on this CPU's best path (``TOKENFAB_CPU_ISA=native``). Another CPU family takes another
path (an AMD EPYC has no AMX, an older CPU no AVX512-BF16), and each rounds bf16 work in its own order, so the
tests that compare tokenfab with transformers and the real default model's demo answers run again here, in a child
pytest per lower level (``TOKENFAB_CPU_ISA`` is read once per process: oneDNN and ATen take their caps at start),
and once with the fused kernels off (``TOKENFAB_CPU_KERNELS=0``: the PyTorch paths every machine has).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenfab.kernels.cpu import isa as cpu_isa

CHILD = "TOKENFAB_CPU_PATHS_CHILD"  # set in the child runs, so they do not recurse
# bf16 paths are where CPU families part (float32 runs no AVX512-BF16 or AMX kernel), so of the real model's tests
# the bf16 demo answers through the server run here; its float32 token-exact test runs once, in the main suite.
# The packed GGUF kernels' tests run too: their prefill and batched-decode paths differ by level (AMX tiles or not;
# below amx, the opt-in int8-activation GEMV, which an AMX machine's own suite skips), the packed experts' (their
# register path on the tile layout runs to 256 tokens per expert without AMX, to 12 with it) and the FP8 linears' and
# experts' (the FP8 tile layout and its GEMV / brgemm are taken only without AMX). With the kernels off
# the demo's answer is left out (no CPU family's kernel runs there; its bf16 PyTorch path is the other tests').
FILES = ["tests/test_engine_exact.py", "tests/test_bf16.py", "tests/test_logits_f32.py",
         "tests/test_gguf_linear.py", "tests/test_gguf_kquants.py", "tests/test_gguf_int8_activations.py",
         "tests/test_packed_experts.py", "tests/test_fp8_block_weight.py", "tests/test_fp8_block_experts.py",
         "tests/test_real_model.py::test_demo_answers_through_the_server"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def other_paths() -> list[tuple[str, dict[str, str]]]:
    """(label, environment) for each CPU path below this machine's best, then the kernels-off path."""
    best = cpu_isa.LEVELS.index(cpu_isa.machine_level())
    paths = [(lvl, {cpu_isa.ENV: lvl}) for lvl in reversed(cpu_isa.LEVELS[:best])]
    return paths + [("kernels-off", {"TOKENFAB_CPU_KERNELS": "0"})]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get(CHILD) == "1", reason="inside a child run")
@pytest.mark.parametrize("label,env", other_paths(), ids=[p[0] for p in other_paths()])
def test_exactness_and_real_model_on_other_cpu_paths(label, env, real_model_cache):
    from conftest import REAL_MODEL_CACHE_ENV
    child_env = {**os.environ, **env, CHILD: "1", REAL_MODEL_CACHE_ENV: real_model_cache}  # converted once per run
    for cap in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):  # the child sets its own from its level
        child_env.pop(cap, None)
    files = [f for f in FILES if not (label == "kernels-off" and "::test_demo" in f)]  # no kernel: no CPU family
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files],
                       cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=1800)
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, f"CPU path {label}: the exactness / real-model tests failed:\n{tail}"
    assert " passed" in tail and "failed" not in tail.splitlines()[-1]
