"""The decode graph runner's padded static-buffer path (engine/cuda_graph_runner.py) without capture, on CPU:
the same buffers, padding rows, pad block and spare state slot a captured CUDA graph replays, checked token for
token against transformers (dense, DeepSeek) or against the engine with graphs off (Kimi Linear hybrids, tensor
parallel over gloo). Capture itself needs a GPU (benchmarks/gpu_check.sh)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tokenfab.engine.cuda_graph_runner import DecodeGraphRunner, capture_sizes, collectives_graph_safe, decode_graph_mode

os.environ.setdefault("TOKENFAB_TP_TIMEOUT", "120")  # a broken test fails instead of hanging


def test_capture_sizes():
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1000)[-3:] == [240, 248, 256]


def test_mode_choice(monkeypatch):
    class Dense:
        tp = None

    class Hybrid(Dense):
        def make_state_cache(self):
            pass

    class Sharded(Dense):
        tp = object()

    class HostExperts(Dense):
        host_expert_stats = object()

    cpu = torch.device("cpu")
    monkeypatch.delenv("TOKENFAB_DECODE_GRAPHS", raising=False)
    assert decode_graph_mode(cpu, Dense(), enforce_eager=False) is None  # no graphs on CPU
    assert decode_graph_mode(cpu, Hybrid(), enforce_eager=False) is None
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "eager")
    assert decode_graph_mode(cpu, Dense(), enforce_eager=False) == "eager"
    assert decode_graph_mode(cpu, Dense(), enforce_eager=True) is None  # the user's flag wins
    assert decode_graph_mode(cpu, Hybrid(), enforce_eager=False) == "eager"  # KDA state through the spare slot
    assert decode_graph_mode(cpu, Sharded(), enforce_eager=False) == "eager"  # every rank pads alike
    assert decode_graph_mode(cpu, HostExperts(), enforce_eager=False) is None  # per-step host work
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "0")
    assert decode_graph_mode(cpu, Hybrid(), enforce_eager=False) is None
    assert decode_graph_mode(cpu, Dense(), enforce_eager=False) is None
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "off")  # a typo must not silently mean "auto"
    with pytest.raises(Exception, match="TOKENFAB_DECODE_GRAPHS='off'.*use 0"):
        decode_graph_mode(cpu, Dense(), enforce_eager=False)


@pytest.mark.parametrize("family", ["deepseek_v3", "llama"])
def test_padded_decode_token_exact(monkeypatch, tiny_model, family):
    """5 prompts decode together, padded to the size-8 buffers; prefill and mixed steps stay on the normal path."""
    from test_engine_exact import check_family, make_prompts
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "eager")
    llm, worst = check_family(tiny_model(family), make_prompts(5, [30, 3, 12, 7, 19]))
    runner = llm.llm_engine.runner
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.replays > 0
    pad = graphs.pad_block
    assert pad == llm.llm_engine.block_manager.num_blocks  # one block past what the block manager hands out
    first = runner.kv_caches[0][0] if isinstance(runner.kv_caches[0], tuple) else runner.kv_caches[0]
    assert first.shape[0] == pad + 1 and first[pad].abs().sum() > 0  # padding rows wrote there, nowhere else
    assert worst < 1e-4


def test_padded_decode_with_triton_kernels(monkeypatch, tiny_model):
    """The combination a GPU runs under graphs: padded buffers + Triton attention and MoE (interpreted)."""
    from tokenfab.kernels.gpu import support as triton_support
    if not triton_support.triton_importable():
        pytest.skip("triton is not installed")
    from test_engine_exact import check_family, make_prompts
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret")
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "eager")
    llm, worst = check_family(tiny_model("deepseek_v3"), make_prompts(6, [9, 25, 4]), n_new=6)  # all interpreted
    assert llm.llm_engine.runner.decode_graphs.replays > 0
    assert worst < 1e-4


def test_collectives_graph_safe(monkeypatch):
    """CUDA capture under tensor parallel only over NCCL (its kernels are capturable; gloo's are host calls)."""
    import torch.distributed as dist

    class Dense:
        tp = None

    class Sharded:
        tp = object()

    assert collectives_graph_safe(Dense())
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert not collectives_graph_safe(Sharded())
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for backend, safe in (("nccl", True), ("gloo", False)):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert collectives_graph_safe(Sharded()) is safe


def test_runner_state_rows_padding():
    """The static state-row buffer: real rows first, the spare slot in every padding row; rows naming the spare
    slot (or none, for a hybrid model) are refused."""
    seen = []

    def forward(ids, pos, meta):
        seen.append((meta.state_rows.clone(), pos.clone(), meta.slot_mapping.clone()))
        return torch.zeros(len(ids), 4), None

    r = DecodeGraphRunner(forward, [], pad_block=6, block_size=4, max_blocks=3, sizes=[1, 2, 4, 8],
                          device=torch.device("cpu"), mode="eager", state_slot=8)
    a = lambda *v: np.array(v, dtype=np.int64)
    out, taps = r.run(a(5, 6, 7, 8, 9), a(3, 1, 4, 1, 5), a(3, 5, 8, 13, 21), np.zeros((5, 2), np.int64),
                      a(4, 2, 5, 2, 6), state_rows=a(7, 0, 3, 2, 5))
    assert out.shape == (5, 4) and taps is None
    rows, pos, slots = seen[-1]
    assert rows.tolist() == [7, 0, 3, 2, 5, 8, 8, 8]  # 5 real rows into the size-8 buffers
    assert pos.tolist()[5:] == [0, 0, 0] and slots.tolist()[5:] == [24, 24, 24]  # fresh state, pad block
    r.run(a(1), a(2), a(3), np.zeros((1, 1), np.int64), a(3), state_rows=a(4))
    assert seen[-1][0].tolist() == [4]
    r.run(a(1, 2, 3), a(2, 2, 2), a(3, 4, 5), np.zeros((3, 1), np.int64), a(3, 3, 3), state_rows=a(1, 6, 0))
    assert seen[-1][0].tolist() == [1, 6, 0, 8]  # stale rows of the larger step are overwritten by the spare
    with pytest.raises(ValueError, match="state rows"):
        r.run(a(1), a(2), a(3), np.zeros((1, 1), np.int64), a(3))
    with pytest.raises(ValueError, match=r"state rows must lie in \[0, 8\)"):
        r.run(a(1, 2), a(2, 2), a(3, 4), np.zeros((2, 1), np.int64), a(3, 3), state_rows=a(1, 8))


KDA_PROMPT_LENGTHS = [30, 3, 12, 7, 19, 25, 5, 9, 14, 4, 22]  # 11 requests through 8 rows: rows are reused
KDA_MAX_TOKENS = [4, 9, 6, 12, 3, 10, 7, 5, 11, 8, 6]  # unequal: sequences finish and are replaced mid-run


@pytest.fixture(scope="module")
def kimi_linear_path(tmp_path_factory, tokenizer_dir):
    from test_kimi_linear import make_kimi_linear
    return make_kimi_linear(str(tmp_path_factory.mktemp("graphs_kimi_linear")), tokenizer_dir, seed=3)


@pytest.fixture(scope="module")
def hybrid_path(kimi_linear_path, tmp_path_factory, tokenizer_dir):
    """Factory: "kimi_linear" or "k3" (the tiny Kimi K3 of tests/test_kimi_k3.py: KDA + gated MLA, MXFP4
    experts, attention residuals) -> checkpoint folder."""
    paths = {"kimi_linear": kimi_linear_path}

    def make(name: str) -> str:
        if name not in paths:
            from test_kimi_k3 import TEXT, k3_tensors, write_k3
            stored, _ = k3_tensors(TEXT, seed=5)
            paths[name] = write_k3(str(tmp_path_factory.mktemp("graphs_k3")), tokenizer_dir, tensors=stored)
        return paths[name]
    return make


def _generate(path: str, prompts, max_tokens, **engine_kw):
    from tokenfab import LLM, SamplingParams
    kw = dict(dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=32, block_size=8,
              max_num_seqs=8, progress=False)
    kw.update(engine_kw)
    llm = LLM(path, **kw)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in max_tokens]
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _assert_same_outputs(ref, got, label: str, tol: float = 1e-4) -> None:
    """Same greedy tokens and sampled-token logprobs within ``tol``."""
    for i, (r, g) in enumerate(zip(ref, got)):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids, f"{label}: request {i}: tokens differ"
        for a, b, t in zip(r.outputs[0].logprobs, g.outputs[0].logprobs, r.outputs[0].token_ids):
            assert abs(a[t].logprob - b[t].logprob) < tol, f"{label}: request {i}: logprob differs"


