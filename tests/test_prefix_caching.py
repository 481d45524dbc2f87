"""Prefix caching (engine/prefix_cache.py, engine/state_snapshots.py): outputs identical with and without it, hits
counted exactly on hand-worked cases, block-manager invariants after every step (free + cached + used = total,
refcounts = block tables holding the block), preemption while blocks are shared, eviction under pressure, hybrid
KDA state snapshots (restored, fallback to the longest boundary with one, never stale after an abort or a
preemption mid-prefill), and YaRN positions past the original window staying exact with cached blocks.

Tiny float32 checkpoints; every comparison is against the same engine with prefix caching off or against
transformers, computed independently in the test.
"""
from __future__ import annotations

import pytest
import torch

from conftest import load_reference, reference_logprobs
from test_kimi_linear import make_kimi_linear
from tokenfab import LLM, SamplingParams
from tokenfab.engine.scheduler import Scheduler


def rand_tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 512, (n,), generator=g).tolist()


def run_checked(llm: LLM, prompts: list[list[int]], params, one_by_one: bool = False) -> list[list[int]]:
    """Generate through the engine's step loop, asserting the block manager's invariants after every step;
    ``one_by_one``: each request runs to the end before the next is added (so later ones find the earlier ones'
    blocks cached). Returns the output token ids per prompt."""
    eng = llm.llm_engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    out: dict[str, list[int]] = {}
    waves = [[i] for i in range(len(prompts))] if one_by_one else [list(range(len(prompts)))]
    for wave in waves:
        for i in wave:
            eng.add_request(f"r{i}", None, prompts[i], params[i])
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    out[o.request_id] = o.outputs[0].token_ids
            sch = eng.scheduler
            eng.block_manager.check_invariants(list(sch.running) + list(sch.waiting))
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    return [out[f"r{i}"] for i in range(len(prompts))]


def engines(path: str, **kw) -> tuple[LLM, LLM]:
    base = dict(dtype="float32", device="cpu", progress=False)
    base.update(kw)
    return LLM(path, enable_prefix_caching=False, **base), LLM(path, enable_prefix_caching=True, **base)


def shared_prefix_prompts(seed: int, prefix: int, suffixes: list[int]) -> list[list[int]]:
    pre = rand_tokens(seed, prefix)
    return [pre + rand_tokens(seed + 1 + i, s) for i, s in enumerate(suffixes)] + [pre[:prefix // 2]]


@pytest.fixture(scope="module")
def kl_path(tmp_path_factory, tokenizer_dir):
    return make_kimi_linear(str(tmp_path_factory.mktemp("kimi_linear_pc")), tokenizer_dir)


@pytest.fixture(scope="module")
def paths(tiny_model, kl_path):
    return {"llama": tiny_model("llama"), "deepseek_v3": tiny_model("deepseek_v3"), "kimi_linear": kl_path}


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "kimi_linear"])
def test_outputs_identical_with_and_without_prefix_caching(paths, family):
    """Shared-prefix prompts one by one, greedy (later ones hit), then all together with seeded sampling (hits on
    the blocks cached by the first pass, and between requests of the batch once their prefill ran), chunked
    prefill (budget 48, blocks of 8): the same tokens as without prefix caching, with hits counted."""
    off, on = engines(paths[family], max_num_batched_tokens=48, max_num_seqs=4, block_size=8, num_kv_blocks=128,
                      max_model_len=160)
    prompts = shared_prefix_prompts(10, 70, [5, 30, 1, 64])
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    seeded = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=8, ignore_eos=True)
              for i in range(len(prompts))]
    for params, one_by_one in ((greedy, True), (seeded, False)):
        ref = run_checked(off, prompts, params, one_by_one)
        got = run_checked(on, prompts, params, one_by_one)
        assert got == ref, f"{family}: outputs differ with prefix caching (one_by_one={one_by_one})"
    pc = on.llm_engine.block_manager.prefix_cache
    assert pc.hits > 0 and pc.queries > pc.hits
    if family == "kimi_linear":
        assert pc.snapshots.num_restored > 0, "no state snapshot was restored"
    assert off.llm_engine.get_stats()["prefix_cache_queries"] == 0


