"""Batch-invariant mode (``LLM(batch_invariant=True)``, ``tokenfab serve --batch-invariant``): in bfloat16 a
request's tokens and logprobs are bit-identical alone, beside copies of itself, beside different requests and under
another token budget (so another chunking of its prompt), for a dense model (Llama), MLA + MoE (DeepSeek-V3) and a
softmax-routed MoE (Qwen3-MoE), and on the real default model SmolLM2-135M-Instruct. The reference for every
comparison is the same request run alone in its own engine: nothing is hard-coded.

The default mode is shown to differ on the same comparisons (its GEMV and brgemm paths, its tied LM head and its
prefill attention round differently), which is what the mode exists for.
"""
from __future__ import annotations

import pytest

from tokenfab import LLM, SamplingParams
from tokenfab.errors import UnsupportedError
from tokenfab.kernels.cpu.ops import attention as cpu_attention
from tokenfab.kernels.cpu.ops import batch_invariant as cpu_batch_invariant
from tokenfab.kernels.cpu.ops import support as cpu_support
from tokenfab.kernels.cpu.ops import vnni_linear as cpu_vnni

pytestmark = pytest.mark.skipif(not cpu_support.has_bf16_dot(),
                                reason="batch-invariant mode needs the CPU kernels with AVX512-BF16")

FAMILIES = ("llama", "deepseek_v3", "qwen3_moe")


# ------------------------------------------------------------------------------------------------- the kernels
@pytest.mark.parametrize("n,k,bias", [(960, 576, False), (576, 1536, True), (200, 64, False), (100, 2050, True),
                                      (49, 96, False)])
def test_linear_rows_do_not_depend_on_the_row_count_or_place(n, k, bias):
    """In the mode, row r of vnni_linear(x[:M]) has the same bits for every M (1..300, across the 4-row GEMV
    threshold of the default mode and the 64-row brgemm tiles) and at any offset in the batch; the default mode's
    GEMV (M <= 4) and brgemm (M > 4) give a row different bits."""
    import torch
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(300, k, generator=g).bfloat16()
    p = cpu_vnni.pack_linear_weight(w)
    with cpu_batch_invariant.batch_invariant():
        ref = torch.cat([cpu_vnni.vnni_linear(x[i:i + 1], p, n, b) for i in range(8)])
        for m in (1, 2, 3, 4, 5, 7, 8, 63, 64, 65, 129, 300):
            assert torch.equal(cpu_vnni.vnni_linear(x[:m], p, n, b)[:8], ref[:m]), m
        rolled = cpu_vnni.vnni_linear(torch.roll(x, 37, 0), p, n, b)
        assert torch.equal(torch.roll(rolled, -37, 0)[:8], ref)
    assert not cpu_batch_invariant.batch_invariant_active()
    if k >= 576:  # reductions long enough that the default mode's two orders part somewhere in 64 rows
        gemv = torch.cat([cpu_vnni.vnni_linear(x[i:i + 1], p, n, b) for i in range(64)])
        assert not torch.equal(gemv, cpu_vnni.vnni_linear(x[:64], p, n, b))


def test_decode_attention_does_not_split_a_context_in_the_mode():
    """MLA-shaped decode attention (one latent KV head of 576, bf16): alone a sequence is split across threads
    (flash-decoding) in the default mode, beside 7 others it is not; in the mode it has the same bits either way."""
    import torch
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: the default mode does not split either")
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(64, 16, 1, 576, generator=g).bfloat16()
    q = torch.randn(8, 16, 576, generator=g).bfloat16()
    bt = torch.randperm(64, generator=g)[:64].view(8, 8).contiguous()
    lens = torch.tensor([120, 77, 128, 5, 64, 99, 31, 128])

    def attend(rows):
        return cpu_attention.paged_decode_attention(q[rows], cache, cache[..., :512], bt[rows].contiguous(),
                                                    lens[rows], 0.05)
    with cpu_batch_invariant.batch_invariant():
        batch = attend(slice(0, 8))
        assert all(torch.equal(attend(slice(i, i + 1))[0], batch[i]) for i in range(8))
    assert not all(torch.equal(attend(slice(i, i + 1))[0], attend(slice(0, 8))[i]) for i in range(8))


