"""The DSpark drafter's pass from static buffers (spec_decode/dspark_graphs.DSparkGraphRunner), in its ``eager`` form
(the padded buffer path a CUDA graph would freeze, run without capture on CPU): the same base logits as the plain
pass, padding rows that touch no block or tail a sequence owns, and an engine whose greedy output is unchanged."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from test_dspark_paged_context import _paged_setup
from test_spec_dspark import ALWAYS, D, K3_4KDA, K3_5MLA, V, _drafter, _k3_prompts, k3_drafter, k3_target  # noqa: F401
from tokenfab.testing.tiny_dspark import write_tiny_dspark


@pytest.mark.parametrize("types", [K3_5MLA, K3_4KDA])
def test_padded_buffers_equal_plain_pass(tmp_path, types):
    """Three sequences (contexts 9, 8 and 0 positions, scheduler rows 1, 0, 2) through the buffers of capture sizes
    [2, 4]: padded to 4 rows, the base draft logits equal the plain pass's (DSparkProposer._paged_context, tables
    as wide as the batch needs) to 1e-5 in float32, and the anchors come back. The pool's blocks are not written;
    of the tails, only those of the batch's rows and of the spare padding row change. Then row 2 alone (padded to
    2: its padding row held row 0 in the last pass) gives its row of the batch's result and leaves the tails of
    rows 0 and 1 alone."""
    from tokenfab.spec_decode.dspark_graphs import DSparkGraphRunner
    dpath, _, _ = write_tiny_dspark(str(tmp_path / "d"), "specforge", types, target_layer_ids=(0, 2), block_size=5)
    g = torch.Generator().manual_seed(1)
    embed, lm_head = torch.randn(V, D, generator=g), torch.randn(V, D, generator=g) * 0.2
    dr, _ = _drafter(dpath, embed, lm_head)
    caches, _, _, paged, anchor, start, nb = _paged_setup(dr, [9, 8, 0], bs=4, dtype=torch.float32)
    nt = -(-(4 - 1 + 5) // 4)
    rows_all = 4  # _paged_setup's tables: 3 sequence rows + 1 spare
    # room for one more row's tail (the padding row's): as the proposer allocates
    caches = [torch.cat([c, torch.full((nt, 4, c.shape[-1]), 7.0)]) for c in caches]
    bt = np.zeros((rows_all, 6), dtype=np.int64)
    sched_rows = np.array([1, 0, 2], dtype=np.int64)
    # rebuild the block tables _paged_setup used from its paged form: the columns below each anchor's block, and
    # the anchor's block (the tail's source)
    tables, src = paged.block_tables.numpy(), paged.tail_src.numpy()
    for b, r in enumerate(sched_rows):
        first = int(start[b]) // 4
        bt[r, :first], bt[r, first] = tables[b, :first], src[b]
    with torch.no_grad():
        want = dr.draft_logits(dr.block(anchor, start, [c.clone() for c in caches], None, paged))[:, :3]
        before = [c.clone() for c in caches]
        runner = DSparkGraphRunner(dr, caches, num_blocks=nb, block_size=4, max_blocks=6, num_tail=nt,
                                   pad_row=rows_all, num_drafts=3, sizes=[2, 4], device=torch.device("cpu"),
                                   mode="eager")
        got, got_anchor = runner.run(bt, sched_rows, start.numpy(), anchor.numpy())
    assert got.shape == want.shape and torch.equal(got_anchor, anchor)
    assert (got - want).abs().max().item() < 1e-5 * max(1.0, want.abs().max().item())
    for c, c0 in zip(caches, before):
        assert torch.equal(c[:nb], c0[:nb])  # no pool block written
        changed = {(i - nb) // nt for i in range(nb, c.shape[0]) if not torch.equal(c[i], c0[i])}
        assert changed <= {1, 0, 2, rows_all} and rows_all in changed  # the batch's tails and the padding row's
    for c in caches:  # the other rows' tails marked: a stale padding row (the last pass's rows) would write one
        c[nb:nb + 2 * nt] = -3.0
    with torch.no_grad():
        one, _ = runner.run(bt, sched_rows[2:], start.numpy()[2:], anchor.numpy()[2:])
    assert (one[0] - want[2]).abs().max().item() < 1e-5 * max(1.0, want.abs().max().item())
    assert all(bool((c[nb:nb + 2 * nt] == -3.0).all()) for c in caches)
    assert runner.replays == 2
    with pytest.raises(ValueError, match="below 4"):
        runner.run(bt, np.array([4]), np.array([0]), np.array([1]))
    with pytest.raises(ValueError, match="1 .. 4"):
        runner.run(bt, np.arange(5) % 3, np.zeros(5, np.int64), np.ones(5, np.int64))


def test_engine_passes_from_buffers(k3_target, k3_drafter, monkeypatch):  # noqa: F811
    """An engine whose decode steps run from the decode-graph buffers (TOKENFAB_DECODE_GRAPHS=eager) drafts from
    the drafter's buffers too: every pass gives the plain pass's base logits on the same caches and taps (1e-5,
    float32) and the greedy output equals the non-speculative engine's."""
    from tokenfab import LLM, SamplingParams
    from tokenfab.spec_decode.dspark_proposer import DSparkProposer
    path, _, _ = k3_target
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = LLM(path, dtype="float32", progress=False).generate(_k3_prompts(), sp, use_tqdm=False)
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "eager")
    llm = LLM(path, dtype="float32", progress=False, speculative_config=dict(
        ALWAYS, method="dspark", model=k3_drafter[0], num_speculative_tokens=3))
    prop = llm.llm_engine.spec.proposer
    assert prop.graphs is not None and prop.graphs.mode == "eager"
    runner_run, errs = prop.graphs.run, []

    def run(bt, rows, start, anchors):  # the plain pass first, on the same caches (it writes the same tail rows)
        paged, a, s = DSparkProposer._paged_context(prop, rows, start, anchors)
        want = prop.drafter.draft_logits(prop.drafter.block(a, s, prop.caches, None, paged))[:, :prop.graphs.m]
        got, anchor = runner_run(bt, rows, start, anchors)
        errs.append((got - want).abs().max().item() / max(1.0, want.abs().max().item()))
        return got, anchor

    prop.graphs.run = run
    out = llm.generate(_k3_prompts(), sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in base]
    st = llm.llm_engine.get_stats()
    assert errs and max(errs) < 1e-5 and prop.graphs.replays == len(errs)
    assert st["spec_decode_num_drafts"] >= len(errs) > 0  # every pass drafted for at least one row
    assert st["graph_steps_draft"] == len(errs)  # the passes the buffers served, as /metrics exports them
    from tokenfab.server.metrics import ServerMetrics
    text = ServerMetrics("m").render(st).decode()
    assert f'tokenfab:graph_steps_total{{kind="draft",model_name="m"}} {float(len(errs))}' in text
