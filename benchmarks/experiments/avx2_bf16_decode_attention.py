"""MLA decode attention in bf16 at the avx2 ISA level: the kernel's float32 FMAs vs the gathered path with bf16 GEMMs
(before 2026-12-06) vs the gathered path with its GEMMs on float32 copies (after: dispatch.cpu_bf16_gemm_slow).

Shapes: one latent pool (576 = 512 + 64 wide, values its first 512) read by H query heads, B sequences of L tokens,
page 16, shuffled blocks. ms: best of 3 after a warm-up call. Max error against a float32 computation on the
same bf16 inputs.

    PYTHONPATH=. python benchmarks/experiments/avx2_bf16_decode_attention.py
"""
from __future__ import annotations

import time

import torch

from tokenfab.kernels.cpu import isa as cpu_isa
from tokenfab.kernels.cpu.ops import attention as cpu_attention
from tokenfab.kernels.cpu.ops import support as cpu_support
from tokenfab.layers.attention_metadata import AttentionGroup
from tokenfab.layers.paged_attention import additive_mask, attention, gather_cache


def best_ms(fn, n: int = 3) -> float:
    fn()
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return min(t) * 1e3


def bf16_gemms(q, keys, group, scale):
    """The gathered decode as it ran before: baddbmm and bmm in bf16 (paged_attention.attention's other branch)."""
    B, H, _, D = q.shape
    L = keys.shape[2]
    m = additive_mask(group, q.dtype).view(B, 1, L)
    s = torch.baddbmm(m, q.reshape(B, H, D), keys.reshape(B, L, D).transpose(1, 2), alpha=scale)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(p, keys.reshape(B, L, D)).view(B, H, 1, D)


def main() -> None:
    torch.manual_seed(0)
    print(f"ISA level {cpu_isa.selected_level()}, AVX512-BF16 dot in the kernels: {cpu_support.has_bf16_dot()}, "
          f"{torch.get_num_threads()} threads")
    print("| B | H | L | kernel float32 FMAs ms | gathered, bf16 GEMMs ms | gathered, float32 GEMMs ms | "
          "bf16 GEMMs / float32 GEMMs | max err kernel / gathered |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for B, H, L in [(1, 16, 512), (1, 128, 512), (16, 16, 64), (4, 128, 256), (1, 16, 8192), (1, 128, 8192),
                    (8, 128, 2048)]:
        bs = 16
        nb = B * L // bs
        cache = (torch.randn(nb, bs, 576) * 0.5).bfloat16()
        bt = torch.randperm(nb).view(B, L // bs)
        cl = torch.full((B,), L)
        q = torch.randn(B, H, 576).bfloat16()
        lat = cache.unsqueeze(2)
        g = AttentionGroup(token_index=(cl - 1)[:, None], query_pos=(cl - 1)[:, None], block_tables=bt,
                           context_lens=cl, q_len=1, max_context=L)
        keys = lambda: gather_cache(cache, g).unsqueeze(1)  # noqa: E731
        kernel = lambda: cpu_attention.paged_decode_attention(q, lat, lat[..., :512], bt, cl, 0.1)  # noqa: E731
        old = lambda: bf16_gemms(q.unsqueeze(2), keys(), g, 0.1)  # noqa: E731
        new = lambda: (lambda k: attention(q.unsqueeze(2), k, k, g, 0.1))(keys())  # noqa: E731
        kf = gather_cache(cache, g).float()
        ref = torch.softmax(0.1 * q.float() @ kf.transpose(1, 2), -1) @ kf[..., :512]
        e_k = (kernel().float() - ref).abs().max().item()
        e_g = (new()[:, :, 0, :512].float() - ref).abs().max().item()
        tk, to, tn = best_ms(kernel), best_ms(old), best_ms(new)
        print(f"| {B} | {H} | {L} | {tk:.1f} | {to:.1f} | {tn:.1f} | {to / tn:.1f}x | {e_k:.1e} / {e_g:.1e} |",
              flush=True)


if __name__ == "__main__":
    main()