@pytest.mark.parametrize("model", ["kimi_linear", "k3"])
def test_padded_decode_kda_hybrid_state_slots(monkeypatch, hybrid_path, model):
    """Kimi Linear / Kimi K3 (KDA + MLA): decode steps of 3..7 sequences padded into the size-4 / size-8 buffers, with rows
    freed and reused by new requests mid-run, equal the engine without graphs token for token; afterwards every
    real slot's conv and recurrent state equals the no-graph run's, and only the spare slot holds padding rows'
    state (float32: the padded batch's GEMMs may round a few ulps differently; a padding row in a real slot moves
    its state by O(0.1))."""
    from test_engine_exact import make_prompts
    prompts = make_prompts(3, KDA_PROMPT_LENGTHS)
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "0")
    path = hybrid_path(model)
    ref_llm, ref = _generate(path, prompts, KDA_MAX_TOKENS)
    assert ref_llm.llm_engine.runner.decode_graphs is None

    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "eager")
    batch_sizes = []
    orig = DecodeGraphRunner.run

    def spy(self, input_ids, *args, **kw):
        batch_sizes.append(len(input_ids))
        return orig(self, input_ids, *args, **kw)

    monkeypatch.setattr(DecodeGraphRunner, "run", spy)
    llm, got = _generate(path, prompts, KDA_MAX_TOKENS)
    _assert_same_outputs(ref, got, f"{model}, padded decode")
    runner = llm.llm_engine.runner
    graphs = runner.decode_graphs
    assert graphs.replays == len(batch_sizes) > 0
    assert set(batch_sizes) - {1, 2, 4, 8}, f"no padded step ran: {batch_sizes}"
    spare = graphs.state_slot
    assert spare == 8 and runner.state_caches
    for c_ref, c in zip(ref_llm.llm_engine.runner.state_caches, runner.state_caches):
        assert c.num_slots == c_ref.num_slots + 1 == spare + 1
        torch.testing.assert_close(c.recurrent[:spare], c_ref.recurrent, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(c.conv[:spare], c_ref.conv, rtol=1e-4, atol=1e-4)
        assert c.recurrent[spare].abs().sum() > 0 and c.conv[spare].abs().sum() > 0  # the padding rows' slot


def _tp_generate(path: str, n: int, prompts, max_tokens, **engine_kw):
    """Greedy outputs on ``n`` ranks and the decode-graph replays rank 0 ran (None: graphs off)."""
    llm, outs = _generate(path, prompts, max_tokens, tensor_parallel_size=n, **engine_kw)
    try:
        graphs = llm.llm_engine.runner.decode_graphs
        return outs, None if graphs is None else graphs.replays
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("family,n", [("deepseek_v3", 2), ("kimi_linear", 2), ("qwen3", 3)])
def test_padded_decode_tensor_parallel(monkeypatch, tiny_model, kimi_linear_path, family, n):
    """Tensor parallel over gloo with the padded path on every rank: 5 requests (then fewer as they finish) into
    the size-8 buffers; every rank must pad alike or its all-reduces would not pair up. Tokens and logprobs equal
    the single-rank engine without graphs."""
    from test_engine_exact import make_prompts
    path = kimi_linear_path if family == "kimi_linear" else tiny_model(family)
    prompts = make_prompts(5, [30, 3, 12, 7, 19])
    max_tokens = [6, 3, 7, 5, 4]
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "0")
    ref, replays = _tp_generate(path, 1, prompts, max_tokens)
    assert replays is None
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "eager")
    got, replays = _tp_generate(path, n, prompts, max_tokens)
    assert replays > 0
    _assert_same_outputs(ref, got, f"{family} TP={n}, padded decode")
    if family == "deepseek_v3":  # enforce_eager reaches the workers too: no rank pads while rank 0 does not
        got, replays = _tp_generate(path, n, prompts, max_tokens, enforce_eager=True)
        assert replays is None
        _assert_same_outputs(ref, got, f"{family} TP={n}, enforce_eager")