def test_hits_counted_exactly_hand_worked(paths):
    """Blocks of 4, one request at a time. A (10 tokens, 8 generated: 17 computed) registers 4 full blocks.
    B = A's prompt + its first 3 outputs (13): at most (13-1)//4 = 3 blocks, all cached -> 12 hits. C = A's prompt (10):
    (10-1)//4 = 2 blocks -> 8 (the block holding the last token is computed). D = A's first 8 tokens: 1 block -> 4.
    E = A's prompt + its 8 outputs + 1 (19 tokens): 4 blocks (generated tokens' blocks were cached) -> 16.
    B' = A's prompt + 3 other tokens: its third block differs -> 8. F: a different first token -> 0. queries = the
    token counts."""
    llm = LLM(paths["llama"], dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, max_model_len=64,
              enable_prefix_caching=True, progress=False)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    a = rand_tokens(1, 10)
    out_a = run_checked(llm, [a], sp)[0]
    pc = llm.llm_engine.block_manager.prefix_cache
    assert (pc.queries, pc.hits) == (10, 0)
    cases = [(a + out_a[:3], 12), (a + [7, 8, 9], 8), (a, 8), (a[:8], 4), (a + out_a + [11], 16), ([3] + a[1:], 0)]
    for prompt, hits in cases:
        q0, h0 = pc.queries, pc.hits
        run_checked(llm, [prompt], sp)
        assert (pc.queries - q0, pc.hits - h0) == (len(prompt), hits), prompt
    st = llm.llm_engine.get_stats()
    assert st["prefix_cache_queries"] == 10 + 13 + 13 + 10 + 8 + 19 + 10
    assert st["prefix_cache_hits"] == 12 + 8 + 8 + 4 + 16


def test_prompt_logprobs_requests_do_not_read_the_cache(paths):
    """A request asking for prompt logprobs computes its whole prompt (its logprobs come from that compute) and
    is not counted as a query; its values equal those without prefix caching."""
    off, on = engines(paths["llama"], block_size=4, num_kv_blocks=64, max_model_len=64)
    p = rand_tokens(2, 20)
    sp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    ref = off.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
    on.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=2), use_tqdm=False)
    pc = on.llm_engine.block_manager.prefix_cache
    q = pc.queries
    got = on.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
    assert pc.queries == q
    assert got.prompt_logprobs == ref.prompt_logprobs and got.outputs[0].token_ids == ref.outputs[0].token_ids


