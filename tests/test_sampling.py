"""Sampling: seeded reproducibility independent of batch mates, the empirical distribution against
softmax(logits / T) from the reference, top-k / top-p support, stop strings, stop tokens, EOS, max_tokens."""
from __future__ import annotations

import math
import random

import pytest
import torch

from tokenfab import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model("llama"), dtype="float32", max_model_len=128, max_num_seqs=256, progress=False)


PROMPT = [7, 81, 19, 300, 42, 5, 77]


def test_seed_reproducible_whatever_the_batch(llm):
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": PROMPT}], sp)[0].outputs[0].token_ids
    rng = random.Random(0)
    mates = [{"prompt_token_ids": [rng.randrange(5, 500) for _ in range(rng.randrange(3, 40))]} for _ in range(6)]
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)  # unseeded mates
    batch = llm.generate(mates[:3] + [{"prompt_token_ids": PROMPT}] + mates[3:], [other] * 3 + [sp] + [other] * 3)
    assert batch[3].outputs[0].token_ids == alone
    different = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=1.0, seed=99, max_tokens=16,
                                                                            ignore_eos=True))
    assert different[0].outputs[0].token_ids != alone


def _first_token_counts(llm, params: SamplingParams, total: int, seeded: bool = True) -> torch.Tensor:
    counts = torch.zeros(512)
    n_req = 8
    for r in range(n_req):
        sp = SamplingParams(n=total // n_req, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                            max_tokens=1, ignore_eos=True, seed=1000 + 100_000 * r if seeded else None)
        out = llm.generate([{"prompt_token_ids": PROMPT}], sp)[0]
        for c in out.outputs:
            counts[c.token_ids[0]] += 1
    return counts


def _chi_square(counts: torch.Tensor, probs: torch.Tensor, bins: int = 12) -> float:
    """Pearson chi-square over the ``bins`` most likely tokens plus one bin for all others."""
    n = counts.sum()
    top = probs.argsort(descending=True)[:bins]
    obs = torch.cat([counts[top], (n - counts[top].sum()).view(1)])
    exp = torch.cat([probs[top], (1 - probs[top].sum()).view(1)]) * n
    return float(((obs - exp) ** 2 / exp).sum())


@pytest.mark.parametrize("seeded", [True, False])
def test_sampled_distribution_matches_softmax(llm, llama_ref, seeded):
    """4,000 first-token samples at T = 0.8 against softmax(logits / 0.8) of the reference: Pearson chi-square
    with 12 degrees of freedom must stay below 32.9 (p = 0.001). The same samples scored against T = 1.0 must fail
    the test, so it can tell temperatures apart. Seeded rows (a uniform from the request's RNG) and unseeded rows
    (uniforms from the engine's RNG) are both checked; both go through the inverse-CDF draw."""
    with torch.no_grad():
        logits = llama_ref(torch.tensor([PROMPT])).logits[0, -1].float()
    counts = _first_token_counts(llm, SamplingParams(temperature=0.8), 4000, seeded=seeded)
    stat = _chi_square(counts, torch.softmax(logits / 0.8, -1))
    wrong = _chi_square(counts, torch.softmax(logits / 1.0, -1))
    print(f"\nchi2 at T=0.8: {stat:.1f} (right), {wrong:.1f} (T=1.0, wrong)")
    assert stat < 32.9
    assert wrong > 32.9


def test_top_k_top_p_restrict_support(llm, llama_ref):
    with torch.no_grad():
        logits = llama_ref(torch.tensor([PROMPT])).logits[0, -1].float()
    order = logits.argsort(descending=True)
    counts = _first_token_counts(llm, SamplingParams(temperature=1.0, top_k=3), 800)
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(order[:3].tolist())
    probs = torch.softmax(logits[order[:3]], -1)
    obs = counts[order[:3]] / counts.sum()
    assert torch.allclose(obs, probs, atol=4 * math.sqrt(0.25 / 800))
    p_sorted = torch.softmax(logits, -1)[order]
    k_nucleus = int((p_sorted.cumsum(0) < 0.5).sum()) + 1  # smallest prefix with mass >= 0.5
    counts = _first_token_counts(llm, SamplingParams(temperature=1.0, top_p=0.5), 400)
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(order[:k_nucleus].tolist())


def test_stop_string_eos_stop_token_and_max_tokens(llm):
    base = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=24,
                                                                      ignore_eos=True))[0].outputs[0]
    assert len(base.token_ids) == 24 and base.finish_reason == "length"
    text = base.text
    assert len(text) > 8
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text.find(stop)
    o = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                                   stop=[stop]))[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop and o.text == text[:cut]
    third = base.token_ids[2]
    o = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                                   stop_token_ids=[third]))[0].outputs[0]
    first = base.token_ids.index(third)
    assert o.token_ids == base.token_ids[: first + 1] and o.finish_reason == "stop" and o.stop_reason == third
    eng = llm.llm_engine
    saved = eng.eos_token_ids
    eng.eos_token_ids = [third]
    try:
        o = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
        assert o.token_ids == base.token_ids[: first + 1] and o.finish_reason == "stop"
        o = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=24,
                                                                       ignore_eos=True))[0].outputs[0]
        assert o.token_ids == base.token_ids
    finally:
        eng.eos_token_ids = saved


