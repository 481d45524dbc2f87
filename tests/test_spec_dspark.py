"""DSpark (``method: "dspark"``): both published config layouts read strictly, the draft network against a
hand-written float64 reference on the same weights and taps, the Markov bias applied in order (hand-worked), and
speculation end to end (greedy outputs identical with and without, acceptance counters).

The references never call tokenfab's drafter code: MLA in expanded form per head with explicit loops (the drafter
runs the absorbed form), RoPE by explicit pair rotation, KDA by the naive recurrence of tests/test_kimi_k3.py.
"""
from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch

from test_kimi_k3 import naive_k3_trace, naive_kda, naive_rms
from tokenfab.errors import EngineConfigError, UnsupportedError, WeightLoadError
from tokenfab.spec_decode.dspark_config import parse_dspark_config, resolve_tap
from tokenfab.testing.tiny_dspark import KDA, MLA, dspark_config, write_tiny_dspark

V, D = 512, 64
K3_5MLA = ["mla"] * 5
K3_4KDA = ["kda", "kda", "mla", "kda", "kda"]


# ---- reference (float64, independent) --------------------------------------------------------------------------
def ref_rope(x, pos, theta):
    """Adjacent pairs (x[2i], x[2i+1]) rotated by pos * theta^(-2i/R), one element at a time."""
    out = x.clone()
    R = x.shape[-1]
    for i in range(R // 2):
        ang = pos * theta ** (-2 * i / R)
        c, s = math.cos(ang), math.sin(ang)
        a, b = float(x[2 * i]), float(x[2 * i + 1])
        out[2 * i], out[2 * i + 1] = a * c - b * s, b * c + a * s
    return out


def ref_mla(h, ctx, W, a, pos_ctx, pos_blk, eps, theta):
    """Expanded MLA (keys/values through kv_b_proj per head); queries = block, keys = [context | block], every
    block slot sees the whole block (non-causal) and all context."""
    H, nope, R, vd, C = (MLA[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                          "v_head_dim", "kv_lora_rank"))
    src = torch.cat([ctx, h]) if ctx is not None else h
    pos = list(pos_ctx) + list(pos_blk)
    ckv = src @ W[a + "kv_a_proj_with_mqa.weight"].T
    lat = naive_rms(ckv[:, :C], W[a + "kv_a_layernorm.weight"], eps)
    kpe = torch.stack([ref_rope(ckv[j, C:], pos[j], theta) for j in range(len(pos))])
    kv = (lat @ W[a + "kv_b_proj.weight"].T).view(len(pos), H, nope + vd)
    q = (naive_rms(h @ W[a + "q_a_proj.weight"].T, W[a + "q_a_layernorm.weight"], eps) @ W[a + "q_b_proj.weight"].T)
    q = q.view(h.shape[0], H, nope + R)
    o = torch.zeros(h.shape[0], H, vd, dtype=torch.float64)
    for hh in range(H):
        for t in range(h.shape[0]):
            qr = ref_rope(q[t, hh, nope:], pos_blk[t], theta)
            sc = [(float(q[t, hh, :nope] @ kv[j, hh, :nope]) + float(qr @ kpe[j])) * (nope + R) ** -0.5
                  for j in range(len(pos))]
            m = max(sc)
            e = [math.exp(s - m) for s in sc]
            for j in range(len(pos)):
                o[t, hh] += e[j] / sum(e) * kv[j, hh, nope:]
    o = o.reshape(h.shape[0], H * vd) * torch.sigmoid(h @ W[a + "g_proj.weight"].T)
    return o @ W[a + "o_proj.weight"].T


def ref_block_logits(W, types, taps, anchor, mask_id, N, embed, lm_head, eps=1e-5, theta=10000.0):
    """Draft block logits [N, V] (every slot) for one sequence whose context is ``taps`` [L, n * Ht]."""
    L = taps.shape[0]
    ctx = naive_rms(taps @ W["fc.weight"].T, W["hidden_norm.weight"], eps) if L else None
    x = embed[[anchor] + [mask_id] * (N - 1)]
    pos_blk = [L + j for j in range(N)]
    tc = {"linear_attn_config": KDA, "rms_norm_eps": eps}
    for i, kind in enumerate(types):
        p = f"layers.{i}."
        h = naive_rms(x, W[p + "input_layernorm.weight"], eps)
        if kind == "mla":
            a = ref_mla(h, ctx, W, p + "self_attn.", list(range(L)), pos_blk, eps, theta)
        else:
            Wk = {k: (v.unsqueeze(1) if k.endswith("conv1d.weight") and v.dim() == 2 else v) for k, v in W.items()}
            a = naive_kda(h, Wk, p + "self_attn.", tc)  # from a zero state over the block only
        x = x + a
        hm = naive_rms(x, W[p + "post_attention_layernorm.weight"], eps)
        g, u = hm @ W[p + "mlp.gate_proj.weight"].T, hm @ W[p + "mlp.up_proj.weight"].T
        x = x + (g * torch.sigmoid(g) * u) @ W[p + "mlp.down_proj.weight"].T
    return naive_rms(x, W["norm.weight"], eps) @ lm_head.T


def _drafter(path, embed, lm_head):
    from tokenfab.models.dspark_drafter import DSparkDrafter, load_dspark_weights
    from tokenfab.spec_decode.dspark_config import load_dspark_config
    cfg = load_dspark_config(path)
    dr = DSparkDrafter(cfg, torch.nn.Embedding.from_pretrained(embed.float()), lambda h: h.float() @ lm_head.float().T)
    skipped = load_dspark_weights(dr, path, torch.float32)
    return dr, skipped


@pytest.mark.parametrize("layout, types", [("specforge", K3_5MLA), ("specforge", K3_4KDA),
                                           ("speculators", K3_5MLA), ("speculators", ["mla", "kda"])])
def test_block_logits_match_reference(tmp_path, layout, types):
    """Tiny random drafters in each published layout load, and one draft pass (two sequences with different
    context lengths, batched, padded) gives the reference's logits at every draft slot within 1e-4 (fp32 drafter vs
    float64 reference)."""
    path, cfg, W = write_tiny_dspark(str(tmp_path / "d"), layout, types, target_layer_ids=(0, 2))
    g = torch.Generator().manual_seed(1)
    embed, lm_head = torch.randn(V, D, generator=g), torch.randn(V, D, generator=g) * 0.2
    dr, skipped = _drafter(path, embed, lm_head)
    assert (skipped == ["embed_tokens.weight"]) == (layout == "specforge")
    assert dr.cfg.num_drafts == (4 if layout == "speculators" else 3)  # sample_from_anchor: speculators' default
    W64 = {k: v.double() for k, v in W.items()}
    lens, anchors = [9, 4], [17, 250]
    taps = [torch.randn(n, 2 * D, generator=g) for n in lens]
    rows = [dr.context_rows(dr.context(t), torch.arange(len(t))) for t in taps]
    Lm = max(lens)
    ctx = [torch.stack([torch.cat([r[li], r[li].new_zeros(Lm - len(r[li]), r[li].shape[1])]) for r in rows])
           for li in range(len(dr.mla_layers))]
    valid = torch.tensor([[j < n for j in range(Lm)] for n in lens])
    with torch.no_grad():
        hid = dr.block(torch.tensor(anchors), torch.tensor(lens), ctx, valid)
        got = dr.draft_logits(hid).double()
    for b in range(2):
        want = ref_block_logits(W64, types, taps[b].double(), anchors[b], cfg_mask(cfg), 4, embed.double(),
                                lm_head.double())
        want = want if dr.cfg.sample_from_anchor else want[1:]
        err = (got[b] - want).abs().max().item()
        assert err < 1e-4, (b, err)


def cfg_mask(cfg):
    return cfg["mask_token_id"] if "mask_token_id" in cfg else cfg["dflash_config"]["mask_token_id"]


def test_padded_context_rows_are_masked(tmp_path):
    """Context rows past a sequence's length (padding in a batch) change nothing (4KDA+1MLA drafter)."""
    path, cfg, W = write_tiny_dspark(str(tmp_path / "d"), "specforge", K3_4KDA)
    g = torch.Generator().manual_seed(2)
    embed, lm_head = torch.randn(V, D, generator=g), torch.randn(V, D, generator=g) * 0.2
    dr, _ = _drafter(path, embed, lm_head)
    taps = torch.randn(6, 2 * D, generator=g)
    (rows,) = dr.context_rows(dr.context(taps), torch.arange(6))
    with torch.no_grad():
        a = dr.block(torch.tensor([5]), torch.tensor([4]), [rows[None, :6]], torch.tensor([[True] * 4 + [False] * 2]))
        b = dr.block(torch.tensor([5]), torch.tensor([4]), [torch.cat([rows[None, :4], 9 * rows[None, 4:]], 1)],
                     torch.tensor([[True] * 4 + [False] * 2]))
        assert torch.equal(a, b)


# ---- Markov bias in order (hand-worked) ------------------------------------------------------------------------
def test_markov_bias_applied_in_order():
    """V = 3, two drafts. base logits: slot 0 [0, 1, 0], slot 1 [0, 0, 0.5]. Markov bias(prev): prev 0 -> [0, 0, 2],
    prev 2 -> [3, 0, 0], prev 1 -> 0. Anchor 0: draft 0 = argmax([0, 1, 2]) = 2; draft 1 sees bias(2):
    argmax([3, 0, 0.5]) = 0. (No bias: [1, 2]; every bias from the anchor: [2, 2].)"""
    from tokenfab.spec_decode.dspark_proposer import sample_in_order
    from tokenfab.spec_decode.rejection_sampler import SamplingTensors
    base = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 0.5]]])
    table = torch.tensor([[0.0, 0.0, 2.0], [0.0, 0.0, 0.0], [3.0, 0.0, 0.0]])
    greedy = SamplingTensors(torch.tensor([0.0]), None, None, torch.tensor([True]))
    d, q = sample_in_order(base, torch.tensor([0]), lambda prev: table[prev], greedy, [None], None)
    assert d.tolist() == [[2, 0]] and q is None
    d, _ = sample_in_order(base, torch.tensor([0]), lambda prev: None, greedy, [None], None)
    assert d.tolist() == [[1, 2]]
    # temperature 0.5: q_j = softmax((base_j + bias(prev_j)) / 0.5) with prev_1 = the drawn draft 0
    from types import SimpleNamespace
    st = SamplingTensors(torch.tensor([0.5]), None, None, torch.tensor([False]))
    seq = SimpleNamespace(generator=torch.Generator().manual_seed(0))
    d, q = sample_in_order(base, torch.tensor([0]), lambda prev: table[prev], st, [seq], torch.Generator())
    for j, prev in enumerate([0, int(d[0, 0])]):
        want = torch.softmax((base[0, j] + table[prev]) / 0.5, -1)
        assert torch.allclose(q[0, j], want, atol=1e-6)