def test_router_dot_does_not_depend_on_the_row_count():
    import torch
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(70, 300, generator=g), torch.randn(16, 300, generator=g)
    y = cpu_batch_invariant.rowwise_linear_f32(x, w)
    assert torch.equal(torch.cat([cpu_batch_invariant.rowwise_linear_f32(x[i:i + 1], w) for i in range(70)]), y)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------------------------- the engine
def _prompt(seed: int, n: int, vocab: int = 512) -> list[int]:
    return [(seed * 7919 + i * 104729) % (vocab - 3) + 3 for i in range(n)]


TARGETS = [  # (prompt, params): greedy with logprobs and prompt logprobs, seeded sampling with and without logprobs
    (_prompt(1, 37), SamplingParams(temperature=0.0, max_tokens=20, logprobs=3, prompt_logprobs=2, ignore_eos=True)),
    (_prompt(2, 29), SamplingParams(temperature=0.9, seed=1234, max_tokens=20, logprobs=3, ignore_eos=True)),
    (_prompt(3, 41), SamplingParams(temperature=1.0, seed=99, max_tokens=20, ignore_eos=True)),
]
OTHERS = [  # seven different requests: other lengths and every kind of draw (top-k / top-p rows, penalties, greedy)
    (_prompt(10 + i, 5 + 9 * i), SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, max_tokens=6 + 3 * i,
                                                repetition_penalty=rp, logprobs=lp, ignore_eos=True))
    for i, (t, k, p, s, rp, lp) in enumerate([(0.0, 0, 1.0, None, 1.0, None), (0.7, 20, 1.0, 5, 1.0, 2),
                                              (1.2, 0, 0.9, 6, 1.0, None), (1.0, 0, 1.0, None, 1.3, None),
                                              (0.5, 5, 0.8, 7, 1.0, 1), (0.0, 0, 1.0, None, 1.1, 4),
                                              (1.0, 0, 1.0, 8, 1.0, None)])
]


def _result(out) -> tuple:
    """Everything a request returns that must not move: tokens, chosen and top logprobs, prompt logprobs."""
    c = out.outputs[0]
    lps = None if c.logprobs is None else [sorted(d.items()) for d in c.logprobs]
    plp = None if out.prompt_logprobs is None else [None if d is None else sorted(d.items())
                                                    for d in out.prompt_logprobs]
    return tuple(c.token_ids), repr(lps), repr(plp)


def _gen(llm: LLM, reqs) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)
    return [_result(o) for o in outs]


def _staggered(llm: LLM, target, others, after: int) -> tuple:
    """The target's result when ``others`` (prompt, params) arrive after its ``after``-th step, as requests reach a
    server while another decodes: its decode rows then share steps with their prefill chunks."""
    eng = llm.llm_engine
    eng.add_request("target", None, target[0], target[1])
    result, steps = None, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id == "target" and o.finished:
                result = _result(o)
        steps += 1
        if steps == after:
            for i, (p, sp) in enumerate(others):
                eng.add_request(f"other-{i}", None, p, sp)
    return result