def test_logprobs_top_k_and_max_model_len(llm, llama_ref):
    o = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                                   logprobs=5))[0].outputs[0]
    with torch.no_grad():
        lp = torch.log_softmax(llama_ref(torch.tensor([PROMPT])).logits[0, -1].float(), -1)
    top = lp.topk(5)
    d = o.logprobs[0]
    assert set(d) == set(top.indices.tolist())  # greedy token is the top-1, so 5 entries
    for t, v in zip(top.indices.tolist(), top.values.tolist()):
        assert abs(d[t].logprob - v) < 1e-4
    long_prompt = [5] * 120
    o = llm.generate([{"prompt_token_ids": long_prompt}], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert len(o.outputs[0].token_ids) == 128 - 120 and o.outputs[0].finish_reason == "length"


def test_inverse_cdf_sample_hand_worked():
    """probs [0.2, 0, 0.5, 0.3] (cdf 0.2, 0.2, 0.7, 1.0): u picks the first index whose cdf exceeds u; the zero-mass
    index 1 is never drawn, not even at u = 0.2 exactly or u -> 1 with a masked tail; unnormalized rows scale u."""
    from tokenfab.engine.sampler import inverse_cdf_sample

    p = torch.tensor([0.2, 0.0, 0.5, 0.3])
    u = torch.tensor([0.0, 0.1, 0.2, 0.25, 0.69, 0.71, 0.999, 1.0 - 2 ** -24])
    got = inverse_cdf_sample(p.expand(len(u), 4).contiguous(), u).tolist()
    assert got == [0, 0, 2, 2, 2, 3, 3, 3]
    masked_tail = torch.tensor([[0.25, 0.75, 0.0, 0.0]])
    assert inverse_cdf_sample(masked_tail, torch.tensor([1.0 - 2 ** -24])).tolist() == [1]
    unnormalized = torch.tensor([[2.0, 6.0]])  # mass 0.25 / 0.75
    assert inverse_cdf_sample(unnormalized, torch.tensor([0.24])).tolist() == [0]
    assert inverse_cdf_sample(unnormalized, torch.tensor([0.26])).tolist() == [1]


@pytest.mark.skipif(not __import__("tokenfab.kernels.cpu.ops.support", fromlist=["x"]).available_for(torch.zeros(1)),
                    reason="CPU kernels not built")
def test_sample_plain_kernel_draws_the_inverse_cdf_index():
    """The one-pass C++ sampler against a float64 inverse CDF of softmax(x / t) with the same uniforms: the drawn
    index j satisfies cdf[j-1] <= u < cdf[j] up to 1e-5 (float32 exponentials), greedy rows (t = 0) give the first
    argmax, and -inf logits are never drawn, even for u at the very end of the distribution."""
    from tokenfab.kernels.cpu.ops import sampling as cpu_sampling
    g = torch.Generator().manual_seed(3)
    N, V = 64, 1000
    x = torch.randn(N, V, generator=g) * 3
    x[:, 997:] = float("-inf")  # masked tail (min_tokens)
    x[5, 10] = x[5, 20] = 50.0  # a tie for the greedy row
    temps = torch.rand(N, generator=g) * 1.5 + 0.1
    temps[5] = 0.0
    u = torch.rand(N, generator=g)
    u[7] = 1.0 - 2 ** -24
    got = cpu_sampling.sample_plain(x, temps, u)
    assert got[5].item() == 10
    p = torch.softmax(x.double() / temps.double().clamp_min(1e-5).unsqueeze(1), dim=-1)
    cdf = p.cumsum(-1)
    for i in range(N):
        if i == 5:
            continue
        j = got[i].item()
        assert j < 997 and p[i, j] > 0
        lo = cdf[i, j - 1].item() if j else 0.0
        assert lo - 1e-5 <= u[i].item() < cdf[i, j].item() + 1e-5, (i, j)