# ---- config layouts: strict reading, errors name the field -------------------------------------------------------
def _sf(**kw):
    return dspark_config("specforge", K3_5MLA, hidden=D, target_hidden=D, vocab=V, target_layer_ids=[11, 23, 47, 71, 83],
                         target_num_layers=93, block_size=7, mask_token_id=163 % V, intermediate=96, markov_rank=256,
                         confidence=True, **kw)


def _sp(**kw):
    return dspark_config("speculators", K3_4KDA, hidden=D, target_hidden=D, vocab=V, target_layer_ids=[1, 3],
                         target_num_layers=4, block_size=7, mask_token_id=3, intermediate=96, markov_rank=8,
                         confidence=False, **kw)


def test_published_layouts_parse():
    c = parse_dspark_config(_sf())
    assert (c.layout, c.block_size, c.num_drafts, c.target_layer_ids, c.markov_rank) == \
        ("specforge", 7, 6, [11, 23, 47, 71, 83], 256)
    assert c.layer_types == K3_5MLA and c.mla_use_output_gate and c.target_num_layers == 93
    assert c.aux_hidden_stream == "partial_sum"
    c = parse_dspark_config(_sp())
    assert (c.layout, c.num_drafts, c.layer_types, c.kda_num_heads) == ("speculators", 7, K3_4KDA, 2)
    assert parse_dspark_config(_sf(aux_hidden_stream="attn_res")).aux_hidden_stream == "attn_res_mixture"
    assert parse_dspark_config(_sf(sample_from_anchor=True)).num_drafts == 7
    c = parse_dspark_config(_sf())
    assert resolve_tap(c, None) == "partial_sum" and resolve_tap(c, "attn_res_mixture") == "attn_res_mixture"
    with pytest.raises(EngineConfigError, match="dspark_tap 'mix'"):
        resolve_tap(c, "mix")


