"""The packed linears of benchmarks/gpu_kernels.py (its step 3, first half): GGUF Q4_1 / Q8_0
(kernels/gpu/gguf_linear.py) and Q4_K / Q6_K (kernels/gpu/gguf_kquant_linear.py) and FP8 block-scaled (kernels/gpu/fp8_linear.py: the Triton kernel and, where its probe
passes, the block-scaled scaled_mm path of kernels/gpu/fp8_scaled_mm.py) at a 4096 x 4096 projection and
DeepSeek-V3's dense 7168 x 18432, 1 / 16 / 64 activation rows: error, device time from CUDA-graph replays, GB/s and
the fraction of the copy bandwidth over the packed bytes, with ``F.linear`` on the dequantized weight alongside. Run
through gpu_kernels.py (its CPU dry run covers these with tiny shapes in Triton's interpreter)."""
from __future__ import annotations

import json
import os

import torch

from benchmarks.gpu_timing import time_graph_us as _time_graph_us


def _linear_row(kernel: str, shape: str, err: float, timed: tuple[float, str], nbytes: int, bw: float) -> dict:
    """One row of the packed-linear checks: error, time, GB/s over ``nbytes`` and the fraction of copy bandwidth."""
    us, how = timed
    row = {"kernel": kernel, "shape": shape, "max_err": err, "us": us, "bytes": nbytes,
           "GBps": nbytes / us / 1e3, "bw_fraction": nbytes / (us * 1e-6) / bw, "timing": how}
    print(json.dumps(row), flush=True)
    return row


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


LINEAR_SHAPES = [(4096, 4096), (7168, 18432)]  # [N, K]: a 4096 model's projection; DeepSeek-V3's dense down_proj
LINEAR_ROWS = [1, 16, 64]


