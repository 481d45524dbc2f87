"""Defaults for a CPU at the avx2 ISA level (no AVX512-BF16), each A/B-measured on the default model in fresh
processes, alternated:

* ``--compare dense-fallback``: SmolLM2's Q4_1 file served packed without the packed kernels: per-call
  dequantization (``TOKENFAB_DENSE_FALLBACK_GIB=0``) vs float32 copies made once at load (budget 4 GiB). NOTES 79.
* ``--compare auto-dtype``: the default model's bf16 folder (what ``tokenfab demo`` serves) in bfloat16 vs float32,
  what ``dtype="auto"`` should mean there. NOTES 80.
* ``--compare avx2-gemv``: SmolLM2's Q4_1 file with float32 copies alone vs the packed AVX2 kernel
  (kernels/cpu/csrc/gguf_gemv_avx2.cpp) with the copies' budget at its default and at 0 (NOTES 81; since NOTES 84
  the kernel keeps no copy either way, so the last two rows run the same path).
* ``--compare flash-f32``: the default model's folder in float32 with prefill attention on the GEMM + fused causal
  softmax path vs PyTorch's CPU flash kernel (layers/flash_prefill.py, the default at the avx2 level since
  2026-12-06), 4 prompts of 1,024 tokens instead of 16 of 256. NOTES 87.
* ``--compare demo-model``: what ``tokenfab demo`` serves (the default model's dequantized folder, float32 here) vs
  the same model's packed Q4_1 file on the AVX2 kernels. NOTES 88.
* ``--compare decode-stack``: SmolLM2's Q4_1 file packed, decode steps on the modules vs through the fused C++
  decode stack (engine/cpu_decode_stack.py, float32 on the AVX2 GEMV since 2026-12-06's thirteenth session).
* ``--compare avx2-copies``: SmolLM2's Q4_1 file with decode rows on the AVX2 kernel and prefill on float32 copies
  (the default before 2026-12-06's panel GEMM) vs every row on the AVX2 kernel and no copies (the default since).
  NOTES 84.

Per run: one engine, 16 prompts of 256 random tokens (flash-f32: 4 of 1,024), 32 greedy tokens each (ignore_eos), all
submitted at once; prefill time (until every sequence has its first token), the whole run, total tokens per second, the
resident set after load, and the first answer's first 8 tokens; then one sequence alone (a 32-token prompt, 64 greedy
tokens): its time per output token after the first (batch-1 decode).

    PYTHONPATH=. python benchmarks/experiments/avx2_defaults_ab.py \
        --compare dense-fallback|auto-dtype|avx2-gemv|avx2-copies|flash-f32|demo-model|decode-stack [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import torch
from tokenfab import LLM, SamplingParams
from tokenfab.default_model import default_model_path, real_model_gguf
from tokenfab.kernels.cpu import isa
from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf
if sys.argv[3] == "no-flash":  # prefill attention on the GEMM + fused causal softmax path
    from tokenfab.layers import flash_prefill
    flash_prefill._avx2 = lambda: False
if sys.argv[3] == "no-gemv":  # the float32 copies alone: the AVX2 GEMV not offered
    cpu_gguf.gguf_gemv_avx2_applies = lambda ggml_type: False
if sys.argv[3] == "copies":  # the GEMV for up to 16 rows, float32 copies for more (the default before NOTES 84)
    from tokenfab.quant.gguf_weight import GGUFWeight
    prepare = GGUFWeight.prepare
    GGUFWeight.prepare = lambda self: prepare(self) or (self._gemv_avx2 and self.keep_dense_copy())
    GGUFWeight._avx2_rows = lambda self, x: (self._gemv_avx2 and x.dtype in (torch.bfloat16, torch.float32) and
                                             (self._dense is None or x.numel() <= 16 * x.shape[-1]))
path = real_model_gguf() if sys.argv[1] == "gguf" else default_model_path(quiet=True)
llm = LLM(path, dtype=sys.argv[2], progress=False, max_model_len=2048)
stack_built = llm.llm_engine.runner.cpu_decode_stack is not None
if sys.argv[3] == "no-stack":  # decode steps on the modules
    llm.llm_engine.runner.cpu_decode_stack = None
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
g = torch.Generator().manual_seed(0)
n_prompts, length = (int(v) for v in sys.argv[4].split("x"))
prompts = [{"prompt_token_ids": torch.randint(10, 40000, (length,), generator=g).tolist()} for _ in range(n_prompts)]
first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
full = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
llm.generate(prompts[:2], first, use_tqdm=False)  # warm-up
t0 = time.perf_counter(); llm.generate(prompts, first, use_tqdm=False); t1 = time.perf_counter()
out = llm.generate(prompts, full, use_tqdm=False); t2 = time.perf_counter()
toks = sum(len(o.outputs[0].token_ids) for o in out)
one = [prompts[0]["prompt_token_ids"][:32]]
llm.generate([{"prompt_token_ids": one[0]}], first, use_tqdm=False)
t3 = time.perf_counter(); llm.generate([{"prompt_token_ids": one[0]}], first, use_tqdm=False); t4 = time.perf_counter()
long = SamplingParams(temperature=0, max_tokens=65, ignore_eos=True)
llm.generate([{"prompt_token_ids": one[0]}], long, use_tqdm=False); t5 = time.perf_counter()
print(json.dumps({"tpot1_ms": ((t5 - t4) - (t4 - t3)) / 64 * 1e3, "isa": isa.selected_level(),
                  "dtype": str(llm.llm_engine.dtype), "prefill_s": t1 - t0, "full_s": t2 - t1,
                  "total_tok_s": (n_prompts * length + toks) / (t2 - t1), "max_rss_mb_after_load": rss,
                  "first_ids": out[0].outputs[0].token_ids[:8], "stack_built": stack_built}))
"""
# (variant label, model: "gguf" file or the bf16 "folder", dtype, extra environment, "gemv" / "no-gemv" / "copies")
VARIANTS = {"dense-fallback": [("per-call dequantization", "gguf", "auto", {"TOKENFAB_DENSE_FALLBACK_GIB": "0"},
                                "no-gemv"),
                               ("float32 copies at load", "gguf", "auto", {"TOKENFAB_DENSE_FALLBACK_GIB": "4"},
                                "no-gemv")],
            "auto-dtype": [("bfloat16", "folder", "bfloat16", {}, "gemv"), ("float32", "folder", "float32", {}, "gemv")],
            "avx2-gemv": [("float32 copies alone", "gguf", "auto", {}, "no-gemv"),
                          ("AVX2 kernel", "gguf", "auto", {}, "gemv"),
                          ("packed alone (no copies)", "gguf", "auto", {"TOKENFAB_DENSE_FALLBACK_GIB": "0"}, "gemv")],
            "avx2-copies": [("float32 copies for prefill", "gguf", "auto", {}, "copies"),
                            ("AVX2 kernel alone", "gguf", "auto", {}, "gemv")],
            "flash-f32": [("fused prefill attention", "folder", "auto", {}, "no-flash"),
                          ("PyTorch flash prefill attention", "folder", "auto", {}, "gemv")],
            "demo-model": [("folder (float32)", "folder", "auto", {}, "gemv"),
                           ("Q4_1 file packed", "gguf", "auto", {}, "gemv")],
            "decode-stack": [("modules", "gguf", "auto", {}, "no-stack"),
                             ("decode stack", "gguf", "auto", {}, "gemv")]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compare", required=True, choices=sorted(VARIANTS))
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    rows = []
    for r in range(a.rounds):
        for label, model, dtype, env, gemv in VARIANTS[a.compare]:
            shape = "4x1024" if a.compare == "flash-f32" else "16x256"
            res = subprocess.run([sys.executable, "-c", CHILD, model, dtype, gemv, shape], env={**os.environ, **env},
                                 capture_output=True, text=True, check=True)
            rows.append(dict(json.loads(res.stdout.strip().splitlines()[-1]), variant=label, round=r))
            print(json.dumps(rows[-1]), flush=True)
    shape = "4 x 1,024" if a.compare == "flash-f32" else "16 x 256"
    print(f"| variant | round | prefill s ({shape}) | prefill + 31 decode steps s | total tok/s | batch-1 TPOT ms | "
          "max RSS MB | first ids |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for x in rows:
        print(f"| {x['variant']} | {x['round']} | {x['prefill_s']:.2f} | {x['full_s']:.2f} | {x['total_tok_s']:.0f} | "
              f"{x['tpot1_ms']:.1f} | {x['max_rss_mb_after_load']:.0f} | {x['first_ids']} |")


if __name__ == "__main__":
    main()