_DROP = object()


def _edit(d, dotted, value=_DROP):
    """A deep copy of config ``d`` with the field at the dotted path set to ``value`` (left out: deleted)."""
    d = copy.deepcopy(d)
    *head, last = dotted.split(".")
    cur = d
    for h in head:
        cur = cur[h]
    if value is _DROP:
        del cur[last]
    else:
        cur[last] = value
    return d


@pytest.mark.parametrize("mk, field", [
    (_sf, "dflash_config.mask_token_id"), (_sf, "dflash_config.target_layer_ids"), (_sf, "block_size"),
    (_sf, "kv_lora_rank"), (_sf, "dflash_config"), (_sp, "aux_hidden_state_layer_ids"), (_sp, "mask_token_id"),
    (_sp, "transformer_layer_config.hidden_size"), (_sp, "transformer_layer_config.linear_attn_config.head_dim"),
    (_sp, "transformer_layer_config"),
])
def test_missing_field_is_named(mk, field):
    with pytest.raises(EngineConfigError, match=f"'{field}' is missing"):
        parse_dspark_config(_edit(mk(), field))


@pytest.mark.parametrize("mk, field, value, error, match", [
    (_sf, "dflash_config.target_layer_ids", [11, 93], EngineConfigError, "target_layer_ids.*93-layer target"),
    (_sp, "speculators_model_type", "dflash", EngineConfigError, "speculators_model_type"),
    (_sf, "architectures", ["Qwen3ForCausalLM"], EngineConfigError, "architectures"),
    (_sf, "dflash_config.markov_head_type", "gated", UnsupportedError, "markov_head_type"),
    (_sp, "draft_vocab_size", 32, UnsupportedError, "draft_vocab_size"),
    (_sf, "block_size", "7", EngineConfigError, "'block_size' must be an integer"),
    (_sf, "dflash_config.aux_hidden_stream", "residual", EngineConfigError, "aux_hidden_stream"),
])
def test_bad_fields_are_named(mk, field, value, error, match):
    with pytest.raises(error, match=match):
        parse_dspark_config(_edit(mk(), field, value))