def test_padded_decode_tensor_parallel_with_layer_taps(monkeypatch, tmp_path_factory, tokenizer_dir):
    """DSpark on Kimi K3 over 2 ranks: the drafter reads layer taps (forward hooks) on rank 0 from the padded
    buffers' forward, decode and verification steps alike; every step header tells the workers rank 0's
    verification size (1 + 3) and, until the first replay, that its graphs wait to be captured again (the taps, the
    verification graphs), so the workers take the same padded path (their all-reduces pair with rank 0's over the
    same padded token counts) and capture at the same step. The default drafting policy soon stops drafting for
    this random drafter, so plain decode steps of 3 sequences (padded to 4) follow. Tokens equal one rank without
    speculation or graphs."""
    from test_spec_dspark import K3_5MLA, _k3_prompts
    from test_tp_spec_mtp_dspark import ENGINE_KW, GREEDY
    from test_kimi_k3 import TEXT, k3_tensors, write_k3
    from tokenfab import LLM
    from tokenfab.testing.tiny_dspark import write_tiny_dspark
    root = tmp_path_factory.mktemp("graphs_dspark")
    text = dict(TEXT, num_attention_heads=3, num_experts=6, intermediate_size=97,
                linear_attn_config=dict(TEXT["linear_attn_config"], num_heads=3))
    target = write_k3(str(root / "k3"), tokenizer_dir, text=text, tensors=k3_tensors(text, seed=2)[0])
    drafter, _, _ = write_tiny_dspark(str(root / "drafter"), "specforge", K3_5MLA, block_size=4,
                                      target_layer_ids=(0, 2), target_num_layers=text["num_hidden_layers"], seed=3)
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "0")
    base = [o.outputs[0].token_ids for o in LLM(target, **ENGINE_KW).generate(_k3_prompts(), GREEDY, use_tqdm=False)]
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "eager")
    sent = []
    from tokenfab.parallel.worker import StepChannel
    orig = StepChannel.send_step

    def spy(self, d, num_new, *args, modules=False, graphs=(0, False), **kw):
        sent.append((d == len(num_new) and len(num_new) not in (1, 2, 4), modules, graphs))
        return orig(self, d, num_new, *args, modules=modules, graphs=graphs, **kw)

    monkeypatch.setattr(StepChannel, "send_step", spy)
    spec = dict(method="dspark", model=drafter, num_speculative_tokens=3, dspark_tap="partial_sum")
    llm = LLM(target, tensor_parallel_size=2, speculative_config=spec, **ENGINE_KW)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(_k3_prompts(), GREEDY, use_tqdm=False)]
        graphs = llm.llm_engine.runner.decode_graphs
        replays, verify = graphs.replays, graphs.verify_replays
    finally:
        llm.llm_engine.shutdown()
    assert got == base
    assert replays > verify > 0  # rank 0: decode and verification steps from the buffers, taps included
    assert any(padded for padded, _, _ in sent)  # a decode-only step padded in the buffers
    assert not any(m for _, m, _ in sent)  # no step through the modules
    assert all(g[0] == 4 for _, _, g in sent) and sent[0][2][1] and not sent[-1][2][1]  # V = 1 + 3; S until capture


