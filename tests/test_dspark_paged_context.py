"""The DSpark drafter's paged form (models/dspark_drafter.PagedDraftContext: the MLA draft layers read their context
rows in place through the block tables, the block's own rows in spare tail blocks) against the dense reference form
of the same drafter (tests/test_spec_dspark.py tests that form against a float64 reference), through every kernel
path the paged form takes: the C++ paged decode kernel, the gathered fallback and the Triton kernel (interpreter)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from test_spec_dspark import D, K3_4KDA, K3_5MLA, V, _drafter
from tokenfab.testing.tiny_dspark import write_tiny_dspark


def _paged_setup(dr, lens, bs, dtype, seed=3):
    """A pool of shuffled blocks holding each sequence's context rows (lens[b] positions) in every MLA layer's
    cache, the dense form's padded rows, and the proposer's own builder of the paged tables
    (DSparkProposer._paged_context) over scheduler rows 1, 0, 2, ... (not the batch order)."""
    from types import SimpleNamespace
    from tokenfab.spec_decode.dspark_proposer import DSparkProposer
    g = torch.Generator().manual_seed(seed)
    N = dr.cfg.block_size
    nt = -(-(bs - 1 + N) // bs)
    B, max_blocks = len(lens), 6
    num_blocks = B * max_blocks + 3
    rows = np.array([1, 0] + list(range(2, B)), dtype=np.int64)
    bt = np.zeros((B + 1, max_blocks), dtype=np.int64)
    perm = torch.randperm(num_blocks, generator=g).numpy()
    width = dr.cfg.kv_lora_rank + dr.cfg.qk_rope_head_dim
    caches = [torch.randn(num_blocks + (B + 1) * nt, bs, width, generator=g).to(dtype) for _ in dr.mla_layers]
    dense = [torch.zeros(B, max(max(lens), 1), width, dtype=dtype) for _ in dr.mla_layers]
    for b, n in enumerate(lens):
        bt[rows[b]] = perm[b * max_blocks:(b + 1) * max_blocks]
        if n:
            taps = torch.randn(n, len(dr.cfg.target_layer_ids) * dr.cfg.target_hidden_size, generator=g)
            for li, r in enumerate(dr.context_rows(dr.context(taps.to(dtype)), torch.arange(n))):
                t = torch.arange(n)
                caches[li][torch.from_numpy(bt[rows[b]])[t // bs], t % bs] = r.to(dtype)
                dense[li][b, :n] = r.to(dtype)
    fake = SimpleNamespace(bm=SimpleNamespace(block_size=bs, block_tables=bt, num_blocks=num_blocks),
                           cfg=dr.cfg, num_tail=nt, device=torch.device("cpu"))
    start = np.array(lens, dtype=np.int64)
    anchors = np.array([17, 250, 5, 9][:B], dtype=np.int64)
    paged, anchor, start_t = DSparkProposer._paged_context(fake, rows, start, anchors)
    valid = torch.tensor([[j < n for j in range(dense[0].shape[1])] for n in lens])
    return caches, dense, valid, paged, anchor, start_t, num_blocks


@pytest.mark.parametrize("path", ["cpu-kernel", "gathered", "triton-interpreter"])
@pytest.mark.parametrize("types", [K3_5MLA, K3_4KDA])
def test_paged_block_equals_reference_form(tmp_path, monkeypatch, path, types):
    """The engine's draft pass reads its keys in place (PagedDraftContext: the context rows through the block
    table, the block's own rows written into spare tail blocks, N x H query heads per decode row) and gives the
    dense reference form's hidden states in float32 to 1e-5: contexts of 9 (mid-block), 8 (a block boundary) and
    0 positions, block size 4 < N + p % bs, through the C++ decode kernel, the gathered fallback and the Triton
    kernel (interpreter). No block of the pool is written; bf16 (C++ kernel) stays within 3e-2 of float32."""
    if path == "triton-interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setenv("TOKENFAB_TRITON", "interpret")
    if path == "gathered":
        import tokenfab.layers.mla as mod
        monkeypatch.setattr(mod, "fused_decode", lambda *a, **k: None)
    dpath, _, _ = write_tiny_dspark(str(tmp_path / "d"), "specforge", types, target_layer_ids=(0, 2), block_size=5)
    g = torch.Generator().manual_seed(1)
    embed, lm_head = torch.randn(V, D, generator=g), torch.randn(V, D, generator=g) * 0.2
    dr, _ = _drafter(dpath, embed, lm_head)
    caches, dense, valid, paged, anchor, start, nb = _paged_setup(dr, [9, 8, 0], bs=4, dtype=torch.float32)
    pool = [c[:nb].clone() for c in caches]
    with torch.no_grad():
        want = dr.block(anchor, start, dense, valid)
        got = dr.block(anchor, start, caches, None, paged)
    assert all(torch.equal(c[:nb], p) for c, p in zip(caches, pool))
    assert (got - want).abs().max().item() < 1e-5 * max(1.0, want.abs().max().item())
    if path == "cpu-kernel":
        from tokenfab.models.dspark_drafter import DSparkDrafter, load_dspark_weights
        dr16 = DSparkDrafter(dr.cfg, torch.nn.Embedding.from_pretrained(embed.bfloat16()),
                             lambda h: h.float() @ lm_head.float().T)
        load_dspark_weights(dr16, dpath, torch.bfloat16)
        c16, _, _, paged16, _, _, _ = _paged_setup(dr16, [9, 8, 0], bs=4, dtype=torch.bfloat16)
        with torch.no_grad():
            got16 = dr16.block(anchor, start, c16, None, paged16).float()
        assert (got16 - want).abs().max().item() < 3e-2 * max(1.0, want.abs().max().item())
