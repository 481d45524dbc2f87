"""The Triton GGUF Q8_0 / Q4_0 / Q4_1 kernel (kernels/gpu/gguf_linear.py) and the K-quant kernels
(kernels/gpu/gguf_kquant_linear.py) in Triton's interpreter on CPU: they read
the same packed tiles as the CPU kernels, and its products are checked against the float64 product of gguf-py's own
dequantized weights within the float32 accumulation bound that tests/test_gguf_linear.py derives (the interpreter
has no bfloat16, so float32 activations; on a GPU the same code loads bf16). GGUFWeight.linear takes it wherever
Triton applies, and the whole packed model gives the reference path's greedy tokens through it.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from test_gguf_kquants import KTYPES, random_kblocks
from test_gguf_kquants import check_close as kcheck, exact as kexact
from test_gguf_linear import TYPES, check_close, exact, quantized, random_blocks
from tokenfab.kernels.gpu import support as triton_support
from tokenfab.quant import gguf_blocks
from tokenfab.quant.gguf_weight import GGUFWeight

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


def kernel_product(raw: np.ndarray, name: str, K: int, out_features: int, rows: int, dtype: torch.dtype,
                   split: int | None):
    """(x, y, bias): ``rows`` random activations in ``dtype`` (a random bias on odd row counts) times the GGUF rows
    ``raw`` through the Triton kernel with ``split``; y's shape and dtype checked."""
    from tokenfab.kernels.gpu.gguf_linear import gguf_linear
    w = GGUFWeight.from_rows(torch.from_numpy(np.ascontiguousarray(raw)), name, K)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, K, generator=g).to(dtype)
    bias = torch.randn(out_features, generator=g) if rows % 2 else None
    y = gguf_linear(x, w.tiles, w.block, out_features, bias, split=split)
    assert y.shape == (rows, out_features) and y.dtype == dtype
    return x, y, bias


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows,out_features,source", [(1, 48, "quantize"), (5, 40, "random"), (23, 33, "quantize"),
                                                       (70, 16, "random")])