def test_hybrid_verification_rows_through_graph_buffers_tensor_parallel(monkeypatch, tmp_path, tokenizer_dir):
    """Kimi Linear (5 KDA heads split 3 + 2) over 2 ranks with drafts from the known continuation, one wrong at a
    varying position: rank 0 enables verification graphs after the engine is built and the workers follow at the
    first step (its header's V), so every rank serves the verification rows from the [bs, 4] buffers (padded alike:
    their all-reduces pair over bs x 4 token rows) and commits its own heads' states from them. Greedy tokens equal
    one rank without speculation or graphs."""
    from spec_helpers import NGRAM, spec_prompts, token_ids
    from test_kimi_linear import make_kimi_linear
    from test_spec_state_commit import OracleProposer
    from test_tp_spec_decode import ENGINE_KW, GREEDY
    from tokenfab import LLM
    path = make_kimi_linear(str(tmp_path / "kl5"), tokenizer_dir, seed=11, linear_num_heads=5)
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "0")
    base = token_ids(LLM(path, **ENGINE_KW).generate(spec_prompts(), GREEDY, use_tqdm=False))
    expected = {len(p["prompt_token_ids"]): b for p, b in zip(spec_prompts(), base)}
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "eager")
    llm = LLM(path, tensor_parallel_size=2, speculative_config=NGRAM, **ENGINE_KW)
    eng = llm.llm_engine
    try:
        eng.spec.proposer = OracleProposer(expected, eng.model_config.vocab_size)
        got = token_ids(llm.generate(spec_prompts(), GREEDY, use_tqdm=False))
        graphs, st = eng.runner.decode_graphs, eng.get_stats()
    finally:
        eng.shutdown()
    assert got == base
    assert graphs.verify_q == 4 and graphs.verify_replays > 0 and not graphs.stale
    per_pos = st["spec_decode_num_accepted_tokens_per_pos"]
    assert per_pos[0] > per_pos[2] > 0  # rows accepted 0..3 drafts: states committed after 1..4 tokens


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_verification_and_mixed_steps_through_graph_buffers(monkeypatch, tiny_model, family):
    """Speculative verification rows (n-gram drafts, 1 + k tokens a sequence) and steps that mix decodes with short
    prefill chunks run through the padded decode buffers with every token a decode row of its own: greedy tokens
    equal those of the engine without speculation and without graphs, and steps with more token rows than
    sequences were served from the buffers."""
    from spec_helpers import NGRAM, spec_prompts, token_ids
    from tokenfab import LLM, SamplingParams
    path = tiny_model(family)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "0")
    base = token_ids(LLM(path, dtype="float32", progress=False).generate(spec_prompts(), sp))
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "eager")
    llm = LLM(path, dtype="float32", progress=False, speculative_config=NGRAM, max_num_batched_tokens=64)
    graphs = llm.llm_engine.runner.decode_graphs
    rows = []
    real = graphs.run

    def spy(input_ids, *a, **k):
        rows.append(len(input_ids))
        return real(input_ids, *a, **k)
    graphs.run = spy
    assert token_ids(llm.generate(spec_prompts(), sp)) == base
    st = llm.llm_engine.get_stats()
    assert st["spec_decode_num_drafts"] > 0 and st["spec_decode_num_accepted_tokens"] > 0
    assert max(rows) > len(spec_prompts())  # token rows beyond one per sequence: verification or mixed steps