def _llm(path: str, budget: int, invariant: bool) -> LLM:
    return LLM(path, dtype="bfloat16", max_model_len=256, max_num_seqs=16, max_num_batched_tokens=budget,
               max_logprobs=-1, batch_invariant=invariant, progress=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_bit_identical_alone_in_any_batch_and_any_chunking(tiny_model, family):
    path = tiny_model(family)
    llm = _llm(path, 256, True)
    alone = [_gen(llm, [t])[0] for t in TARGETS]
    assert all(len(a[0]) == 20 for a in alone)
    for i, t in enumerate(TARGETS):
        assert _gen(llm, [t] * 4) == [alone[i]] * 4, f"{family}: target {i} beside 3 copies"
    mixed = _gen(llm, OTHERS[:4] + TARGETS + OTHERS[4:])  # the targets in the middle of the batch
    assert mixed[4:7] == alone, f"{family}: targets beside 7 different requests"
    # another token budget: the prompts are cut into chunks of 7 tokens and share steps differently
    chunked = _llm(path, 7, True)
    assert [_gen(chunked, [t])[0] for t in TARGETS] == alone, f"{family}: chunked prefill, alone"
    assert _gen(chunked, OTHERS[4:] + TARGETS + OTHERS[:4])[3:6] == alone, f"{family}: chunked, in a batch"
    for i, t in enumerate(TARGETS):  # copies and others arriving while it decodes: mixed decode + prefill steps
        assert _staggered(llm, t, [t] * 3, 3) == alone[i], f"{family}: target {i}, 3 copies arriving later"
        assert _staggered(chunked, t, OTHERS, 5) == alone[i], f"{family}: target {i}, 7 others arriving later"


def test_refused_by_name_where_it_does_not_hold(tiny_model):
    path = tiny_model("llama")
    with pytest.raises(UnsupportedError, match="bfloat16"):
        LLM(path, dtype="float32", batch_invariant=True, progress=False)
    with pytest.raises(UnsupportedError, match="CPU only"):
        LLM(path, device="cuda", batch_invariant=True, progress=False)
    with pytest.raises(UnsupportedError, match="tensor_parallel_size"):
        LLM(path, tensor_parallel_size=2, batch_invariant=True, progress=False)
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        LLM(path, batch_invariant="yes", progress=False)


def test_serve_flag_reaches_the_engine_config(tiny_model):
    from tokenfab.cli import build_parser
    from tokenfab.server.launch import engine_config_from_args
    path = tiny_model("llama")
    assert engine_config_from_args(build_parser().parse_args(["serve", path, "--batch-invariant"])).batch_invariant
    assert not engine_config_from_args(build_parser().parse_args(["serve", path])).batch_invariant


# ------------------------------------------------------------------------------------- the real default model
def _chat_prompts(llm: LLM) -> list[list[int]]:
    from tokenfab.commands.demo import DEMO_CHAT_PROMPTS
    tok = llm.get_tokenizer()
    out = []
    for p in DEMO_CHAT_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        out.append(list(ids["input_ids"]) if isinstance(ids, dict) else list(ids))
    return out


def _smol_llm(path: str, budget: int, invariant: bool) -> LLM:
    return LLM(path, dtype="bfloat16", max_model_len=512, max_num_seqs=16, max_num_batched_tokens=budget,
               batch_invariant=invariant, progress=False)


@pytest.mark.slow
def test_smollm2_bit_identical_alone_in_any_batch_and_any_chunking(smol):
    llm = _smol_llm(smol, 512, True)
    chat = _chat_prompts(llm)
    targets = [(chat[0], SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, prompt_logprobs=1)),
               (chat[1], SamplingParams(temperature=0.8, seed=7, max_tokens=24, logprobs=2))]
    others = [(_prompt(20 + i, 8 + 21 * i, 49152), SamplingParams(temperature=t, top_k=k, seed=s,
                                                                  max_tokens=8 + 4 * i, ignore_eos=True))
              for i, (t, k, s) in enumerate([(0.0, 0, None), (0.7, 40, 3), (1.0, 0, 4), (0.0, 0, None),
                                             (1.1, 0, None), (0.6, 10, 5), (0.0, 0, None)])]
    alone = [_gen(llm, [t])[0] for t in targets]
    for i, t in enumerate(targets):
        assert _gen(llm, [t] * 4) == [alone[i]] * 4, f"target {i} beside 3 copies"
    assert _gen(llm, others[:3] + targets + others[3:])[3:5] == alone, "beside 7 different requests"
    chunked = _smol_llm(smol, 16, True)  # prompts of ~40 tokens cut into chunks of <= 16, shared with the others
    assert _gen(chunked, others[3:] + targets + others[:3])[4:6] == alone, "chunked, in a batch"
    for i, t in enumerate(targets):  # the README's case: beside three copies, arriving while it decodes
        assert _staggered(llm, t, [t] * 3, 2) == alone[i], f"target {i}, 3 copies arriving later"


@pytest.mark.slow
def test_smollm2_default_mode_differs_beside_three_copies(smol):
    """What the README claimed and bf16 broke: the greedy answer to the third demo prompt alone, and beside three
    copies of it that arrive while it decodes (its decode row then shares steps with their prefill chunks, on the
    brgemm path instead of the GEMV). The default mode's logprobs move (on the 2-core VM its tokens part at the 7th
    token); batch-invariant mode gives the same bits."""
    target_of = lambda llm: (_chat_prompts(llm)[2], SamplingParams(temperature=0.0, max_tokens=48,  # noqa: E731
                                                                     logprobs=1))
    default = _smol_llm(smol, 512, False)
    t = target_of(default)
    alone = _gen(default, [t])[0]
    assert _staggered(default, t, [t] * 3, 2)[1] != alone[1]
    invariant = _smol_llm(smol, 512, True)
    t = target_of(invariant)
    assert _staggered(invariant, t, [t] * 3, 2) == _gen(invariant, [t])[0]
