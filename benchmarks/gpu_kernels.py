"""The Triton kernels and decode CUDA graphs on a GPU: errors against the PyTorch paths, and time against the
bytes each kernel must read at the HBM copy bandwidth measured in the same run.

    python benchmarks/gpu_kernels.py [--device cuda] [--out DIR] [--quick]

1. Paged decode attention (kernels/gpu/decode_attention.py) in bf16 at DeepSeek-V3's MLA shape (128 heads over
   one latent "head" of 512 + 64) and a Llama GQA shape (32 query / 8 KV heads of 128), batch 1 / 16 / 64 at 4,096
   context tokens and batch 1 at 32,768: max error against the gathered float32 reference, microseconds per call
   (replayed from a CUDA graph over cache copies larger than L2 together), and the fraction of the copy bandwidth
   reached (bytes = KV rows read once + q + output); each shape names its split count and the tiles chosen.
2. Fused MoE (kernels/gpu/moe.py) at DeepSeek-V3 expert shapes (hidden 7168, intermediate 2048, 8 of 64 local
   experts): error against RoutedExperts' PyTorch loop, time per call and bandwidth over the distinct experts hit.
3. Packed GGUF Q4_1 / Q8_0 linears (kernels/gpu/gguf_linear.py) at 4096 x 4096 and (Q4_1) DeepSeek-V3's dense
   7168 x 18432, 1 / 16 / 64 rows, and Q4_K / Q6_K (kernels/gpu/gguf_kquant_linear.py) at 7168 x 18432, 1 / 16
   rows (those last, after step 5): error against GGUFWeight's dequantizing PyTorch path, time (CUDA-graph replays),
   GB/s and bandwidth over the packed bytes, F.linear on the dequantized weight alongside; the same for the FP8
   block-scaled linear (kernels/gpu/fp8_linear.py: the Triton kernel, and the block-scaled scaled_mm path where its
   probe passes) against its dequantized weight, and the fused MoE over INT4 group-32, MXFP4 and FP8 stacks
   (kernels/gpu/packed_moe.py) at DeepSeek-V3's and Kimi K3's expert shapes, 1 / 16 / 64 tokens, against the bf16
   fused MoE on the dequantized weights (timed beside it).
4. (steps 4 and 5: benchmarks/gpu_glue.py) RMSNorm with the residual add, SiLU-GLU and RoPE
   (kernels/gpu/norm_activation.py) at 16 and 2,048 rows (hidden
   4096, intermediate 11008, 32 heads of 128), and DeepSeek-V3's router selection (kernels/gpu/router.py): error
   against the layers' PyTorch math, time, bandwidth over the bytes read and written.
5. The fused decode glue of a Qwen3-MoE layer (q/k norm + RoPE + KV-cache write, softmax top-k router, MoE
   k-sum) at Qwen3-30B-A3B's shapes and MLA's kv norm + RoPE + latent write at DeepSeek-V3's, 16 and 2,048
   tokens, and at 16 tokens gated MLA's value heads with K3's output gate in one launch beside cuBLAS's batched GEMM
   + the gate's launch, K3's MoE output as one GEMM over [latent | shared] beside the two it replaced, and MLA's
   queries (q_a norm, q_b GEMM, absorbed queries) with the latent write in one launch beside the three it replaced
   at DeepSeek-V3's shape, 1 and 16 tokens, 128 heads and a tensor-parallel-8 rank's 16: error against the layers'
   PyTorch math, time, bandwidth.
6. KDA (kernels/gpu/kda.py, kernels/gpu/kda_chunk.py) at K3's shape in float32: a 6,144-token prefill by the fused
   recurrent kernel and, with --kda-fla, by fla-core's chunk_kda (where installed) against layers/kda.py's chunked
   form, and decode steps at batch 1 / 16 / 64 against its recurrence, time and bandwidth over the float32 state
   read and written; at the same batches a decode-only step's whole KDA core (short conv, recurrence, gated output
   norm) in one launch as the layer runs it, timed beside the three launches it replaces.
7. Greedy tokens of the embedded default model (``--quick``: a tiny random DeepSeek-V3) in float32 with decode CUDA graphs and with ``enforce_eager``:
   identical token ids expected.

A dry run of this script on CPU (tiny shapes, float32, Triton's interpreter; its times mean nothing; the "graphs"
side runs the padded graph buffers without capture):

    TRITON_INTERPRET=1 TOKENFAB_TRITON=interpret TOKENFAB_DECODE_GRAPHS=eager \
        .venv/bin/python benchmarks/gpu_kernels.py --device cpu --quick --reps 2 --out /tmp/gk

KDA alone, fla-core's chunked prefill included (its autotuning takes a minute or two the first time):

    python benchmarks/gpu_kernels.py --only-kda --kda-fla --out /tmp/gk-kda

The kernels tune their tiles here (``TOKENFAB_TRITON_AUTOTUNE=1`` unless set: kernels/gpu/support.py), so the
table shows the tuned configs; serving and the decode floors run each kernel's first config unless asked to tune.

Writes <out>/gpu-kernels.{json,md}; exit status 1 when an error bound or the graph check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

os.environ.setdefault("TOKENFAB_TRITON_AUTOTUNE", "1")  # before any kernel module is imported (support.py)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.decode_floor import copy_bandwidth  # noqa: E402
from benchmarks.gpu_timing import time_replayed_us as _time_replayed_us, time_us as _time_us  # noqa: E402
from benchmarks.gpu_glue import check_decode_glue, check_norm_activation  # noqa: E402
from benchmarks.gpu_kda import check_kda  # noqa: E402
from benchmarks.gpu_linears import check_fp8, check_gguf, check_gguf_kquants  # noqa: E402

_T0 = time.monotonic()
# seconds into the run past which optional rows (the re-laid FP8 experts) are skipped: gpu_check.sh gives this
# script 160 s, and a run stopped by its timeout writes no table
OPTIONAL_ROWS_BEFORE_S = 110.0


def check_attention(dev, dtype, quick: bool, bw: float, reps: int) -> list[dict]:
    """Paged decode attention at DeepSeek-V3's MLA shape (128 heads, latent 512 + 64) and a Llama GQA shape
    (32 / 8 heads of 128): batch 1 / 16 / 64 at 4K context and batch 1 at 32K, page 16; and the K3 DSpark drafter's
    pass (768 query heads over the latent rows) at batch 1 / 16 x 8K. Timed from a CUDA graph
    over enough cache copies (>= 256 MB in all, at most 16) that L2 holds none of them; bytes = KV rows read once
    + q + output."""
    from tokenfab.kernels.gpu import decode_attention as da
    from tokenfab.kernels.gpu.decode_attention import paged_decode_attention

    def launch(name, B, H, Hk, D, Dv, ctx, elem) -> str:
        """The split count and the tiles the tuner (or the fixed config) chose for the last call."""
        row_bytes = (D if name == "mla" else D + Dv) * elem
        splits = da.default_num_splits(B, Hk, H // Hk, Dv, row_bytes, elem, ctx, da.multiprocessors(dev))
        fixed = da._fixed_config(dtype)
        if fixed is not None:
            return f"splits={splits}, fixed " + ", ".join(f"{k}={v}" for k, v in fixed.items())
        best = (da._wide if Dv > 256 else da._narrow).best_config
        return (f"splits={splits}, " + ", ".join(f"{k}={v}" for k, v in best.kwargs.items())
                + f", warps={best.num_warps}, stages={best.num_stages}")

    mla, gqa = ("mla", 128, 1, 576, 512), ("gqa", 32, 8, 128, 128)
    # the K3 DSpark drafter's paged pass (models/dspark_drafter.PagedDraftContext): 8 block slots x 96 heads as the
    # query heads of one decode row over the latent pool
    drafter = ("mla", 768, 1, 576, 512)
    cases = ([(*shape, B, 4096) for shape in (mla, gqa) for B in (1, 16, 64)] + [(*mla, 1, 32768), (*gqa, 1, 32768)]
             + [(*drafter, B, 8192) for B in (1, 16)])
    page = 16
    if quick:
        mla, gqa = ("mla", 8, 1, 48, 32), ("gqa", 4, 2, 16, 16)
        cases = ([(*shape, B, 40) for shape in (mla, gqa) for B in (1, 3)] + [(*mla, 1, 200), (*gqa, 1, 200)]
                 + [("mla", 32, 1, 48, 32, 2, 60)])
    rows = []
    for name, H, Hk, D, Dv, B, ctx in cases:
        nblk = -(-ctx // page)
        kv_bytes = B * ctx * Hk * (D if name == "mla" else D + Dv) * (2 if dtype == torch.bfloat16 else 4)
        copies = 1 if quick else max(1, min(16, -(-(256 << 20) // kv_bytes)))
        caches = []
        for _ in range(copies):
            k_cache = torch.randn(B * nblk + 1, page, Hk, D, device=dev, dtype=dtype)
            caches.append((k_cache, k_cache[..., :Dv] if name == "mla" else torch.randn_like(k_cache[..., :Dv])))
        k_cache, v_cache = caches[0]
        bt = torch.randperm(B * nblk, device=dev).view(B, nblk)
        cl = torch.full((B,), ctx, device=dev)
        q = torch.randn(B, H, D, device=dev, dtype=dtype)
        out = paged_decode_attention(q, k_cache, v_cache, bt, cl, D ** -0.5)
        kf = k_cache[bt].reshape(B, nblk * page, Hk, D)[:, :ctx].float()  # [B, L, Hk, D]
        vf = v_cache[bt].reshape(B, nblk * page, Hk, Dv)[:, :ctx].float()
        qg = q.float().view(B, Hk, H // Hk, D)  # query heads grouped by KV head, no repeated K/V
        p = (torch.einsum("bkgd,blkd->bkgl", qg, kf) * D ** -0.5).softmax(-1)
        ref = torch.einsum("bkgl,blkd->bkgd", p, vf).reshape(B, H, Dv)
        err = (out.float() - ref).abs().max().item()
        del kf, vf, p, ref
        calls = [lambda kc=kc, vc=vc: paged_decode_attention(q, kc, vc, bt, cl, D ** -0.5) for kc, vc in caches]
        us = _time_replayed_us(calls, dev, reps)
        nbytes = kv_bytes + 2 * B * H * D * k_cache.element_size()
        rows.append({"kernel": f"decode attention {name}", "shape": f"B={B} H={H} Hk={Hk} D={D} Dv={Dv} "
                     f"ctx={ctx} ({launch(name, B, H, Hk, D, Dv, nblk * page, k_cache.element_size())})", "max_err": err,
                     "us": us, "bytes": nbytes, "bw_fraction": nbytes / (us * 1e-6) / bw})
        print(json.dumps(rows[-1]), flush=True)
        del caches, calls, k_cache, v_cache
    return rows


def check_moe(dev, dtype, quick: bool, bw: float, reps: int) -> list[dict]:
    from tokenfab.kernels.gpu.moe import fused_moe
    from tokenfab.layers.moe import RoutedExperts
    E, k, hidden, inter = (64, 8, 7168, 2048) if not quick else (8, 2, 32, 16)
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.device("meta"):  # no host allocation of the float32 placeholders; real weights set below
        ref = RoutedExperts(E, hidden, inter)
    ref.w13 = torch.nn.Parameter(torch.randn(E, 2 * inter, hidden, device=dev, dtype=dtype, generator=g) * 0.02,
                                 requires_grad=False)
    ref.w2 = torch.nn.Parameter(torch.randn(E, hidden, inter, device=dev, dtype=dtype, generator=g) * 0.02,
                                requires_grad=False)
    ref.use_grouped_mm = False
    rows = []
    for T in ([1, 16, 64] if not quick else [1, 5]):
        x = torch.randn(T, hidden, device=dev, dtype=dtype, generator=g)
        ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(T)])
        w = torch.rand(T, k, device=dev, generator=g)
        got = fused_moe(x, ref.w13, ref.w2, w, ids, None)  # None: SiLU-GLU in the GEMM's epilogue, as served
        os.environ["TOKENFAB_TRITON"], saved = "0", os.environ.get("TOKENFAB_TRITON")
        try:
            want = ref(x, w, ids)
        finally:
            os.environ.pop("TOKENFAB_TRITON") if saved is None else os.environ.__setitem__("TOKENFAB_TRITON", saved)
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        us = _time_us(lambda: fused_moe(x, ref.w13, ref.w2, w, ids, None), dev, reps)
        hit = int(ids.unique().numel())
        nbytes = hit * 3 * hidden * inter * x.element_size()
        rows.append({"kernel": "fused MoE", "shape": f"T={T} E={E} k={k} hidden={hidden} I={inter} experts_hit={hit}",
                     "max_err": err, "us": us, "bytes": nbytes, "bw_fraction": nbytes / (us * 1e-6) / bw})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _packed_expert_stack(fmt: str, E: int, n: int, kk: int, dev, g, dtype, chunk: int = 8, parts: int = 1):
    """A random INT4 group-32 / MXFP4 / FP8 block-scaled stack [E, n, kk] (packed_moe.py's layouts; FP8 rows in
    ``parts`` parts scaled apart) and its dequantized weights in ``dtype``, built ``chunk`` experts at a time (the
    int32 codes of a whole stack would take 4 bytes a weight)."""
    if fmt == "fp8_block":
        part, cb = n // parts, lambda v: -(-v // 128)  # noqa: E731
        packed = torch.randint(0, 256, (E, n, kk), device=dev, generator=g, dtype=torch.int32).to(torch.uint8)
        packed[(packed & 0x7F) == 0x7F] = 0x7E  # no NaN codes, as checkpoints
        scale = torch.rand(E, parts * cb(part), cb(kk), device=dev, generator=g) * 2e-4 + 1e-5
        r = torch.arange(n, device=dev)
        brow = (r // part) * cb(part) + (r % part) // 128
        bcol = torch.arange(kk, device=dev) // 128
        w = torch.empty(E, n, kk, dtype=dtype, device=dev)
        for e0 in range(0, E, chunk):
            e1 = min(E, e0 + chunk)
            w[e0:e1] = (packed[e0:e1].view(torch.float8_e4m3fn).float()
                        * scale[e0:e1][:, brow][:, :, bcol]).to(dtype)
        return packed, scale, w
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       device=dev)
    per = 8 if fmt == "int4_group" else 2
    packed = torch.empty(E, n, kk // per, dtype=torch.int32 if per == 8 else torch.uint8, device=dev)
    scale = torch.empty(E, n, kk // 32, dtype=torch.bfloat16 if per == 8 else torch.uint8, device=dev)
    w = torch.empty(E, n, kk, dtype=dtype, device=dev)
    for e0 in range(0, E, chunk):
        e1 = min(E, e0 + chunk)
        code = torch.randint(0, 16, (e1 - e0, n, kk), device=dev, generator=g, dtype=torch.int32)
        if per == 8:
            packed[e0:e1] = (code.view(e1 - e0, n, kk // 8, 8)
                             << (4 * torch.arange(8, device=dev, dtype=torch.int32))).sum(-1, dtype=torch.int32)
            scale[e0:e1] = (torch.rand(e1 - e0, n, kk // 32, device=dev, generator=g) * 0.004).to(torch.bfloat16)
            w[e0:e1] = ((code - 8).float() * scale[e0:e1].float().repeat_interleave(32, -1)).to(dtype)
        else:
            packed[e0:e1] = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
            scale[e0:e1] = torch.randint(118, 122, (e1 - e0, n, kk // 32), device=dev, generator=g).to(torch.uint8)
            w[e0:e1] = (lut[code] * torch.exp2(scale[e0:e1].float() - 127).repeat_interleave(32, -1)).to(dtype)
        del code
    return packed, scale, w


def check_packed_moe(dev, dtype, quick: bool, bw: float, reps: int) -> list[dict]:
    """The fused MoE over packed expert stacks (kernels/gpu/packed_moe.py) at 1, 16 and 64 tokens at two expert
    shapes: DeepSeek-V3's (64 of its routed experts, top-8, hidden 7168, intermediate 2048) in INT4 group-32, MXFP4
    and FP8 block-scaled (re-laid only; skipped past OPTIONAL_ROWS_BEFORE_S), and Kimi K3's latent MoE (128 of its 896
    experts, top-16, latent 3584 in and out, intermediate 3072: benchmarks/gpu_shapes.py's k3) in MXFP4. A 1-token call
    reads 180 MB (DeepSeek-V3, 8 experts) or 280 MB (K3, 16 experts) of packed weights. Each row: error against the bf16
    fused MoE on the same dequantized weights (relative to its largest output), time per call (the first call autotunes
    and is not timed), GB/s and the fraction of the copy bandwidth over the packed bytes (weights and scales) of the
    distinct experts hit; then the bf16 fused MoE on the dequantized weights of that shape and batch (bytes: its bf16
    experts hit). Each format runs twice: in the checkpoint layout and re-laid (kernels/gpu/moe_relayout.py, what a GPU
    load gives).
    """
    from tokenfab.kernels.gpu.moe import fused_moe
    from tokenfab.kernels.gpu.moe_relayout import relayout_fp8, relayout_int4, relayout_mxfp4
    from tokenfab.kernels.gpu.packed_moe import fused_moe_packed
    # the activation as the engine runs it, in the gate|up GEMM's epilogue: SiLU-GLU (None), K3's SiTU-GLU
    # (benchmarks/configs/kimi-k3-shape.json's betas)
    acts = {"DeepSeek-V3": None, "K3 latent": ("situ", 1.5, 2.0)}
    shapes = [("DeepSeek-V3", 64, 8, 7168, 2048, ("int4_group", "mxfp4", "fp8_block")),
              ("K3 latent", 128, 16, 3584, 3072, ("mxfp4",))]
    tokens = [1, 16, 64]
    if quick:
        shapes = [("DeepSeek-V3", 8, 2, 64, 32, ("int4_group", "mxfp4", "fp8_block")),
                  ("K3 latent", 6, 4, 96, 64, ("mxfp4",))]
        tokens = [1, 5]
    relays = {"int4_group": relayout_int4, "mxfp4": relayout_mxfp4, "fp8_block": relayout_fp8}
    reps = max(2, min(reps, 10))
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, E, k, hidden, inter, fmts in shapes:
        timed_bf16 = set()
        for fmt in fmts:
            if fmt == "fp8_block" and not quick and time.monotonic() - _T0 > OPTIONAL_ROWS_BEFORE_S:
                print(json.dumps({"skipped": f"fused MoE {fmt} ({name}): past {OPTIONAL_ROWS_BEFORE_S:.0f} s"}),
                      flush=True)
                continue
            p13, s13, w13 = _packed_expert_stack(fmt, E, 2 * inter, hidden, dev, g, dtype, parts=2)
            p2, s2, w2 = _packed_expert_stack(fmt, E, hidden, inter, dev, g, dtype)
            per_expert = sum(t.numel() * t.element_size() // E for t in (p13, s13, p2, s2))
            relay = relays[fmt]  # the layout a GPU load gives them
            layouts = [("", (p13, s13, p2, s2), False), (" re-laid", (*relay(p13, s13), *relay(p2, s2)), True)]
            if fmt == "fp8_block":  # the checkpoint layout's figures are issue #31's table: the re-laid rows only
                layouts = layouts[1:]
            for T in tokens:
                x = torch.randn(T, hidden, device=dev, dtype=dtype, generator=g)
                ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(T)])
                wts = torch.rand(T, k, device=dev, generator=g)
                want = fused_moe(x, w13, w2, wts, ids, acts[name])
                hit = int(ids.unique().numel())
                shape = f"{name}: T={T} E={E} k={k} hidden={hidden} I={inter} experts_hit={hit}"
                nbytes = hit * per_expert
                for label, stacks, relaid in layouts:
                    def run():
                        return fused_moe_packed(x, fmt, *stacks, wts, ids, acts[name], relaid=relaid)
                    got = run()
                    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                    us = _time_us(run, dev, reps)
                    rows.append({"kernel": f"fused MoE {fmt}{label}", "shape": f"{shape} ({nbytes / us * 1e-3:,.0f}"
                                 " GB/s)", "max_err": err, "us": us, "bytes": nbytes, "GBps": nbytes / us * 1e-3,
                                 "bw_fraction": nbytes / (us * 1e-6) / bw})
                    print(json.dumps(rows[-1]), flush=True)
                if T not in timed_bf16:  # the bf16 kernel's time does not depend on which format was dequantized
                    timed_bf16.add(T)
                    us = _time_us(lambda: fused_moe(x, w13, w2, wts, ids, acts[name]), dev, reps)
                    nbytes = hit * 3 * hidden * inter * w13.element_size()
                    rows.append({"kernel": f"fused MoE {str(dtype).replace('torch.', '')} (dequantized weights)",
                                 "shape": f"{shape} ({nbytes / us * 1e-3:,.0f} GB/s)", "max_err": 0.0, "us": us,
                                 "bytes": nbytes, "GBps": nbytes / us * 1e-3, "bw_fraction": nbytes / (us * 1e-6) / bw})
                    print(json.dumps(rows[-1]), flush=True)
            del p13, s13, w13, p2, s2, w2, layouts
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def check_graph_tokens(device: str, quick: bool) -> dict:
    from tokenfab import LLM, SamplingParams
    if quick:  # the interpreted dry run: a tiny random DeepSeek-V3 checkpoint instead of the default model
        import tempfile
        from tokenfab.testing.tiny_checkpoints import make_tiny_checkpoint
        path = make_tiny_checkpoint(os.path.join(tempfile.gettempdir(), "tokenfab-gpu-kernels-tiny"), "deepseek_v3")
    else:
        from tokenfab.default_model import ensure_default_model
        path = ensure_default_model()
    prompts = [[(11 * i + 7 * j) % 500 + 5 for j in range(20 + 9 * i)] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    result = {}
    for label, eager in (("graphs", False), ("eager", True)):
        llm = LLM(path, dtype="float32", device=device, max_model_len=256, max_num_seqs=8, progress=False,
                  enforce_eager=eager)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        graphs = llm.llm_engine.runner.decode_graphs
        result[label] = {"tokens": [o.outputs[0].token_ids for o in outs],
                         "replays": 0 if graphs is None else graphs.replays}
        del llm
    result["identical"] = result["graphs"]["tokens"] == result["eager"]["tokens"]
    # the check means something only if the graph side replayed and the eager side did not
    result["passed"] = result["identical"] and result["graphs"]["replays"] > 0 and result["eager"]["replays"] == 0
    print(json.dumps({"graph_tokens_identical": result["identical"], "graph_replays": result["graphs"]["replays"],
                      "eager_replays": result["eager"]["replays"], "passed": result["passed"]}), flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu for an interpreted dry run")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gpu"),
                    help="folder for gpu-kernels.{json,md} (default: benchmarks/results/gpu)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (the interpreted dry run)")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per kernel shape, best kept (default: 20)")
    ap.add_argument("--kda-fla", action="store_true", help="also run fla-core's chunk_kda in the KDA check (its "
                    "first call autotunes tens of configs: allow a minute or two)")
    ap.add_argument("--only-kda", action="store_true", help="run only the KDA check (no other kernels, no graphs)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("gpu_kernels.py: no CUDA/ROCm device is visible to this torch; on CPU use the dry run in the "
              "docstring (--device cpu --quick with TRITON_INTERPRET=1 TOKENFAB_TRITON=interpret).", file=sys.stderr)
        return 2
    from tokenfab.kernels.gpu import support as triton_support
    if not triton_support.applies(torch.empty(0, device=dev)):
        print(f"gpu_kernels.py: the Triton kernels do not run on {dev} here (triton missing, TOKENFAB_TRITON=0, or "
              "on CPU without TRITON_INTERPRET=1 TOKENFAB_TRITON=interpret).", file=sys.stderr)
        return 2
    dry = dev.type != "cuda"
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the interpreter has no bf16
    bw = copy_bandwidth(64 << 20 if args.quick else 1 << 30, device=str(dev))
    print(json.dumps({"copy_bandwidth_GBps": bw / 1e9}), flush=True)
    rows = [] if args.only_kda else (
        check_attention(dev, dtype, args.quick, bw, args.reps) + check_moe(dev, dtype, args.quick, bw, args.reps)
        + check_gguf(dev, dtype, args.quick, bw, args.reps) + check_fp8(dev, dtype, args.quick, bw, args.reps)
        + check_packed_moe(dev, dtype, args.quick, bw, args.reps)
        + check_norm_activation(dev, dtype, args.quick, bw, args.reps)
        + check_decode_glue(dev, dtype, args.quick, bw, args.reps)
        + check_gguf_kquants(dev, dtype, args.quick, bw, args.reps))
    rows += check_kda(dev, args.quick, bw, args.reps, args.kda_fla)
    graph = None if args.only_kda else check_graph_tokens(args.device, args.quick)
    os.makedirs(args.out, exist_ok=True)
    env_vars = " ".join(f"{k}={os.environ[k]}" for k in ("TRITON_INTERPRET", "TOKENFAB_TRITON",
                                                           "TOKENFAB_DECODE_GRAPHS") if k in os.environ)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "dtype": str(dtype), "dry_run": dry, "copy_bandwidth_GBps": bw / 1e9,
           "command": " ".join(([env_vars] if env_vars else []) + [os.path.relpath(sys.executable)] + sys.argv)}
    with open(os.path.join(args.out, "gpu-kernels.json"), "w") as f:
        json.dump({"env": env, "kernels": rows, "graph_tokens": graph}, f, indent=1)
    title = (f"# Triton kernels: DRY RUN in Triton's interpreter on CPU ({dtype}; times mean nothing)" if dry else
             f"# Triton kernels on {env['device']} ({dtype}, copy bandwidth {bw / 1e9:.0f} GB/s)")
    lines = [title, "", f"Command: `{env['command']}`", "",
             "Max error: absolute for attention (against a float32 gather-and-softmax), relative to the largest "
             "reference output for the MoE (against RoutedExperts' PyTorch loop), the GGUF linears (against "
             "GGUFWeight's dequantize-and-F.linear path), the FP8 linears (against the dequantized weight's float32 "
             "product; the scaled_mm path against its own formula with the activation quantized per 1 x 128 block; "
             "packed linears' µs from CUDA-graph replays) and, for KDA, to the largest output or state entry of "
             "layers/kda.py (float32).", "",
             "| kernel | shape | max error | µs | bytes | GB/s | of copy bandwidth |",
             "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['kernel']} | {r['shape']} | {r['max_err']:.2e} | {r['us']:.1f} | {r['bytes']:,} | "
              f"{r['bytes'] / r['us'] / 1e3:,.0f} | {r['bw_fraction']:.0%} |" for r in rows]
    side = "padded graph buffers without capture" if dry else "decode CUDA graphs"
    if graph is not None:
        lines += ["", f"Greedy tokens with {side} vs enforce_eager (float32, 5 prompts x 24 tokens): "
                  f"{'identical' if graph['identical'] else 'DIFFERENT'}; replays {graph['graphs']['replays']} with "
                  f"graphs, {graph['eager']['replays']} eager: {'PASS' if graph['passed'] else 'FAIL'}."]
    with open(os.path.join(args.out, "gpu-kernels.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    bad = [r for r in rows if r["max_err"] > (0.05 if dev.type == "cuda" else 1e-4)]
    return 1 if bad or (graph is not None and not graph["passed"]) else 0


if __name__ == "__main__":
    sys.exit(main())
