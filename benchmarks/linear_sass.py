"""Compile the packed linears' and the fused MoE's Triton kernels (kernels/gpu/fp8_linear.py, gguf_linear.py,
gguf_kquant_linear.py, moe_gemm.py) for a GPU that is not here, and print what the compiler made of each autotune config: registers,
spilled bytes, shared memory, and for NVIDIA the instructions of the K loop per weight each thread handles (a proxy
for the ALU ceiling of a decode GEMV: an H100/H200 issues about 3e13 thread-instructions per second, so k
instructions per weight cap the kernel at about 3e13 / k weights per second). No GPU is needed: Triton's own
ptxas / cuobjdump (NVIDIA) or its AMD backend (ROCm, no SASS statistics) compile from the source.

    python benchmarks/linear_sass.py [--target sm90|gfx942] [--kernels fp8,gguf,kquant,moe]

The kernels are compiled as the runtime specializes them for aligned tensors (pointers and the sizes / strides that
are multiples of 16 marked divisible by 16) with bf16 activations. The grouped GEMM is compiled per format (INT4
group-32, MXFP4, FP8 block), per weight layout (the checkpoint's, and the GPU layout of
kernels/gpu/moe_relayout.py) and per row-tile height (16: decode; 64: prefill), over the configs the tuner would
try for it. Times here are compile times, nothing else.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, whatever the caller's environment says

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tokenfab.kernels.gpu import fp8_linear, gguf_kquant_linear, gguf_linear, moe_gemm  # noqa: E402

ALIGNED = {"X", "W", "S", "OUT", "BIAS", "T8", "T32", "T16", "N", "K", "s_xm", "s_wn", "s_sn", "NT", "KB", "KS"}
MOE_ALIGNED = {"A", "W", "S", "C", "TOPW", "SORTED", "N", "K", "s_am", "s_we", "s_wn", "s_se", "s_sn", "s_cm"}
TARGETS = {"sm90": GPUTarget("cuda", 90, 32), "gfx942": GPUTarget("hip", "gfx942", 64)}


def _loop_stats(cubin: bytes) -> tuple[str, str, int, collections.Counter]:
    """(registers, stack bytes, instructions in the longest loop, their opcode counts) of a cubin."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                             text=True).stdout
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", res)
    ops = []
    for line in sass.splitlines():
        mm = re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if mm:
            ops.append((int(mm.group(1), 16), mm.group(3), line))
    loops = []
    for addr, op, line in ops:
        t = re.search(r"0x([0-9a-f]+)", line.split("BRA")[1]) if op.startswith("BRA") else None
        if t and int(t.group(1), 16) < addr:
            loops.append((int(t.group(1), 16), addr))
    body = collections.Counter()
    if loops:
        a, b = max(loops, key=lambda ab: ab[1] - ab[0])
        body = collections.Counter(op.split(".")[0] for addr, op, _ in ops if a <= addr <= b)
    return (m.group(1), m.group(2)) if m else ("?", "?"), sum(body.values()), body