@pytest.mark.parametrize("model", ["kimi_linear", "k3"])
def test_hybrid_verification_rows_through_graph_buffers(monkeypatch, hybrid_path, model):
    """Kimi Linear / Kimi K3 with drafts from the known continuation, one wrong at a varying position (rows accept
    0..3 of 3): the verification steps run from the padded buffers, attention with every token a decode row, the
    KDA layers over [bs, 4] with the rows' states held and committed after acceptance (4 sequences in the size-4
    and, as they finish, padded size-2 / size-4 buffers). Greedy tokens and their logprobs equal the engine without
    speculation and without graphs."""
    from spec_helpers import NGRAM, spec_prompts
    from test_spec_state_commit import OracleProposer
    path = hybrid_path(model)
    prompts = [p["prompt_token_ids"] for p in spec_prompts()]
    max_tokens = [16, 11, 14, 9]
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "0")
    _, ref = _generate(path, prompts, max_tokens, max_num_seqs=16)
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "eager")
    from tokenfab import LLM, SamplingParams
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=64, block_size=8,
              max_num_seqs=16, progress=False, speculative_config=NGRAM)
    eng = llm.llm_engine
    expected = {len(p): r.outputs[0].token_ids for p, r in zip(prompts, ref)}
    eng.spec.proposer = OracleProposer(expected, eng.model_config.vocab_size)
    graphs = eng.runner.decode_graphs
    assert graphs.verify_q == 4 and graphs.verify_sizes == [1, 2, 4, 8, 16] and graphs.n_rows == 64
    batches = []
    orig = DecodeGraphRunner.run_verify

    def spy(self, input_ids, positions, slots, bt, num_new, *a, **kw):
        batches.append(len(num_new))
        return orig(self, input_ids, positions, slots, bt, num_new, *a, **kw)

    monkeypatch.setattr(DecodeGraphRunner, "run_verify", spy)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in max_tokens]
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _assert_same_outputs(ref, got, f"{model}, verification from the buffers")
    st = eng.get_stats()
    per_pos = st["spec_decode_num_accepted_tokens_per_pos"]
    assert per_pos[0] > per_pos[2] > 0  # rows accepted 0..3 drafts: commits of 1..4 tokens
    assert graphs.verify_replays == len(batches) > 0 and set(batches) - {1, 2, 4}, batches  # padded steps too
    assert st["graph_steps_verify"] == len(batches) and st["graph_steps_decode"] == graphs.replays - len(batches)
    from tokenfab.server.metrics import ServerMetrics
    text = ServerMetrics("m").render(st).decode()
    assert f'tokenfab:graph_steps_total{{kind="verify",model_name="m"}} {float(len(batches))}' in text, text


