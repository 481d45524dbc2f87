"""A GGUF file's routed experts kept packed (tokenfab/quant/gguf_experts.py) against the same weights dequantized
into the engine's dense expert stacks, one MoE layer at Qwen3-30B-A3B's shape, side by side.

    .venv/bin/python benchmarks/gguf_experts.py [--experts 128] [--top-k 8] [--tokens 1,4,16] [--reps 5]
        [--dtype auto|float32|bfloat16] [--threads N] [--tag NAME]

The layer: hidden 2048, expert intermediate 768, ``--experts`` experts; gate / up Q4_K and down Q6_K (a Q4_K_M
file's usual types) as random blocks with small fp16 scales; the dense twin holds gguf's dequantized values in
``--dtype`` (auto: what the engine picks on this CPU, float32 without AVX512-BF16). Each pass routes ``--tokens``
tokens to ``--top-k`` random experts (seeded, the same for both) and runs RoutedExperts.forward; the two alternate
pass by pass, best of ``--reps``. One layer of each is above the last-level cache (Q4_K/Q6_K: ~390 MB; float32:
~2.4 GB), so a pass streams its experts from memory as a decode step does. Reported: ms per layer, the bytes of the
experts a pass touches per ms, and the packed time over the dense time.
Writes <out>/<date>-gguf-experts[-<tag>].{json,md} (default benchmarks/results).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.results_file import unused_stem, write_lines  # noqa: E402

H, I = 2048, 768


def random_kblocks(name: str, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """K-quant rows [n, k / 256 * super bytes] uint8 of random bytes with small finite fp16 d (and dmin)."""
    from tokenfab.quant import gguf_kquants
    sb = gguf_kquants.SUPER_BYTES[name]
    raw = torch.randint(0, 256, (n, k // 256, sb), dtype=torch.uint8, generator=g)
    scales = (torch.randn(n, k // 256, 1 if name == "Q6_K" else 2, generator=g) * 2e-4).half().view(torch.uint8)
    if name == "Q6_K":
        raw[..., 208:210] = scales
    else:
        raw[..., 0:4] = scales
    return raw.reshape(n, -1)


def make_pair(E: int, dtype: torch.dtype, g: torch.Generator):
    """(packed layer, dense layer, packed bytes, dense bytes): RoutedExperts of E experts, gate|up Q4_K and down
    Q6_K in GGUFExperts stacks, and the same values dequantized in ``dtype`` stacks; both prepared (fuse())."""
    from tokenfab.layers.moe import RoutedExperts
    from tokenfab.quant.gguf_weight import GGUFWeight

    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        packed, dense = RoutedExperts(E, H, I), RoutedExperts(E, H, I)
    finally:
        torch.set_default_dtype(prev)
    packed.use_packed("gguf")
    for e in range(E):
        gate, up = (GGUFWeight.from_rows(random_kblocks("Q4_K", I, H, g), "Q4_K", H) for _ in range(2))
        down = GGUFWeight.from_rows(random_kblocks("Q6_K", H, I, g), "Q6_K", I)
        packed.q13.load_part(e, 0, "weight", gate, "gate")
        packed.q13.load_part(e, I, "weight", up, "up")
        packed.q2.load_part(e, 0, "weight", down, "down")
        dense.w13.data[e, :I] = gate.dequantize().to(dtype)
        dense.w13.data[e, I:] = up.dequantize().to(dtype)
        dense.w2.data[e] = down.dequantize().to(dtype)
    packed.fuse()
    dense_bytes = dense.w13.numel() * dense.w13.element_size() * 3 // 2
    dense.fuse()
    return packed, dense, packed.q13.nbytes + packed.q2.nbytes, dense_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--tag", default="", help="suffix of the result files' name")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from tokenfab.engine.engine_config import resolve_dtype
    dtype = resolve_dtype(a.dtype, torch.device("cpu"), False)
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    packed, dense, pb, db = make_pair(a.experts, dtype, g)
    print(f"layers built in {time.perf_counter() - t0:.0f} s: packed {pb / 1e6:.0f} MB, dense ({dtype}) "
          f"{db / 1e6:.0f} MB", flush=True)
    rows = []
    for T in [int(t) for t in a.tokens.split(",")]:
        x = torch.randn(T, H, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(a.experts, generator=g)[:a.top_k] for _ in range(T)])
        w = torch.full((T, a.top_k), 1.0 / a.top_k)
        touched = len(torch.unique(ids))
        best = {"packed": float("inf"), "dense": float("inf")}
        with torch.no_grad():
            ref, got = dense(x, w, ids).float(), packed(x, w, ids).float()  # warm-up, and the same math
            err = float((got - ref).abs().max() / ref.abs().max())
            for _ in range(a.reps):
                for name, m in (("packed", packed), ("dense", dense)):
                    t1 = time.perf_counter()
                    m(x, w, ids)
                    best[name] = min(best[name], time.perf_counter() - t1)
        for name, nbytes in (("packed", pb), ("dense", db)):
            read = nbytes * touched / a.experts
            rows.append({"tokens": T, "experts_touched": touched, "variant": name, "ms": best[name] * 1e3,
                         "gb_s": read / best[name] / 1e9, "time_vs_dense": best[name] / best["dense"],
                         "max_rel_err_vs_dense": err})
            print(f"T={T:3d} ({touched} experts) {name:6s} {best[name] * 1e3:8.2f} ms  {read / best[name] / 1e9:6.1f}"
                  f" GB/s  x{best[name] / best['dense']:.2f} of dense", flush=True)
    meta = {"date": dt.date.today().isoformat(), "command": "python " + " ".join(sys.argv),
            "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "dense_dtype": str(dtype).replace("torch.", ""), "experts": a.experts, "top_k": a.top_k,
            "hidden": H, "intermediate": I, "packed_mb": pb / 1e6, "dense_mb": db / 1e6}
    os.makedirs(a.out, exist_ok=True)
    stem = unused_stem(os.path.join(a.out, f"{meta['date']}-gguf-experts" + (f"-{a.tag}" if a.tag else "")))
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# GGUF experts packed vs dense ({meta['date']})", "", f"`{meta['command']}`", "",
             f"CPU {meta['cpu']}, {meta['threads']} threads; one MoE layer, {a.experts} experts top-{a.top_k}, "
             f"hidden {H}, intermediate {I}; packed Q4_K gate/up + Q6_K down {pb / 1e6:.0f} MB, dense "
             f"{meta['dense_dtype']} {db / 1e6:.0f} MB. Best of {a.reps} alternated passes.", "",
             "| tokens | experts touched | variant | ms | GB/s of touched experts | time vs dense |",
             "|---:|---:|---|---:|---:|---:|"]
    lines += [f"| {r['tokens']} | {r['experts_touched']} | {r['variant']} | {r['ms']:.2f} | {r['gb_s']:.1f} | "
              f"{r['time_vs_dense']:.2f}x |" for r in rows]
    write_lines(stem + ".md", lines)
    print(f"wrote {stem}.json / .md")


if __name__ == "__main__":
    main()