# ---------------------------------------------------------------------------------------------- pressure
def test_preemption_while_blocks_are_shared(paths, monkeypatch):
    """A pool of 20 blocks x 8 for four requests sharing a 40-token prefix, decoding 30 tokens each: sequences
    are preempted while holding blocks that other running sequences share (refcount > 1). Tokens equal those
    without prefix caching; invariants hold after every step; the shared blocks' refcounts come back to 0."""
    shared_victims = []
    orig = Scheduler._preempt

    def spy(self, seq):
        pc = self.bm.prefix_cache
        if pc is not None:
            shared_victims.append(any(pc.ref[b] > 1 for b in seq.block_table))
        orig(self, seq)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    kw = dict(max_num_batched_tokens=32, max_num_seqs=4, block_size=8, num_kv_blocks=20, max_model_len=96)
    off, on = engines(paths["llama"], **kw)
    pre = rand_tokens(3, 40)
    prompts = [pre + rand_tokens(30 + i, 3 + i) for i in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    run_checked(on, [pre + [9]], SamplingParams(max_tokens=1))  # the prefix is cached before the four arrive
    assert run_checked(on, prompts, sp) == run_checked(off, prompts, sp)
    assert on.llm_engine.scheduler.num_preemptions > 0
    assert any(shared_victims), "no sequence was preempted while sharing blocks"
    assert all(r == 0 for r in on.llm_engine.block_manager.prefix_cache.ref)


def test_eviction_under_pressure_never_frees_a_block_in_use(paths, monkeypatch):
    """24 blocks x 8 and twelve requests with six distinct 40-token prefixes: cached blocks must be evicted for
    new ones (LRU). Every evicted block had refcount 0 (checked at each eviction), invariants hold after every
    step, and tokens equal those without prefix caching."""
    from tokenfab.engine.prefix_cache import PrefixCache
    evicted_refs = []
    orig = PrefixCache.take

    def spy(self, n):
        for b in list(self.evictable)[:max(0, n - len(self.free))]:
            evicted_refs.append(self.ref[b])
        return orig(self, n)

    monkeypatch.setattr(PrefixCache, "take", spy)
    kw = dict(max_num_batched_tokens=64, max_num_seqs=3, block_size=8, num_kv_blocks=24, max_model_len=96)
    off, on = engines(paths["deepseek_v3"], **kw)
    prompts = []
    for g in range(6):
        pre = rand_tokens(50 + g, 40)
        prompts += [pre + rand_tokens(70 + g, 5), pre + rand_tokens(90 + g, 9)]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert run_checked(on, prompts, sp) == run_checked(off, prompts, sp)
    pc = on.llm_engine.block_manager.prefix_cache
    assert pc.evictions > 0 and evicted_refs and all(r == 0 for r in evicted_refs)
    assert pc.hits > 0


def test_speculative_decoding_trim_keeps_refcounts(paths):
    """n-gram speculative decoding (k = 3, always drafting) on repetitive prompts sharing a prefix, with a pool of
    40 blocks x 4: rejected drafts' blocks go back through trim() while other blocks are shared. Tokens equal
    speculative decoding without prefix caching, invariants hold after every step, drafts were rejected."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
            "verify_token_cost": 0.0, "verify_step_overhead": 0.0, "random_row_cost": 0.0}
    off, on = engines(paths["llama"], block_size=4, num_kv_blocks=40, max_model_len=80, max_num_seqs=3,
                      speculative_config=spec)
    base = [11, 23, 37, 41, 53, 67, 79, 83, 97]
    prompts = [(base * 4)[:24 + i] for i in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    assert run_checked(on, prompts, sp, one_by_one=True) == run_checked(off, prompts, sp, one_by_one=True)
    assert run_checked(on, prompts, sp) == run_checked(off, prompts, sp)
    st = on.llm_engine.get_stats()
    assert st["prefix_cache_hits"] > 0
    assert 0 < st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]


# ---------------------------------------------------------------------------------------------- hybrid KDA
def test_kda_snapshot_fallback_and_junction_hand_worked(kl_path):
    """Blocks of 8, one request at a time, Kimi Linear (snapshots every 64 blocks, at the prompt's last full
    block, at a match's junction). A (45 tokens): snapshot at 40 -> hits 0. B = A[:30] + 20 new: cached blocks
    match 3 (24 tokens) but no snapshot at 24 or below -> falls back to 0 hits (a hit without state would be
    wrong) and keeps a snapshot at its junction, 24. C = A[:30] + 10 other: 24 hits. D = A + 6: the snapshot at
    40 -> 40 hits. Tokens equal those without prefix caching."""
    off, on = engines(kl_path, block_size=8, max_num_batched_tokens=64, max_num_seqs=4, num_kv_blocks=64,
                      max_model_len=96)  # room for 8 snapshots: none is evicted here
    a = rand_tokens(5, 45)
    prompts = [a, a[:30] + rand_tokens(6, 20), a[:30] + rand_tokens(7, 10), a + rand_tokens(8, 6)]
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    pc = on.llm_engine.block_manager.prefix_cache
    for prompt, hits in zip(prompts, (0, 0, 24, 40)):
        h0 = pc.hits
        assert run_checked(on, [prompt], sp) == run_checked(off, [prompt], sp)
        assert pc.hits - h0 == hits, (len(prompt), pc.hits - h0)
    assert pc.snapshots.num_restored == 2


def test_kda_abort_mid_prefill_restores_no_stale_state(kl_path):
    """A 100-token prompt is aborted after one 32-token chunk, then sent again (vLLM's hybrid caching restored
    state published before its step ran: vllm-project/vllm#56525). Only what ran is cached: the retry's tokens
    equal those without prefix caching."""
    off, on = engines(kl_path, block_size=8, max_num_batched_tokens=32, max_num_seqs=2, num_kv_blocks=64,
                      max_model_len=128)
    p = rand_tokens(9, 100)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    eng = on.llm_engine
    eng.add_request("a", None, p, sp)
    eng.step()
    assert eng.scheduler.running[0].num_computed_tokens == 32
    eng.abort_request("a")
    assert run_checked(on, [p], sp) == run_checked(off, [p], sp)
    assert run_checked(on, [p], sp) == run_checked(off, [p], sp)  # and once more, now with its own snapshots


def test_kda_preemption_mid_prefill_with_prefix_caching(kl_path, mid_prefill_preemptions):
    """Kimi Linear with a pool of 14 blocks x 8 for four ~50-token prompts sharing 24 tokens, 32-token chunks:
    sequences are preempted in the middle of their prefill while others restore snapshots; tokens equal those
    without prefix caching, invariants hold after every step."""
    kw = dict(max_num_batched_tokens=32, max_num_seqs=4, block_size=8, num_kv_blocks=14, max_model_len=96)
    off, on = engines(kl_path, **kw)
    pre = rand_tokens(11, 24)
    prompts = [pre + rand_tokens(12 + i, n) for i, n in enumerate((26, 23, 28, 21))]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    run_checked(on, [pre + [5]], SamplingParams(max_tokens=1))  # snapshot at 24 (the prompt's last full block)
    assert run_checked(on, prompts, sp) == run_checked(off, prompts, sp)
    assert on.llm_engine.scheduler.num_preemptions > 0 and any(mid_prefill_preemptions)
    assert on.llm_engine.block_manager.prefix_cache.snapshots.num_restored > 0


# ---------------------------------------------------------------------------------------------- YaRN
def test_yarn_positions_past_the_original_window_exact_with_cached_blocks(tiny_model):
    """DeepSeek-V3 tiny with YaRN (original window 64, factor 40): a 200-token prompt is cached, then a request
    extending it by 20 tokens reuses 200 tokens of cached MLA blocks and computes the rest in 16-token chunks.
    Its greedy tokens and their logprobs at positions 220-235 (far past the original window) match transformers
    within 1e-4 (a cached block written at the wrong position or with the wrong rotary would not)."""
    path = tiny_model("deepseek_v3")
    ref = load_reference(path)
    llm = LLM(path, dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=16, num_kv_blocks=64,
              max_model_len=256, enable_prefix_caching=True, progress=False)
    base = rand_tokens(13, 200)
    llm.generate([{"prompt_token_ids": base + [7]}], SamplingParams(max_tokens=1), use_tqdm=False)
    prompt = base + rand_tokens(14, 20)
    pc = llm.llm_engine.block_manager.prefix_cache
    h0 = pc.hits
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    assert pc.hits - h0 == 200
    full = prompt + out.token_ids
    lp = reference_logprobs(ref, full)
    assert out.token_ids == lp[len(prompt) - 1:-1].argmax(-1).tolist()
    worst = max(abs(d[full[len(prompt) + j]].logprob - lp[len(prompt) + j - 1, full[len(prompt) + j]].item())
                for j, d in enumerate(out.logprobs))
    assert worst < 1e-4, worst


# ---------------------------------------------------------------------------------------------- surface
def test_flags_and_metrics(paths):
    """``--enable-prefix-caching`` / ``--no-enable-prefix-caching`` reach the EngineConfig; a non-bool is refused
    by name; /metrics exposes vLLM's prefix-cache counters from the engine's stats."""
    from tokenfab.cli import build_parser
    from tokenfab.engine.engine_config import EngineConfig
    from tokenfab.errors import EngineConfigError
    from tokenfab.server.launch import engine_config_from_args
    from tokenfab.server.metrics import ServerMetrics
    llama = paths["llama"]
    for flag, want in (("--enable-prefix-caching", True), ("--no-enable-prefix-caching", False)):
        args = build_parser().parse_args(["serve", llama, "--device", "cpu", flag])
        assert engine_config_from_args(args).enable_prefix_caching is want
    with pytest.raises(EngineConfigError, match="enable_prefix_caching must be True or False"):
        EngineConfig(model=llama, enable_prefix_caching="yes")
    m = ServerMetrics("m")
    text = m.render({"prefix_cache_queries": 120, "prefix_cache_hits": 48}).decode()
    assert 'vllm:prefix_cache_queries_total{model_name="m"} 120.0' in text
    assert 'vllm:prefix_cache_hits_total{model_name="m"} 48.0' in text


def test_prefix_repetition_dataset(tokenizer_dir):
    """vLLM's prefix_repetition workload: G groups of num_prompts // G prompts; within a group every prompt starts
    with the same prefix text and has its own suffix; lengths as asked (re-tokenized); flags checked by name."""
    from transformers import AutoTokenizer

    from tokenfab.bench import BenchError
    from tokenfab.bench.datasets import get_samples, sample_prefix_repetition_requests
    from tokenfab.bench.serve import make_args
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    reqs = sample_prefix_repetition_requests(tok, 10, prefix_len=40, suffix_len=12, num_prefixes=3, output_len=7,
                                             seed=1, disable_shuffle=True)
    assert len(reqs) == 9 and all(r.expected_output_len == 7 for r in reqs)
    ids = [tok.encode(r.prompt, add_special_tokens=False) for r in reqs]
    assert [r.prompt_len for r in reqs] == [len(i) for i in ids]
    for g in range(3):
        group = ids[3 * g:3 * g + 3]
        common = min(len(i) for i in group)
        while common and not all(i[:common] == group[0][:common] for i in group):
            common -= 1
        assert 36 <= common < 52, common  # the prefix is shared (a merge at its end may cost a token or so)
        assert len({tuple(i) for i in group}) == 3  # the suffixes differ
    firsts = {tuple(i[:30]) for i in ids}
    assert len(firsts) == 3  # groups differ
    shuffled = get_samples(make_args(dataset_name="prefix_repetition", num_prompts=10, prefix_repetition_prefix_len=40,
                                     prefix_repetition_suffix_len=12, prefix_repetition_num_prefixes=3,
                                     prefix_repetition_output_len=7, seed=1), tok)
    assert sorted(r.prompt for r in shuffled) == sorted(r.prompt for r in reqs)
    with pytest.raises(BenchError, match="--prefix-repetition-num-prefixes"):
        sample_prefix_repetition_requests(tok, 10, num_prefixes=0)
    with pytest.raises(BenchError, match="--num-prompts .* must be >= --prefix-repetition-num-prefixes"):
        sample_prefix_repetition_requests(tok, 2, num_prefixes=3)


def test_tensor_parallel_outputs_identical_with_and_without_prefix_caching(paths):
    """Tensor parallel 3 (DeepSeek-V3: MLA latent cache and experts sharded): rank 0 owns the block manager and its
    cache, the workers hold their shards of the same blocks. Shared-prefix prompts one by one give the same greedy
    tokens as the same TP engine without prefix caching, with hits counted."""
    prompts = shared_prefix_prompts(20, 40, [3, 17])
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = dict(max_num_batched_tokens=32, max_num_seqs=2, block_size=8, num_kv_blocks=48, max_model_len=96,
              tensor_parallel_size=3, dtype="float32", progress=False)
    outs = {}
    for caching in (False, True):
        llm = LLM(paths["deepseek_v3"], enable_prefix_caching=caching, **kw)
        outs[caching] = [llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0].outputs[0].token_ids
                         for p in prompts]
        if caching:
            assert llm.llm_engine.block_manager.prefix_cache.hits > 0
        llm.llm_engine.shutdown()  # workers and the process group go, so later TP engines in this process start clean
    assert outs[True] == outs[False]


def test_tensor_parallel_hybrid_prefix_caching_refused_by_name(paths):
    """KDA state snapshots would have to be taken on every rank: refused when the engine starts, naming both
    settings and what to do."""
    from tokenfab.errors import UnsupportedError
    with pytest.raises(UnsupportedError, match="enable_prefix_caching.*tensor_parallel_size"):
        LLM(paths["kimi_linear"], enable_prefix_caching=True, tensor_parallel_size=2, dtype="float32",
            progress=False)