def test_kernel_matches_exact_product(interpret, name, rows, out_features, source):
    from tokenfab.kernels.gpu.gguf_linear import gguf_linear
    K = 96
    raw = (quantized if source == "quantize" else random_blocks)(name, out_features, K, seed=rows)
    w = GGUFWeight.from_rows(torch.from_numpy(np.ascontiguousarray(raw)), name, K)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, K, generator=g)
    bias = torch.randn(out_features, generator=g) if rows % 2 else None
    y = gguf_linear(x, w.tiles, w.block, out_features, bias)
    assert y.shape == (rows, out_features) and y.dtype == torch.float32
    check_close(y, x, raw, name, bias)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows,out_features,K,split", [(1, 100, 352, 4), (3, 33, 160, 2), (17, 70, 96, 3),
                                                       (70, 48, 288, None), (1, 40, 544, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_and_bf16_match_exact_product(interpret, name, rows, out_features, K, split, dtype):
    """Odd shapes (partial tiles, 3 .. 17 blocks of 32), M = 1 .. 70, forced K slices (split-K with the ordered
    reduction; a split that would leave a slice empty is lowered) and the chosen one, float32 and bf16 activations
    (bf16 output: the bound plus one bf16 rounding), against gguf-py's values in float64."""
    # gguf-py's quantizer (random_blocks' tiny Q4_1 minimums can make gguf's float32 d q + m round, which the
    # float64 reference's field check refuses; the test above covers random bytes)
    raw = (random_blocks if name != "Q4_1" else quantized)(name, out_features, K, seed=rows + K)
    x, y, bias = kernel_product(raw, name, K, out_features, rows, dtype, split)
    ye, bound = exact(x.float(), raw, name, bias)
    tol = (3 * K + 64) * 2.0 ** -24 * bound  # tests/test_gguf_linear.py's float32 bound
    if dtype == torch.bfloat16:
        # bf16 activations: Q4 quants enter the dot as 128 + q and the block's 128 d (and m) times the activation
        # sum is taken off after (float32 sums of terms up to |x| d 144 + |m|; up to 16 rows), then one bf16
        # rounding of the output (the interpreter truncates)
        d, m, _ = gguf_blocks._fields(torch.from_numpy(raw), gguf_blocks.block_type(name))
        wmax = d.double().abs().repeat_interleave(32, 1) * 144
        if m is not None:
            wmax = wmax + m.double().abs().repeat_interleave(32, 1)
        tol = tol + (3 * K + 64) * 2.0 ** -24 * (x.double().abs() @ wmax.T) + 2.0 ** -7 * ye.abs()
        if rows > 16:  # tiles of 32+ rows dequantize the weights to bf16 in registers: one rounding per weight
            tol = tol + 2.0 ** -8 * bound
    assert ((y.double() - ye).abs() <= tol).all(), (y.double() - ye).abs().max()


def test_split_results_are_identical_run_to_run(interpret):
    """The K slices are summed in a fixed order: the same bits on every run, with leading dimensions kept."""
    from tokenfab.kernels.gpu.gguf_linear import gguf_linear
    raw = quantized("Q4_1", 40, 320, seed=5)
    w = GGUFWeight.from_rows(torch.from_numpy(np.ascontiguousarray(raw)), "Q4_1", 320)
    x = torch.randn(2, 3, 320, generator=torch.Generator().manual_seed(5))
    a = gguf_linear(x, w.tiles, w.block, 40, split=4)
    assert a.shape == (2, 3, 40) and torch.equal(a, gguf_linear(x, w.tiles, w.block, 40, split=4))
    check_close(a.reshape(6, 40), x.reshape(6, 320), raw, "Q4_1", None)


def test_linear_dispatches_to_triton_only_where_it_applies(interpret, monkeypatch):
    """GGUFWeight.linear: the Triton kernel where triton_support.applies and the CPU kernel does not (GPU tiles; here
    the interpreter with the CPU kernel off), else the reference path. Shown by making the Triton entry point raise:
    it is reached in interpret mode and never with TOKENFAB_TRITON=0."""
    from tokenfab.kernels.gpu import gguf_linear as triton_gguf_linear
    monkeypatch.setenv("TOKENFAB_CPU_LINEAR", "torch")
    raw = quantized("Q4_1", 32, 64)
    w = GGUFWeight.from_rows(torch.from_numpy(np.ascontiguousarray(raw)), "Q4_1", 64)
    w.prepare()
    x = torch.randn(3, 64)
    ref = w.reference_linear(x, None)

    def boom(*a, **k):
        raise RuntimeError("triton path taken")
    monkeypatch.setattr(triton_gguf_linear, "gguf_linear", boom)
    with pytest.raises(RuntimeError, match="triton path taken"):
        w.linear(x, None)
    monkeypatch.setenv("TOKENFAB_TRITON", "0")
    torch.testing.assert_close(w.linear(x, None), ref, rtol=1e-5, atol=1e-5)


def test_refuses_block_types_and_mismatched_tiles(interpret):
    from tokenfab.kernels.gpu.gguf_linear import gguf_linear
    raw = quantized("Q8_0", 16, 64)
    w = GGUFWeight.from_rows(torch.from_numpy(np.ascontiguousarray(raw)), "Q8_0", 64)
    with pytest.raises(ValueError, match=r"\[16, 96\]"):
        gguf_linear(torch.randn(2, 96), w.tiles, w.block, 16)


def test_packed_model_through_the_triton_kernel(interpret, monkeypatch, tiny_model, tokenizer_dir, tmp_path):
    """A tiny llama GGUF (mixed Q4_0 / Q4_1 / Q8_0 linears, Q8_0 embedding and head) served packed with every linear
    in the Triton kernel (interpreted; the CPU kernel off): the same greedy tokens as the dequantized reference
    folder, and prompt logprobs within 1e-4 of it."""
    from test_gguf_packed_loader import MIXED, reference_folder, write_gguf
    from conftest import max_prompt_logprob_gap
    from tokenfab import LLM, SamplingParams
    from tokenfab.kernels.gpu import gguf_linear as triton_gguf_linear
    ckpt = tiny_model("llama")
    path = str(tmp_path / "tiny.gguf")
    ref = reference_folder(ckpt, str(tmp_path / "ref"), write_gguf(ckpt, path, MIXED))
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 33, 200, 7], [9, 4, 300])]
    sp = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6, prompt_logprobs=0)
    calls = []
    real = triton_gguf_linear.gguf_linear
    monkeypatch.setattr(triton_gguf_linear, "gguf_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    outs = {}
    for key, model in (("reference", ref), ("packed", path)):
        if key == "packed":
            monkeypatch.setenv("TOKENFAB_CPU_LINEAR", "torch")
        llm = LLM(model, dtype="float32", tokenizer=tokenizer_dir, max_model_len=64, progress=False)
        outs[key] = llm.generate(prompts, sp, use_tqdm=False)
    assert calls, "the Triton kernel never ran"
    assert [o.outputs[0].token_ids for o in outs["packed"]] == [o.outputs[0].token_ids for o in outs["reference"]]
    assert max_prompt_logprob_gap(outs["reference"], outs["packed"], "Triton GGUF") < 1e-4


def kquant_factors(raw: np.ndarray, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) [n, K] float64 per weight, value = a q - b (Q4_K / Q5_K: a = d sc, b = dmin m, gguf's own
    ``get_scale_min``) or a (q - 32) (Q6_K: a = d scale, b = 0), from the file's bytes."""
    from gguf.quants import Q4_K
    from tokenfab.quant import gguf_kquants
    sb = gguf_kquants.SUPER_BYTES[name]
    n = raw.shape[0]
    blocks = raw.reshape(-1, sb)
    f16 = lambda b: b.copy().view(np.float16).astype(np.float64)  # noqa: E731
    if name == "Q6_K":
        a = f16(blocks[:, 208:210]) * blocks[:, 192:208].copy().view(np.int8).astype(np.float64)  # [blocks, 16]
        return torch.from_numpy(np.repeat(a, 16, axis=1).reshape(n, -1)), torch.zeros(n, raw.shape[1] // sb * 256,
                                                                                         dtype=torch.float64)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
    a = f16(blocks[:, 0:2]) * sc.reshape(-1, 8).astype(np.float64)
    b = f16(blocks[:, 2:4]) * mn.reshape(-1, 8).astype(np.float64)
    return (torch.from_numpy(np.repeat(a, 32, axis=1).reshape(n, -1)),
            torch.from_numpy(np.repeat(b, 32, axis=1).reshape(n, -1)))


@pytest.mark.parametrize("name", KTYPES)
@pytest.mark.parametrize("rows,out_features,K,split,dtype", [
    (1, 40, 512, None, torch.float32), (1, 100, 768, 4, torch.bfloat16), (1, 20, 512, 3, torch.float32),
    (3, 33, 768, 2, torch.float32), (5, 40, 512, None, torch.bfloat16), (2, 16, 256, None, torch.float16),
    (17, 20, 256, None, torch.bfloat16), (70, 48, 512, 3, torch.float32), (1, 37, 2304, 5, torch.float32),
    (5, 37, 2304, 7, torch.float32)])
def test_kquant_kernels_match_exact_product(interpret, name, rows, out_features, K, split, dtype):
    """Q4_K / Q5_K / Q6_K (gguf_kquant_linear.py) on random bytes (every quant, high-bit and 6-bit scale pattern):
    one row (the CUDA-core kernel), 2-16 rows (exact quants in the dot, per-half dots for Q6_K), 17+ (weights
    dequantized to the activation dtype in registers), partial tiles, forced K slices that start inside a
    super-block (odd slice lengths: an unrolled step runs past its slice's end), float32 / bf16 / fp16 activations,
    against gguf-py's values in float64. Float32: the K-quant tests' float32 bound. 16-bit: the dot sums x (128 + q) (terms up to |x| (|a| 192 + |b|)) before the factors
    are applied, then one 16-bit rounding of the output (the interpreter truncates: 2^-7 for bf16, 2^-10 fp16)."""
    raw = random_kblocks(name, out_features, K, seed=rows + K)
    x, y, bias = kernel_product(raw, name, K, out_features, rows, dtype, split)
    if dtype == torch.float32:
        kcheck(y, x, raw, name, bias)
        return
    ye, bound = kexact(x.float(), raw, name, bias)
    a, b = kquant_factors(raw, name)
    wmax = a.abs() * 192 + b.abs()
    tol = (3 * K + 64) * 2.0 ** -24 * (bound + x.double().abs() @ wmax.T)
    tol = tol + (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10) * ye.abs()
    if rows > 16:  # weights rounded once to bf16 in registers
        tol = tol + 2.0 ** -8 * bound
    err = (y.double() - ye).abs()
    assert (err <= tol).all(), err.max()
    assert err.max() < 0.05 * ye.abs().max()  # outputs are O(S), far above the tolerance: a wrong quant fails


@pytest.mark.parametrize("name", KTYPES)
def test_kquant_weights_run_the_triton_kernels_and_give_float32_logits(interpret, monkeypatch, name):
    """GGUFWeight.linear / linear_f32 take the Triton K-quant kernels where Triton applies (the interpreter here,
    the CPU kernels off): linear within the float32 bound, and linear_f32 of bf16 activations float32 outputs
    from the accumulator with the exact quants at any row count (no bf16 rounding of the output or of the weights:
    a tolerance without either)."""
    from tokenfab.kernels.gpu import gguf_linear as triton_gguf_linear
    monkeypatch.setenv("TOKENFAB_CPU_LINEAR", "torch")
    raw = random_kblocks(name, 20, 512)
    w = GGUFWeight.from_rows(torch.from_numpy(np.ascontiguousarray(raw)), name, 512)
    w.prepare()
    calls = []
    real = triton_gguf_linear.kquant_launch
    monkeypatch.setattr(triton_gguf_linear, "kquant_launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(3, 512)
    kcheck(w.linear(x, None), x, raw, name, None)
    a, b = kquant_factors(raw, name)
    for rows in (3, 20):  # 20: a 32-row tile, which for a 16-bit output would dequantize the weights to bf16
        xb = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        y = w.linear_f32(xb)
        assert calls and y.dtype == torch.float32
        ye, bound = kexact(xb.float(), raw, name, None)
        tol = 1.01 * (3 * 512 + 64) * 2.0 ** -24 * (bound + xb.double().abs() @ (a.abs() * 192 + b.abs()).T)
        assert ((y.double() - ye).abs() <= tol).all()
        # weights rounded to bf16 (2^-9 of each |w| at worst) moved these outputs by 4e-4 to 9e-4 of S, the exact
        # quants by under 2e-7: 2^-12 S tells them apart
        assert ((y.double() - ye).abs() <= 2.0 ** -12 * bound).all()


def test_gguf_kernels_compile_for_sm90_and_gfx942(interpret):
    """Every GGUF kernel form a GPU launches (bf16 activations: one row, 2-16 rows with exact quants, 32+ rows
    dequantizing, with and without split-K; fp16 and float32 activations on 2-16 rows) of Q4_1 and the three
    K-quants, compiled by Triton's own compiler for NVIDIA sm_90 and AMD gfx942 on this CPU
    (tokenfab/testing/target_compile.py): the interpreter accepts code the compiler refuses."""
    from tokenfab.kernels.gpu.gguf_linear import gguf_linear
    from tokenfab.testing.target_compile import LaunchRecorder, compile_for_targets
    forms = [(torch.bfloat16, 1, 2), (torch.bfloat16, 4, None), (torch.bfloat16, 40, None), (torch.float16, 4, None),
             (torch.float32, 4, None)]
    with LaunchRecorder() as rec:
        for name in ("Q4_1", *KTYPES):
            K = 512
            raw = random_kblocks(name, 40, K) if name in KTYPES else quantized(name, 40, K)
            w = GGUFWeight.from_rows(torch.from_numpy(np.ascontiguousarray(raw)), name, K)
            for dtype, rows, split in forms:
                gguf_linear(torch.randn(rows, K).to(dtype), w.tiles, w.block, 40, split=split)
    # a GPU runs 16-bit activations through the tensor cores' 16-bit dots: the interpreter, which has no exact bf16
    # dot, ran those launches with DOT_F32
    launches = []
    for launch in rec.launches:
        if launch["signature"].get("X") in ("*bf16", "*fp16") and launch["constexprs"].get("DOT_F32"):
            launch = dict(launch, constexprs={**launch["constexprs"], "DOT_F32": False})
        if launch not in launches:
            launches.append(launch)
    assert {"_kq_gemv", "_kq_gemm", "_gguf_gemv", "_gguf_gemm", "_reduce"} <= {v["name"] for v in launches}
    assert {v["signature"]["X"] for v in launches if v["name"] == "_kq_gemm"} == {"*bf16", "*fp16", "*fp32"}
    failures = compile_for_targets(launches)
    assert not failures, "\n".join(f"{f['kernel']} on {f['target']}: {f['error']} (constexprs {f['constexprs']})"
                                   for f in failures)


def test_kquant_model_through_the_triton_kernels(monkeypatch, tiny_model, tokenizer_dir, tmp_path):
    """A tiny qwen3 GGUF with Q4_K / Q5_K / Q6_K linears, a Q6_K embedding and a Q4_K LM head on the GPU code path
    (every choice a GPU makes, the Triton kernels interpreted, no C++ CPU kernels): every linear in the Triton
    K-quant kernels, the head's logits float32 from the kernel, the embedding dequantized where the tiles are, and
    no host read of a device value in a decode step (a CUDA graph captures that forward); the same greedy tokens as
    the folder of gguf-py's dequantized weights, prompt logprobs within 1e-4 of it."""
    from conftest import max_prompt_logprob_gap
    from gguf_helpers import reference_folder
    from test_gguf_qwen import PROMPTS, tiny_qwen, write_qwen_gguf
    from tokenfab import LLM, SamplingParams
    from tokenfab.kernels.cpu import build as cpu_build
    from tokenfab.kernels.gpu import gguf_linear as triton_gguf_linear
    from tokenfab.testing.kernel_count import decode_step_syncs
    ckpt = tiny_qwen(tiny_model, "qwen3")
    path = str(tmp_path / "tiny.gguf")
    ref = reference_folder(ckpt, str(tmp_path / "ref"), write_qwen_gguf(ckpt, path, "qwen3", bf16_kind="none"))
    calls = []
    real = triton_gguf_linear.kquant_launch
    monkeypatch.setattr(triton_gguf_linear, "kquant_launch",
                        lambda x2, y, t, name, *a, **k: calls.append((name, y.dtype)) or real(x2, y, t, name, *a, **k))
    sp = SamplingParams(temperature=0.0, max_tokens=3, min_tokens=3, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": PROMPTS[0]}]
    ref_out = LLM(ref, dtype="float32", tokenizer=tokenizer_dir, max_model_len=64,
                  progress=False).generate(prompts, sp, use_tqdm=False)
    for k, v in (("TRITON_INTERPRET", "1"), ("TOKENFAB_TRITON", "interpret-gpu-path"), ("TOKENFAB_CPU_KERNELS", "0"),
                 ("TOKENFAB_CPU_LINEAR", "torch")):
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(cpu_build, "load", lambda: None)  # a GPU machine has no C++ CPU kernels loaded
    llm = LLM(path, dtype="float32", tokenizer=tokenizer_dir, max_model_len=64, progress=False)
    syncs = []
    with decode_step_syncs(llm, syncs):
        out = llm.generate(prompts, sp, use_tqdm=False)
    assert len(syncs) == 1 and syncs[0]["syncs"] == [] and syncs[0]["launches"] > 0, syncs
    assert {n for n, _ in calls} == set(KTYPES) and ("Q4_K", torch.float32) in calls
    assert out[0].outputs[0].token_ids == ref_out[0].outputs[0].token_ids
    assert max_prompt_logprob_gap(ref_out, out, "Triton K-quant GGUF") < 1e-4