def test_weight_errors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file
    path, _, _ = write_tiny_dspark(str(tmp_path / "d"), "specforge", K3_5MLA)
    t = load_file(os.path.join(path, "model.safetensors"))
    t["layers.0.self_attn.q_b_proj.weight"] = t["layers.0.self_attn.q_b_proj.weight"][:-1]
    save_file(t, os.path.join(path, "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    with pytest.raises(WeightLoadError, match="q_b_proj.weight' has shape"):
        _drafter(path, torch.randn(V, D, generator=g), torch.randn(V, D, generator=g))
    del t["layers.0.self_attn.q_b_proj.weight"]
    t["layers.0.self_attn.extra.weight"] = torch.zeros(1)
    save_file(t, os.path.join(path, "model.safetensors"))
    with pytest.raises(WeightLoadError, match="extra.weight' has no place"):
        _drafter(path, torch.randn(V, D, generator=g), torch.randn(V, D, generator=g))
    del t["layers.0.self_attn.extra.weight"]
    save_file(t, os.path.join(path, "model.safetensors"))
    with pytest.raises(WeightLoadError, match="missing tensors.*q_b_proj"):
        _drafter(path, torch.randn(V, D, generator=g), torch.randn(V, D, generator=g))


# ---- K3 taps: the two streams against the naive K3 -------------------------------------------------------------
def naive_k3_streams(W, tc, tokens):
    """Per layer i of the naive float64 K3 (tests/test_kimi_k3.py's formulas): (partial-block sum after layer i,
    the attention-residual mix layer i + 1 computes from it; after the last layer the output mix)."""
    mixes, sums, last = naive_k3_trace(W, tc, tokens)
    return list(zip(sums, mixes[1:] + [last]))


@pytest.fixture(scope="module")
def k3_target(tmp_path_factory, tokenizer_dir):
    from test_kimi_k3 import TEXT, k3_tensors, write_k3
    stored, ref = k3_tensors(TEXT)
    return write_k3(str(tmp_path_factory.mktemp("k3")), tokenizer_dir, tensors=stored), ref, TEXT


@pytest.mark.parametrize("stream", ["partial_sum", "attn_res_mixture"])
def test_k3_tap_streams_match_naive(k3_target, stream):
    """KimiK3ForConditionalGeneration.tap_hidden after every layer (a forward hook on each decoder layer, fp32
    engine) equals the naive float64 K3's partial sum / next-layer mix within 1e-4 of the stream's largest value;
    the two streams differ."""
    from tokenfab import LLM, SamplingParams
    path, ref, tc = k3_target
    llm = LLM(path, dtype="float32", device="cpu", progress=False)
    model = llm.llm_engine.runner.model
    got = {}

    def hook(i):
        def f(_mod, _inp, out):
            got.setdefault(i, model.tap_hidden(i, out, stream))  # returns None: the output is left as it is
        return f

    hooks = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(model.model.layers)]
    prompt = list(range(7, 30))
    try:
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
    want = naive_k3_streams(ref, tc, prompt)
    for i, (ps, mix) in enumerate(want):
        w = ps if stream == "partial_sum" else mix
        err, scale = (got[i].double() - w).abs().max().item(), w.abs().max().item()
        assert err < 1e-4 * scale, i  # fp32 engine (chunked KDA) vs float64, relative to the stream's magnitude
    assert (want[1][0] - want[1][1]).abs().max() > 0.1 * want[1][0].abs().max()  # the streams are different features


# ---- end to end on a tiny K3 target --------------------------------------------------------------------------------
ALWAYS = {"verify_token_cost": 0.0, "verify_step_overhead": 0.0, "random_row_cost": 0.0}  # draft k every step


def _k3_prompts():
    g = torch.Generator().manual_seed(9)
    return [{"prompt_token_ids": torch.randint(5, 500, (n,), generator=g).tolist()} for n in (5, 17, 30)]


@pytest.fixture(scope="module")
def k3_drafter(tmp_path_factory, k3_target):
    """A SpecForge-layout 5MLA drafter for the tiny K3 target (4 layers, hidden 64), taps after layers 0 and 2."""
    path, _, tc = k3_target
    path, _, W = write_tiny_dspark(str(tmp_path_factory.mktemp("dspark")), "specforge", K3_5MLA, block_size=4,
                                   target_layer_ids=(0, 2), target_num_layers=tc["num_hidden_layers"], seed=3)
    return path, W


def _counting(llm):
    """Wrap the proposer's propose: record (row lengths, drafts, draft lens) of every proposal."""
    prop = llm.llm_engine.spec.proposer
    log, orig = [], prop.propose

    def propose(seqs, rows, token_ids, lengths, max_lens):
        out = orig(seqs, rows, token_ids, lengths, max_lens)
        log.append(([s.request_id for s in seqs], lengths.copy(), out.draft_ids.copy(), out.draft_lens.copy()))
        return out

    prop.propose = propose
    return log


@pytest.mark.parametrize("tap", ["partial_sum", "attn_res_mixture"])
def test_greedy_identical_and_counters_exact(k3_target, k3_drafter, tap):
    k3_drafter = k3_drafter[0]
    """Greedy K3 outputs with dspark (k = 3, mixed prompt lengths, KDA state rolled back after each verification)
    equal those without; the accepted-token counters equal an independent count: for every proposal, the longest
    prefix of its drafts that matches the non-speculative output at those positions."""
    from tokenfab import LLM, SamplingParams
    path, _, _ = k3_target
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    base = LLM(path, dtype="float32", progress=False).generate(_k3_prompts(), sp, use_tqdm=False)
    llm = LLM(path, dtype="float32", progress=False, speculative_config=dict(
        ALWAYS, method="dspark", model=k3_drafter, num_speculative_tokens=3, dspark_tap=tap))
    assert llm.llm_engine.spec.proposer.tap == tap
    log = _counting(llm)
    out = llm.generate(_k3_prompts(), sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in base]
    full = {o.request_id: o.prompt_token_ids + o.outputs[0].token_ids for o in base}
    rid = {o.request_id: b.request_id for o, b in zip(out, base)}
    acc, per_pos, drafts, n_drafts = 0, [0, 0, 0], 0, 0
    for ids, lengths, d, n in log:
        for r, L, dr, c in zip(ids, lengths, d, n):
            want = full[rid[r]][L:L + int(c)]
            a = 0
            while a < c and a < len(want) and dr[a] == want[a]:
                a += 1
            acc += a
            drafts += int(c)
            n_drafts += int(c > 0)
            for j in range(a):
                per_pos[j] += 1
    st = llm.llm_engine.get_stats()
    assert n_drafts > 0 and st["spec_decode_num_drafts"] == n_drafts
    assert st["spec_decode_num_draft_tokens"] == drafts
    assert st["spec_decode_num_accepted_tokens"] == acc
    assert st["spec_decode_num_accepted_tokens_per_pos"] == per_pos


class _Oracle:
    """Turns a DSparkProposer into a perfect drafter: the drafter pass still runs, its drafts are replaced by the
    target's own greedy continuation (known from a non-speculative run)."""

    def __init__(self, prop, full):
        self.prop, self.full, self.orig = prop, full, prop.propose

    def __call__(self, seqs, rows, token_ids, lengths, max_lens):
        out = self.orig(seqs, rows, token_ids, lengths, max_lens)
        for i, (s, L) in enumerate(zip(seqs, lengths)):
            want = self.full[s.request_id][L:L + out.draft_ids.shape[1]]
            out.draft_ids[i, :len(want)] = want
        return out


def test_perfect_drafter_accepts_everything(k3_target, k3_drafter):
    k3_drafter = k3_drafter[0]
    """With the target's own continuation as drafts every draft is accepted (k = 3: 4 tokens per verification)
    and the output is unchanged."""
    from tokenfab import LLM, SamplingParams
    path, _, _ = k3_target
    sp = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    prompts = _k3_prompts()
    base = LLM(path, dtype="float32", progress=False).generate(prompts, sp, use_tqdm=False)
    llm = LLM(path, dtype="float32", progress=False, speculative_config=dict(
        ALWAYS, method="dspark", model=k3_drafter, num_speculative_tokens=3))
    prop = llm.llm_engine.spec.proposer
    full = {}
    orig_add = llm.llm_engine.add_request

    def add(rid, *a, **kw):  # this engine's request ids -> the base run's continuations, in prompt order
        i = len(full)
        full[rid] = base[i].prompt_token_ids + base[i].outputs[0].token_ids
        return orig_add(rid, *a, **kw)

    llm.llm_engine.add_request = add
    prop.propose = _Oracle(prop, full)
    out = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in base]
    st = llm.llm_engine.get_stats()
    assert st["spec_decode_num_drafts"] > 0
    assert st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_draft_tokens"]