def test_layer_taps_from_graph_buffers_equal_the_modules(monkeypatch, hybrid_path, tmp_path_factory):
    """A drafter's layer taps (DSpark on the tiny Kimi K3, drafting at every step) read from the padded buffers'
    forward, decode and verification steps alike, equal those of the module path step for step, and so do the
    drafts and the tokens."""
    from test_spec_dspark import K3_5MLA, _k3_prompts, ALWAYS
    from tokenfab import LLM, SamplingParams
    from tokenfab.testing.tiny_dspark import write_tiny_dspark
    path = hybrid_path("k3")
    drafter, _, _ = write_tiny_dspark(str(tmp_path_factory.mktemp("graphs_taps")), "specforge", K3_5MLA,
                                      block_size=4, target_layer_ids=(0, 2), target_num_layers=4, seed=3)
    runs = {}
    for mode in ("0", "eager"):
        monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", mode)
        llm = LLM(path, dtype="float32", device="cpu", max_model_len=96, max_num_seqs=16, progress=False,
                  speculative_config=dict(ALWAYS, method="dspark", model=drafter, num_speculative_tokens=3))
        runner = llm.llm_engine.runner
        seen, keep = [], runner.keep_captured

        def spy(seqs, rows, req_idx, positions, keep=keep, seen=seen, runner=runner):
            keep(seqs, rows, req_idx, positions)
            seen.append((positions.copy(), runner.captured.taps.clone()))
        runner.keep_captured = spy
        out = llm.generate(_k3_prompts(), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                           use_tqdm=False)
        graphs = runner.decode_graphs
        runs[mode] = ([o.outputs[0].token_ids for o in out], seen, llm.llm_engine.get_stats(),
                      0 if graphs is None else graphs.replays, 0 if graphs is None else graphs.verify_replays)
    (tok0, seen0, st0, _, _), (tok1, seen1, st1, replays, verify) = runs["0"], runs["eager"]
    assert replays > verify > 0  # decode and verification steps from the buffers, taps included
    assert tok1 == tok0 and len(seen1) == len(seen0)
    assert st1["spec_decode_num_accepted_tokens"] == st0["spec_decode_num_accepted_tokens"]
    for (p0, t0), (p1, t1) in zip(seen0, seen1):
        assert np.array_equal(p0, p1)
        torch.testing.assert_close(t1, t0, rtol=1e-4, atol=1e-4)