def _report(label: str, fn, sig: dict, const: dict, cfg, target, weights_per_thread: int,
            aligned: set = ALIGNED) -> None:
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if a in aligned}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=target,
                       options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    line = f"{label:<34} {str(cfg.kwargs):<50} w{cfg.num_warps} s{cfg.num_stages} smem {k.metadata.shared:>6}"
    if target.backend == "cuda":
        (regs, stack), n, body = _loop_stats(k.asm["cubin"])
        line += (f" regs {regs:>3} stack {stack:>4} loop {n:>4} instr = {n / weights_per_thread:5.1f} per weight | "
                 + " ".join(f"{op}:{c}" for op, c in body.most_common(6)))
    print(line, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="sm90", choices=sorted(TARGETS))
    ap.add_argument("--kernels", default="fp8,gguf,moe")
    args = ap.parse_args()
    target = TARGETS[args.target]
    want = set(args.kernels.split(","))
    base = {"X": "*bf16", "OUT": "*fp32", "BIAS": "*bf16", "HAS_BIAS": "constexpr", "PARTIAL": "constexpr"}
    if "fp8" in want:
        sig = {**base, "W": "*u8", "S": "*fp32", "N": "i32", "K": "i32", "s_wn": "i32", "s_sn": "i32",
               "STEPS": "i32", "SPLIT": "i32", "NATIVE_FP8": "constexpr", "BLOCK_N": "constexpr"}
        for cfg in fp8_linear._fp8_gemv.configs:
            _report("fp8 one row", fp8_linear._fp8_gemv.fn, sig, {"HAS_BIAS": False, "PARTIAL": True,
                    "NATIVE_FP8": True, **cfg.kwargs}, cfg, target, cfg.kwargs["BLOCK_N"] * 128 // (
                    32 * cfg.num_warps))
        sig = {**sig, "M": "i32", "s_xm": "i32", "MB": "i32", "DOT_F32": "constexpr", "BLOCK_M": "constexpr"}
        for cfg in fp8_linear._fp8_gemm.configs:
            for bm in (16, 64):
                _report(f"fp8 tiles BLOCK_M={bm}", fp8_linear._fp8_gemm.fn, sig, {"HAS_BIAS": False,
                        "PARTIAL": True, "NATIVE_FP8": True, "DOT_F32": False, "BLOCK_M": bm, **cfg.kwargs}, cfg,
                        target, cfg.kwargs["BLOCK_N"] * 128 // (32 * cfg.num_warps))
    if "gguf" in want:
        sig = {**base, "T32": "*i32", "T16": "*fp16", "N": "i32", "NT": "i32", "KB": "i32", "STEPS": "i32",
               "SPLIT": "i32", "TBB": "constexpr", "KIND": "constexpr", "BLOCK_T": "constexpr",
               "BLOCK_KB": "constexpr"}
        for name, kind in gguf_linear._KIND.items():
            tbb = {"Q8_0": 544, "Q4_0": 288, "Q4_1": 320}[name]
            for cfg in gguf_linear._gguf_gemv.configs:
                per = cfg.kwargs["BLOCK_T"] * 16 * cfg.kwargs["BLOCK_KB"] * 32 // (32 * cfg.num_warps)
                _report(f"{name} one row", gguf_linear._gguf_gemv.fn, sig, {"HAS_BIAS": False, "PARTIAL": True,
                        "TBB": tbb, "KIND": kind, **cfg.kwargs}, cfg, target, per)
            sig2 = {**sig, "M": "i32", "s_xm": "i32", "MB": "i32", "DOT_F32": "constexpr", "MAGIC": "constexpr",
                    "DEQ": "constexpr", "BLOCK_M": "constexpr"}
            for cfg in gguf_linear._gguf_gemm.configs:
                per = cfg.kwargs["BLOCK_T"] * 16 * cfg.kwargs["BLOCK_KB"] * 32 // (32 * cfg.num_warps)
                for bm in (16, 64):
                    _report(f"{name} tiles BLOCK_M={bm}", gguf_linear._gguf_gemm.fn, sig2, {"HAS_BIAS": False,
                            "PARTIAL": True, "TBB": tbb, "KIND": kind, "DOT_F32": False, "MAGIC": 0x4300,
                            "DEQ": bm >= 32, "BLOCK_M": bm, **cfg.kwargs}, cfg, target, per)
    if "kquant" in want:
        _kquant(target, base)
    if "moe" in want:
        _moe(target)
    return 0


def _kquant(target, base: dict) -> None:
    """The K-quant kernels (gguf_kquant_linear._kq_gemv / _kq_gemm) per type, with bf16 activations."""
    kq = gguf_kquant_linear
    sig = {**base, "T8": "*u8", "T32": "*i32", "T16": "*fp16", "N": "i32", "NT": "i32", "KB": "i32", "STEPS": "i32",
           "KS": "i32", "SPLIT": "i32", "TBB": "constexpr", "KIND": "constexpr", "BLOCK_T": "constexpr",
           "BLOCK_KB": "constexpr"}
    for name, kind in kq.KQ_KIND.items():
        tbb = {"Q4_K": 2304, "Q5_K": 2816, "Q6_K": 3360}[name]
        for cfg in kq._kq_gemv.configs:
            per = cfg.kwargs["BLOCK_T"] * 16 * cfg.kwargs["BLOCK_KB"] * 32 // (32 * cfg.num_warps)
            _report(f"{name} one row", kq._kq_gemv.fn, {a: sig[a] for a in kq._kq_gemv.fn.arg_names},
                    {"HAS_BIAS": False, "PARTIAL": True, "TBB": tbb, "KIND": kind, **cfg.kwargs}, cfg, target, per)
        sig2 = {**sig, "M": "i32", "s_xm": "i32", "MB": "i32", "DOT_F32": "constexpr", "MAGIC": "constexpr",
                "DEQ": "constexpr", "BLOCK_M": "constexpr"}
        sig2 = {a: sig2[a] for a in kq._kq_gemm.fn.arg_names}
        for cfg in kq._kq_gemm.configs:
            per = cfg.kwargs["BLOCK_T"] * 16 * cfg.kwargs["BLOCK_KB"] * 32 // (32 * cfg.num_warps)
            for bm in (16, 64):
                _report(f"{name} tiles BLOCK_M={bm}", kq._kq_gemm.fn, sig2, {"HAS_BIAS": False, "PARTIAL": True,
                        "TBB": tbb, "KIND": kind, "DOT_F32": False, "MAGIC": 0x4300, "DEQ": bm >= 32,
                        "BLOCK_M": bm, **cfg.kwargs}, cfg, target, per)


def _moe(target) -> None:
    """The grouped GEMM (moe_gemm._grouped_gemm) per format, layout and row-tile height, with bf16 activations."""
    mg = moe_gemm
    # s_wk (the weights' K stride) is 1 at every launch, and Triton's launcher specializes an int argument of 1
    # into a constant (so the loads along K vectorize): compiled that way here
    ints = ["N", "K", "num_pairs", "a_row_div", "s_am", "s_we", "s_wn", "s_se", "s_sn", "s_cs", "s_cm",
            "PART", "m_bucket", "split_max", "magic"]
    base = {"A": "*bf16", "NSPLIT": "*i32", "SORTED": "*i32", "EXPERT_OF_BLOCK": "*i32", "NUM_POST": "*i32",
            "TOPW": "*fp32", **{a: "i32" for a in ints}}
    kinds = [("bf16", mg.DENSE, False, "*bf16", "*bf16"), ("INT4", mg.INT4_GROUP, False, "*i32", "*i16"), ("INT4 re-laid", mg.INT4_GROUP, True, "*i32", "*i16"),
             ("MXFP4", mg.MXFP4, False, "*u8", "*u8"), ("MXFP4 re-laid", mg.MXFP4, True, "*i32", "*u8"),
             ("FP8", mg.FP8_BLOCK, False, "*u8", "*fp32"), ("FP8 re-laid", mg.FP8_BLOCK, True, "*i32", "*fp32")]
    for name, fmt, relaid, wt, st in kinds:
        for bm in (16, 64):
            cfgs = []  # decode: gate|up's configs (no split) and the down projection's (split-K)
            for split_max in ((1, 4) if bm == 16 else (1,)):
                cfgs += [c for c in mg._prune(mg.CONFIGS, {"split_max": split_max}, FMT=fmt, BLOCK_M=bm,
                                              RELAID=relaid) if all(c is not d for d in cfgs)]
            for cfg in cfgs:
                split = cfg.kwargs["SPLIT_K"]
                sig = {**base, "W": wt, "S": st, "C": "*fp32" if split > 1 else "*bf16", "s_wk": "constexpr",
                       **{c: "constexpr" for c in ("MUL_WEIGHT", "FMT", "SCALE_BF16", "IEEE", "MX_SCALED", "GLU",
                                                   "BLOCK_M", "RELAID", "RELAID_SWAP", *cfg.kwargs)}}
                sig = {a: sig[a] for a in mg._grouped_gemm.arg_names}
                const = {"s_wk": 1, "MUL_WEIGHT": split > 1, "FMT": fmt, "SCALE_BF16": fmt == mg.INT4_GROUP, "IEEE": False,
                         "MX_SCALED": True, "GLU": False, "BLOCK_M": bm, "RELAID": relaid, "RELAID_SWAP": True,
                         **cfg.kwargs}
                per = cfg.kwargs["BLOCK_N"] * cfg.kwargs["BLOCK_K"] // (32 * cfg.num_warps)
                _report(f"moe {name} BLOCK_M={bm}", mg._grouped_gemm, sig, const, cfg, target, per, MOE_ALIGNED)


if __name__ == "__main__":
    sys.exit(main())