def test_dspark_config_errors(k3_target, k3_drafter, tmp_path):
    k3_drafter = k3_drafter[0]
    from tokenfab import LLM
    path, _, _ = k3_target
    with pytest.raises(EngineConfigError, match="num_speculative_tokens \\(4\\) exceeds the 3 drafts"):
        LLM(path, dtype="float32", progress=False, speculative_config={
            "method": "dspark", "model": k3_drafter, "num_speculative_tokens": 4})
    with pytest.raises(EngineConfigError, match="dspark_tap"):
        LLM(path, dtype="float32", progress=False, speculative_config={
            "method": "dspark", "model": k3_drafter, "num_speculative_tokens": 2, "dspark_tap": "mix"})
    bad, _, _ = write_tiny_dspark(str(tmp_path / "bad"), "specforge", K3_5MLA, target_layer_ids=(0, 2),
                                  target_num_layers=6)
    with pytest.raises(EngineConfigError, match="6-layer target"):
        LLM(path, dtype="float32", progress=False, speculative_config={
            "method": "dspark", "model": bad, "num_speculative_tokens": 2})


@pytest.mark.parametrize("tap, layout", [("partial_sum", "specforge"), ("attn_res_mixture", "specforge"),
                                         ("attn_res_mixture", "speculators")])