def check_gguf(dev, dtype, quick: bool, bw: float, reps: int) -> list[dict]:
    """The packed GGUF linear (kernels/gpu/gguf_linear.py) at N x K = 4096 x 4096 (Q4_1 and Q8_0) and 7168 x 18432
    (Q4_1: 83 MB packed), 1 / 16 / 64 activation rows (quick: 48 x 96 and 40 x 160, 1 and 3 rows): error against
    GGUFWeight's dequantize-and-F.linear path in float32, time (CUDA-graph replays), GB/s and the fraction of copy
    bandwidth over the packed bytes; alongside, ``F.linear`` on the dequantized weight in the activation dtype (its
    bytes: 2 per weight in bf16). Random GGUF blocks written on the device (small random fp16 scales)."""
    import torch.nn.functional as F
    from tokenfab.kernels.gpu.gguf_linear import gguf_linear
    from tokenfab.quant import gguf_blocks
    from tokenfab.quant.gguf_weight import GGUFWeight
    shapes, ms = (LINEAR_SHAPES, LINEAR_ROWS) if not quick else ([(48, 96), (40, 160)], [1, 3])
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for i, (n, k) in enumerate(shapes):
        for name in ("Q4_1", "Q8_0") if i == 0 else ("Q4_1",):
            bt = gguf_blocks.block_type(name)
            raw = torch.randint(0, 256, (n, k // 32, bt.block_bytes), device=dev, dtype=torch.uint8, generator=g)
            raw[..., 0:2] = (torch.randn(n, k // 32, 1, device=dev, generator=g) * 2e-3).half().view(torch.uint8)
            if bt.has_min:
                raw[..., 2:4] = (torch.randn(n, k // 32, 1, device=dev, generator=g) * 1e-2).half().view(torch.uint8)
            w = GGUFWeight.from_rows(raw.reshape(n, -1), name, k)
            del raw
            twin = w.dequantize_rows(0, n).to(dtype)
            for M in ms:
                x = torch.randn(M, k, device=dev, generator=g).to(dtype)
                want = w.reference_linear(x.float(), None)
                shape = f"M={M} N={n} K={k}"
                err = _rel_err(gguf_linear(x, w.tiles, w.block, n), want)
                rows.append(_linear_row(f"GGUF {name} linear", shape, err,
                                        _time_graph_us(lambda: gguf_linear(x, w.tiles, w.block, n), dev, reps),
                                        w.nbytes, bw))
                err = _rel_err(F.linear(x, twin), want)
                rows.append(_linear_row(f"F.linear {str(dtype).removeprefix('torch.')} (dequantized {name})", shape,
                                        err, _time_graph_us(lambda: F.linear(x, twin), dev, reps),
                                        twin.numel() * twin.element_size(), bw))
            del w, twin
    return rows


KQUANT_ROWS = [1, 16]


def check_gguf_kquants(dev, dtype, quick: bool, bw: float, reps: int) -> list[dict]:
    """Q4_K and Q6_K (kernels/gpu/gguf_kquant_linear.py) at DeepSeek-V3's dense 7168 x 18432 (74 / 108 MB packed),
    1 and 16 rows (quick: 40 x 512, 1 and 3 rows): error against GGUFWeight's dequantizing path, time, bandwidth
    over the packed bytes (the bf16 twin's F.linear at this shape is the Q4_1 rows'). Random super-blocks with
    small random fp16 d (and dmin). gpu_kernels.py runs these rows after its others (their tuning is new time in a
    step with a fixed timeout)."""
    from tokenfab.kernels.gpu.gguf_linear import gguf_linear
    from tokenfab.quant import gguf_kquants
    from tokenfab.quant.gguf_weight import GGUFWeight
    (n, k), ms = (LINEAR_SHAPES[-1], KQUANT_ROWS) if not quick else ((40, 512), [1, 3])
    g = torch.Generator(device=dev).manual_seed(1)
    rows = []
    for name in ("Q4_K", "Q6_K"):
        sb = gguf_kquants.SUPER_BYTES[name]
        raw = torch.randint(0, 256, (n, k // 256, sb), device=dev, dtype=torch.uint8, generator=g)
        heads = (208, 1) if name == "Q6_K" else (0, 2)  # byte offset and count of the fp16 d (and dmin)
        f16 = (torch.randn(n, k // 256, heads[1], device=dev, generator=g) * 1e-3).half()
        raw[..., heads[0]:heads[0] + 2 * heads[1]] = f16.view(torch.uint8)
        w = GGUFWeight.from_rows(raw.reshape(n, -1), name, k)
        del raw
        for M in ms:
            x = torch.randn(M, k, device=dev, generator=g).to(dtype)
            want = w.reference_linear(x.float(), None)
            err = _rel_err(gguf_linear(x, w.tiles, w.block, n), want)
            rows.append(_linear_row(f"GGUF {name} linear", f"M={M} N={n} K={k}", err,
                                    _time_graph_us(lambda: gguf_linear(x, w.tiles, w.block, n), dev, reps),
                                    w.nbytes, bw))
        del w
    return rows


def check_fp8(dev, dtype, quick: bool, bw: float, reps: int) -> list[dict]:
    """The FP8 block-scaled linear (kernels/gpu/fp8_linear.py) at N x K = 4096 x 4096 and 7168 x 18432 (132 MB of
    e4m3), 1 / 16 / 64 rows (quick: 200 x 200 and 136 x 300, partial blocks, 1 and 3 rows): the Triton kernel (the
    activation exact; error against the dequantized weight's float32 product) and, where its probe passes, the
    block-scaled scaled_mm path (kernels/gpu/fp8_scaled_mm.py; error against its own formula, the activation
    quantized per 1 x 128 block: the probe's verdict is printed either way), time (CUDA-graph replays), GB/s and the
    fraction of copy bandwidth over the FP8 bytes with their scales; alongside, ``F.linear`` on the dequantized
    weight in the activation dtype."""
    import torch.nn.functional as F
    from tokenfab.kernels.gpu import fp8_scaled_mm
    from tokenfab.kernels.gpu.fp8_linear import fp8_block_linear
    shapes, ms = (LINEAR_SHAPES, LINEAR_ROWS) if not quick else ([(200, 200), (136, 300)], [1, 3])
    g = torch.Generator(device=dev).manual_seed(0)
    probe = fp8_scaled_mm.probe_result(dev) if dev.type == "cuda" else "CPU dry run"
    print(json.dumps({"fp8_scaled_mm_probe": probe or "passed"}), flush=True)
    env = os.environ.get(fp8_scaled_mm.ENV)
    rows = []
    for n, k in shapes:
        w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.float8_e4m3fn)
        s = torch.rand(-(-n // 128), -(-k // 128), device=dev, generator=g) + 0.5
        wd = w.float() * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        twin = wd.to(dtype)
        mm_scale = fp8_scaled_mm.weight_scale_layout(s) if probe is None else None
        nbytes = n * k + s.numel() * 4
        for M in ms:
            x = torch.randn(M, k, device=dev, generator=g).to(dtype)
            want = x.float() @ wd.T
            shape = f"M={M} N={n} K={k}"
            os.environ[fp8_scaled_mm.ENV] = "triton"
            try:
                err = _rel_err(fp8_block_linear(x, w, s), want)
                timed = _time_graph_us(lambda: fp8_block_linear(x, w, s), dev, reps)
            finally:
                if env is None:
                    del os.environ[fp8_scaled_mm.ENV]
                else:
                    os.environ[fp8_scaled_mm.ENV] = env
            rows.append(_linear_row("FP8 block linear (Triton)", shape, err, timed, nbytes, bw))
            if probe is None and fp8_scaled_mm.applies(x, n, k):
                got = fp8_block_linear(x, w, s, mm_scale=mm_scale)
                err = _rel_err(got, fp8_scaled_mm.reference(x, w, s))
                row = _linear_row("FP8 block linear (scaled_mm, 1x128 e4m3 activation)", shape, err,
                                  _time_graph_us(lambda: fp8_block_linear(x, w, s, mm_scale=mm_scale), dev, reps),
                                  nbytes, bw)
                row["err_vs_exact_activation"] = _rel_err(got, want)
                rows.append(row)
            err = _rel_err(F.linear(x, twin), want)
            rows.append(_linear_row(f"F.linear {str(dtype).removeprefix('torch.')} (dequantized FP8)", shape, err,
                                    _time_graph_us(lambda: F.linear(x, twin), dev, reps),
                                    twin.numel() * twin.element_size(), bw))
        del w, wd, twin
    return rows