def test_engine_drafts_equal_reference_on_naive_taps(k3_target, k3_drafter, tmp_path, tap, layout):
    """The drafts the engine proposes (context rows written from the taps observed after each target forward:
    the prefill, then every verification) equal the float64 reference drafter run on the naive K3's taps of the
    same tokens, greedy with the Markov bias in order (first proposals of one sequence). SpecForge 5MLA drafter
    (drafts from slots 1..3) and a speculators 4KDA+1MLA one (sample_from_anchor: slots 0..2)."""
    from tokenfab import LLM, SamplingParams
    path, ref, tc = k3_target
    types = K3_5MLA if layout == "specforge" else K3_4KDA
    dpath, W = k3_drafter if layout == "specforge" else write_tiny_dspark(
        str(tmp_path / "sp"), "speculators", K3_4KDA, block_size=4, target_layer_ids=(0, 2),
        target_num_layers=tc["num_hidden_layers"], seed=4)[::2]
    W64 = {k: v.double() for k, v in W.items()}
    llm = LLM(path, dtype="float32", progress=False, speculative_config=dict(
        ALWAYS, method="dspark", model=dpath, num_speculative_tokens=3, dspark_tap=tap))
    log = _counting(llm)
    prompt = _k3_prompts()[1]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)
    full = prompt["prompt_token_ids"] + out[0].outputs[0].token_ids
    w1, w2 = W64["markov_head.markov_w1.weight"], W64["markov_head.markov_w2.weight"]
    checked = 0
    for _, lengths, d, n in log[:3]:
        L = int(lengths[0])
        streams = naive_k3_streams(ref, tc, full[:L - 1])
        taps = torch.cat([streams[i][0 if tap == "partial_sum" else 1] for i in (0, 2)], dim=-1)
        logits = ref_block_logits(W64, types, taps, full[L - 1], 3, 4, ref["model.embed_tokens.weight"],
                                  ref["lm_head.weight"])
        logits = logits[1:] if layout == "specforge" else logits  # SpecForge: slot 0 is the anchor
        prev, want = full[L - 1], []
        for j in range(int(n[0])):
            prev = int((logits[j] + w2 @ w1[prev]).argmax())
            want.append(prev)
        assert d[0, : int(n[0])].tolist() == want
        checked += 1
    assert checked >= 2


def test_greedy_identical_chunked_prefill_and_preemption(k3_target, k3_drafter):
    """Prefill in 8-token chunks (the context rows arrive chunk by chunk) and a pool too small for all three
    sequences (preempted sequences recompute from zero and their drafter context is rebuilt from the recompute's
    taps): outputs equal plain decoding's, and sequences draft again after a preemption. (Drafts overwritten by the
    known continuation, as in the perfect-drafter test, so few steps run.)"""
    from tokenfab import LLM, SamplingParams
    path, _, _ = k3_target
    sp = SamplingParams(temperature=0, max_tokens=26, ignore_eos=True)
    base = LLM(path, dtype="float32", progress=False).generate(_k3_prompts(), sp, use_tqdm=False)
    llm = LLM(path, dtype="float32", progress=False, num_kv_blocks=4, max_model_len=64, max_num_batched_tokens=8,
              speculative_config=dict(ALWAYS, method="dspark", model=k3_drafter[0], num_speculative_tokens=3))
    eng = llm.llm_engine
    full, orig_add = {}, eng.add_request

    def add(rid, *a, **kw):
        i = len(full)
        full[rid] = base[i].prompt_token_ids + base[i].outputs[0].token_ids
        return orig_add(rid, *a, **kw)

    eng.add_request = add
    oracle = _Oracle(eng.spec.proposer, full)
    after_preemption = []

    def propose(seqs, rows, token_ids, lengths, max_lens):
        out = oracle(seqs, rows, token_ids, lengths, max_lens)
        after_preemption.extend(int(n) for s, n in zip(seqs, out.draft_lens) if s.num_preemptions > 0)
        return out

    eng.spec.proposer.propose = propose
    out = llm.generate(_k3_prompts(), sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in base]
    st = eng.get_stats()
    assert st["num_preemptions"] > 0 and st["spec_decode_num_accepted_tokens"] > 0
    assert sum(after_preemption) > 0


def test_prefix_cache_hit_rows_draft_as_computed(k3_target, k3_drafter):
    """A request whose first 16 tokens hit the prefix cache (two blocks another request computed, K3 state
    snapshot at 16) drafts, from the context rows that request wrote into the shared blocks: its proposals (lengths
    and drafts) equal those of the same request on an engine without prefix caching, where it computes every
    position itself, and its greedy output is unchanged. (Without the recorded block contents it never drafted.)"""
    from tokenfab import LLM, SamplingParams
    path, _, _ = k3_target
    g = torch.Generator().manual_seed(5)
    a = torch.randint(5, 500, (20,), generator=g).tolist()
    b = a[:16] + torch.randint(5, 500, (7,), generator=g).tolist()
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    spec = dict(ALWAYS, method="dspark", model=k3_drafter[0], num_speculative_tokens=3)
    kw = dict(dtype="float32", progress=False, block_size=8)

    def b_run(caching: bool):
        llm = LLM(path, enable_prefix_caching=caching, speculative_config=spec, **kw)
        if caching:
            llm.generate([{"prompt_token_ids": a}], sp, use_tqdm=False)
        log = _counting(llm)
        out = llm.generate([{"prompt_token_ids": b}], sp, use_tqdm=False)[0].outputs[0].token_ids
        props = [(int(L[0]), d[0, : int(n[0])].tolist()) for _, L, d, n in log]
        return llm, out, props

    llm, out, props = b_run(True)
    assert llm.llm_engine.block_manager.prefix_cache.hits >= 16
    _, want_out, want_props = b_run(False)
    assert sum(len(d) for _, d in props) > 0  # it drafted
    assert props == want_props
    plain = LLM(path, **kw).generate([{"prompt_token_ids": b}], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert out == want_out == plain
