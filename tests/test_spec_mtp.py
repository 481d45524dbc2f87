"""The target-hidden-state seam (every target forward shows a drafter its hidden states) and the MTP drafter
(``method: "mtp"``, DeepSeek-V3 next-token-prediction layers) against a hand-written reference on the same
weights."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from conftest import load_reference
from spec_helpers import NGRAM, spec_prompts, token_hist, token_ids
from tokenfab import LLM, SamplingParams
from tokenfab.spec_decode.ngram_proposer import NgramProposer
from tokenfab.spec_decode.proposer import HiddenRequest


class RecordingProposer(NgramProposer):
    """n-gram drafts, plus a record of every observed hidden state at a final-context position."""

    def __init__(self, layer_ids=(0,)):
        super().__init__(3, 1, 3)
        self.layer_ids = tuple(layer_ids)
        self.seen: dict[int, dict[int, list]] = {}  # seq_id -> position -> [(hidden, taps)]
        self.calls = 0

    def hidden_request(self):
        return HiddenRequest(final=True, layer_ids=self.layer_ids)

    def observe(self, captured):
        self.calls += 1
        T = len(captured.positions)
        assert captured.hidden.shape[0] == T and captured.req_idx.shape == (T,)
        if self.layer_ids:
            assert tuple(captured.taps.shape[:2]) == (T, len(self.layer_ids))
        for t in range(T):
            s = captured.seqs[captured.req_idx[t]]
            p = int(captured.positions[t])
            if p <= s.num_tokens - 2:
                taps = captured.taps[t].float().clone() if self.layer_ids else None
                self.seen.setdefault(s.seq_id, {}).setdefault(p, []).append(
                    (captured.hidden[t].float().clone(), taps))


@pytest.mark.parametrize("family, dtype, layer_ids", [("deepseek_v3", "float32", (0,)), ("llama", "bfloat16", ())])
def test_seam_shows_every_final_context_hidden_state(tiny_model, family, dtype, layer_ids):
    """Every position of every sequence except its last token is observed with its final context (the hidden
    states of transformers' forward over the whole finished sequence: the post-norm last state and layer 0's
    output), across prefill chunks, plain decode steps and verification steps with rejected drafts. bf16 without
    taps runs plain decode and verification through the fused CPU decode stack (Llama there: bf16 rounding flips
    some of DeepSeek's expert choices against an fp32 reference, which moves a hidden state by O(1))."""
    path = tiny_model(family)
    sp = SamplingParams(temperature=0, max_tokens=18, ignore_eos=True)
    llm = LLM(path, dtype=dtype, progress=False, speculative_config=NGRAM, max_num_batched_tokens=32)
    rec = RecordingProposer(layer_ids)
    llm.llm_engine.spec = type(llm.llm_engine.spec)(llm.llm_engine, llm.llm_engine.spec.cfg, rec)
    outs = llm.generate(spec_prompts(), sp)
    st = llm.llm_engine.get_stats()
    assert st["spec_decode_num_drafts"] > 0
    assert st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]  # some were rejected
    assert rec.calls > 0
    if dtype == "bfloat16" and llm.llm_engine.runner.cpu_decode_stack is not None:
        assert llm.llm_engine.spec.num_fused_steps > 0  # verification through the fused stack was observed
    ref = load_reference(path)
    tol = 2e-4 if dtype == "float32" else 0.08
    by_seq = sorted(rec.seen.items())
    assert len(by_seq) == len(outs)
    for (sid, seen), o in zip(by_seq, outs):
        toks = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        assert sorted(seen) == list(range(len(toks) - 1))  # every position but the last token, no hole
        with torch.no_grad():
            hs = ref(torch.tensor([toks]), output_hidden_states=True).hidden_states
        final, layer0 = hs[-1][0], hs[1][0]
        for p, entries in seen.items():
            for h, taps in entries:
                scale = final[p].abs().max().item()
                assert (h - final[p]).abs().max().item() <= tol * max(1.0, scale), (p, dtype)
                if taps is not None:
                    assert (taps[0] - layer0[p]).abs().max().item() <= tol * max(1.0, layer0[p].abs().max().item())


# ------------------------------------------------------------------------------------------------ MTP drafting
MTP = {"method": "mtp", "num_speculative_tokens": 3, "verify_token_cost": 0.0, "verify_step_overhead": 0.0,
       "random_row_cost": 0.0}  # always draft k


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory, tokenizer_dir):
    """Factory: a tiny DeepSeek-V3 with ``n`` random MTP layers (cached per arguments)."""
    from tokenfab.testing.tiny_checkpoints import add_mtp_layers, make_tiny_checkpoint
    root = tmp_path_factory.mktemp("mtp")
    made = {}

    def make(n=1, own_head=False, own_embed=False, dtype="float32"):
        key = (n, own_head, own_embed, dtype)
        if key not in made:
            d = str(root / f"ds-{n}-{int(own_head)}{int(own_embed)}-{dtype}")
            make_tiny_checkpoint(d, "deepseek_v3", vocab_size=512, tokenizer_dir=tokenizer_dir, dtype=dtype)
            made[key] = add_mtp_layers(d, n, seed=3, own_head=own_head, own_embed=own_embed)
        return made[key]

    return make


def _rms(x, w, eps):
    x32 = x.float()
    return w.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


class MTPReference:
    """The MTP forward written out in plain torch on the checkpoint's tensors: embedding (the layer's own or the
    target's), enorm, hnorm, cat([enorm(emb), hnorm(h)]), eh_proj, the decoder block of layer index L as
    transformers builds it (a deeper DeepseekV3 model with the MTP block's weights) with full causal attention over
    the whole sequence, shared_head.norm and the head (own or the target's). Target hidden states: transformers'
    final post-norm hidden states."""

    def __init__(self, path):
        import json
        import os

        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModelForCausalLM
        self.target = load_reference(path)
        cfg = AutoConfig.from_pretrained(path)
        self.L, self.eps = cfg.num_hidden_layers, cfg.rms_norm_eps
        with open(os.path.join(path, "config.json")) as f:
            self.n = json.load(f)["num_nextn_predict_layers"]
        cfg.num_hidden_layers = self.L + self.n
        self.deep = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
        w = {k: v.float() for k, v in load_file(os.path.join(path, "model-mtp.safetensors")).items()}
        self.w = w
        missing, _ = self.deep.load_state_dict(w, strict=False)
        assert not [m for m in missing if m.startswith(f"model.layers.{self.L}.")]  # the block's weights all set

    def final_hidden(self, toks):
        with torch.no_grad():
            return self.target(torch.tensor([toks]), output_hidden_states=True).hidden_states[-1][0]

    def forward(self, i, next_ids, prev):
        """MTP layer i over positions 0..S-1 (``next_ids`` [S] the token after each, ``prev`` [S, H]) -> outputs y
        [S, H] and logits [S, V]."""
        p = f"model.layers.{self.L + i}."
        w = self.w
        emb_w = w.get(p + "embed_tokens.weight", self.target.model.embed_tokens.weight)
        head_w = w.get(p + "shared_head.head.weight", self.target.lm_head.weight)
        with torch.no_grad():
            e = _rms(emb_w[torch.tensor(next_ids)], w[p + "enorm.weight"], self.eps)
            g = _rms(prev, w[p + "hnorm.weight"], self.eps)
            u = torch.cat([e, g], dim=-1) @ w[p + "eh_proj.weight"].T
            S = u.shape[0]
            pos = torch.arange(S)[None]
            cos_sin = self.deep.model.rotary_emb(u[None], pos)
            mask = torch.triu(torch.full((S, S), float("-inf")), 1)[None, None]
            y = self.deep.model.layers[self.L + i](u[None], attention_mask=mask, position_ids=pos,
                                                   position_embeddings=cos_sin)
            y = (y[0] if isinstance(y, tuple) else y)[0]
            return y, _rms(y, w[p + "shared_head.norm.weight"], self.eps) @ head_w.T

    def drafts(self, toks, L, drafts, h=None):
        """Reference logits [k, V] of a proposal made for a sequence with L tokens (``toks`` its final tokens,
        whose first L were its context then; ``h`` their final hidden states, if known), chaining through
        ``drafts`` [k] as the drafter does: positions 0..L-2 hold (token t + 1, target hidden at t); draft j + 1
        comes from layer j % n at position L - 2 + j over (draft j, the previous step's output), every layer
        seeing the same inputs."""
        h = self.final_hidden(toks[:L]) if h is None else h  # causal: the whole sequence's states serve any prefix
        nxt, prev = list(toks[1:L]), h[:L - 1]
        y, lg = self.forward(0, nxt, prev)
        out, y_last = [lg[-1]], y[-1:]
        for j in range(1, len(drafts)):
            nxt, prev = nxt + [int(drafts[j - 1])], torch.cat([prev, y_last])
            y, lg = self.forward(j % self.n, nxt, prev)
            out.append(lg[-1])
            y_last = y[-1:]
        return torch.stack(out)


def _record_proposals(llm):
    """Wrap the MTP proposer so each proposal's (seq_id, length, drafts, draft lens, logits [k, V]) is kept."""
    prop = llm.llm_engine.spec.proposer
    events, logits_log = [], []
    orig_logits, orig_propose = prop.mtp.compute_logits, prop.propose

    def compute_logits(i, h):
        out = orig_logits(i, h)
        logits_log.append(out.detach().float().cpu().clone())
        return out

    def propose(seqs, rows, token_ids, lengths, max_lens):
        logits_log.clear()
        res = orig_propose(seqs, rows, token_ids, lengths, max_lens)
        if logits_log:  # one [ready rows, V] per draft position; ready rows are those with drafts
            lg = torch.stack(logits_log, dim=1)
            for n, i in enumerate(np.nonzero(res.draft_lens > 0)[0].tolist()):
                events.append((seqs[i].seq_id, int(lengths[i]), res.draft_ids[i].copy(), int(res.draft_lens[i]),
                               lg[n]))
        return res

    prop.mtp.compute_logits, prop.propose = compute_logits, propose
    return events


@pytest.mark.parametrize("n, own", [(1, False), (1, True), (2, False)])
def test_mtp_drafts_match_hand_written_reference(mtp_model, n, own):
    """Every proposal's logits at each draft position (draft 1 from the observed context, drafts 2..k chained)
    against :class:`MTPReference` on the same weights in fp32: max |Δ logit| <= 1e-3 and the greedy drafts are the
    reference's argmax; the engine's acceptance counters equal the count from the proposals and the final output
    (accepted = the longest draft prefix matching the greedy continuation)."""
    path = mtp_model(n, own_head=own, own_embed=own)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(path, dtype="float32", progress=False, speculative_config=MTP, max_num_batched_tokens=32)
    events = _record_proposals(llm)
    outs = llm.generate(spec_prompts(3), sp)
    assert events
    toks = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs}
    by_seq = {s: t for s, t in zip(sorted({e[0] for e in events}), [toks[o.request_id] for o in outs])}
    ref = MTPReference(path)
    hidden = {sid: ref.final_hidden(t) for sid, t in by_seq.items()}
    acc_total, per_pos, draft_tokens, worst = 0, [0, 0, 0], 0, 0.0
    for sid, L, drafts, c, lg in events:
        full = by_seq[sid]
        want = ref.drafts(full, L, drafts, hidden[sid])
        worst = max(worst, (want - lg).abs().max().item())
        assert drafts.tolist() == want.argmax(-1).tolist()
        a = 0
        while a < c and drafts[a] == full[L + a]:
            a += 1
        acc_total, draft_tokens = acc_total + a, draft_tokens + c
        for j in range(a):
            per_pos[j] += 1
    assert worst <= 1e-3, worst
    st = llm.llm_engine.get_stats()
    assert (st["spec_decode_num_drafts"], st["spec_decode_num_draft_tokens"],
            st["spec_decode_num_accepted_tokens"]) == (len(events), draft_tokens, acc_total)
    assert st["spec_decode_num_accepted_tokens_per_pos"] == per_pos


@pytest.mark.parametrize("dtype, preempt", [("float32", False), ("bfloat16", False), ("float32", True)])
def test_greedy_identical_with_mtp(mtp_model, dtype, preempt):
    """Greedy outputs with MTP drafting equal those without: mixed prompt lengths with a chunked prefill (fp32),
    bf16 through the fused decode stack (unchunked as in test_spec_decode.py: bf16 logits depend on the batch a
    token ran in, and near-ties flip when speculation changes the chunks), and under preemption (a small KV pool);
    every reserved block comes back."""
    path = mtp_model(1, dtype=dtype)
    sp = SamplingParams(temperature=0, max_tokens=40 if preempt else 20, ignore_eos=True)
    kw = (dict(num_kv_blocks=9, max_model_len=128) if preempt
          else dict(max_model_len=512) if dtype == "bfloat16" else dict(max_num_batched_tokens=32))
    plain = LLM(path, dtype=dtype, progress=False, **kw)
    if dtype == "bfloat16" and plain.llm_engine.runner.cpu_decode_stack is None:
        pytest.skip("bf16 identity needs the fused CPU decode stack (C++ kernels, AVX512-BF16): elsewhere bf16 GEMMs "
                    "round by the batch a token ran in")
    base = token_ids(plain.generate(spec_prompts(), sp))
    llm = LLM(path, dtype=dtype, progress=False, speculative_config=MTP, **kw)
    assert token_ids(llm.generate(spec_prompts(), sp)) == base
    st = llm.llm_engine.get_stats()
    assert st["spec_decode_num_drafts"] > 0
    if dtype == "bfloat16" and llm.llm_engine.runner.cpu_decode_stack is not None:
        assert llm.llm_engine.spec.num_fused_steps > 0
    if preempt:
        assert st["num_preemptions"] > 0
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


N_SAMPLES = 1200
TV_TOL = 0.12  # as tests/test_spec_decode.py: top-k 2, <= 8 values, E[TV] ~ 0.05 between two samples of 1,200


def test_mtp_distribution_unchanged_at_temperature_one(mtp_model):
    """Output tokens 2 and 3 (a draft or its recovery, then the bonus) over 1,200 seeded requests at temperature 1,
    top-k 2, with MTP drafting from q (its own distribution after the same temperature and top-k): total variation
    to the counts without speculation below TV_TOL."""
    path = mtp_model(1)
    prompt = {"prompt_token_ids": [11, 23, 37, 41, 53, 11, 23, 37]}
    V = 512
    sps = [SamplingParams(temperature=1.0, top_k=2, max_tokens=3, ignore_eos=True, seed=i) for i in range(N_SAMPLES)]
    base = LLM(path, dtype="float32", progress=False, max_num_seqs=128).generate([prompt] * N_SAMPLES, sps)
    llm = LLM(path, dtype="float32", progress=False, max_num_seqs=128,
              speculative_config=dict(MTP, num_speculative_tokens=2))
    spec = llm.generate([prompt] * N_SAMPLES, [SamplingParams(temperature=1.0, top_k=2, max_tokens=3,
                                                              ignore_eos=True, seed=10_000 + i)
                                               for i in range(N_SAMPLES)])
    st = llm.llm_engine.get_stats()
    assert st["spec_decode_num_draft_tokens"] == N_SAMPLES  # one draft each (max_tokens leaves room for one)
    for pos in (1, 2):
        tv = 0.5 * np.abs(token_hist(base, pos, V) - token_hist(spec, pos, V)).sum()
        assert tv < TV_TOL, (pos, tv)


def test_mtp_refusals_name_the_cause(mtp_model, tiny_model, tmp_path):
    from tokenfab.errors import EngineConfigError
    from tokenfab.spec_decode.config import parse_speculative_config
    with pytest.raises(EngineConfigError, match="no next-token-prediction layers"):
        LLM(tiny_model("deepseek_v3"), dtype="float32", progress=False, speculative_config=MTP)
    with pytest.raises(EngineConfigError, match="needs a DeepSeek-V3"):
        LLM(tiny_model("llama"), dtype="float32", progress=False, speculative_config=MTP)
    with pytest.raises(EngineConfigError, match="unknown field 'model' for method 'mtp'"):
        parse_speculative_config({"method": "mtp", "num_speculative_tokens": 1, "model": "x"})
    assert parse_speculative_config({"method": "deepseek_mtp", "num_speculative_tokens": 2}).method == "mtp"
    # tensor parallel (tests/test_tp_spec_mtp_dspark.py runs it): the MTP layers run on rank 0 with full copies of
    # the target's embedding / head read from the checkpoint (target_vocab.py); still refused: a table stored
    # quantized, and one that is not what rank 0's shard was loaded from (rank 0 of a 10-row vocabulary: rows 0..3)
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from tokenfab.errors import UnsupportedError, WeightLoadError
    from tokenfab.spec_decode.target_vocab import TargetVocab
    g = torch.Generator().manual_seed(0)
    emb, head = torch.randn(10, 4, generator=g), torch.randn(10, 4, generator=g)

    def engine(folder, tensors, head_shard):
        os.makedirs(folder)
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        emb_shard = SimpleNamespace(weight=emb[:4].clone(), v0=0, v1=4)
        target = SimpleNamespace(cfg=SimpleNamespace(tie_word_embeddings=False), lm_head=head_shard,
                                 model=SimpleNamespace(embed_tokens=emb_shard))
        return SimpleNamespace(runner=SimpleNamespace(model=target), config=SimpleNamespace(model=folder))

    ok = {"model.embed_tokens.weight": emb, "lm_head.weight": head}
    tv = TargetVocab(engine(str(tmp_path / "ok"), ok, SimpleNamespace(weight=head[:4].clone(), v0=0, v1=4)))
    x = torch.randn(3, 4, generator=g)
    assert torch.allclose(tv.logits(x), x @ head.T) and torch.equal(tv.embed(torch.tensor([9, 0])), emb[[9, 0]])
    assert tv.nbytes == 2 * 10 * 4 * 4
    with pytest.raises(WeightLoadError, match="'lm_head.weight' .* is not what rank 0's shard"):
        TargetVocab(engine(str(tmp_path / "other"), ok, SimpleNamespace(weight=head[4:8].clone(), v0=0, v1=4)))
    with pytest.raises(UnsupportedError, match="'lm_head.weight_scale_inv', a quantized embedding / LM head"):
        TargetVocab(engine(str(tmp_path / "fp8"), dict(ok, **{"lm_head.weight_scale_inv": torch.ones(1, 1)}),
                           SimpleNamespace(weight=head[:4].clone(), v0=0, v1=4)))


def test_perfect_mtp_drafter_gets_every_draft_accepted(mtp_model, tmp_path):
    """With an MTP layer that predicts its (bigram) target exactly, greedy decoding accepts every draft: k per
    verification, drafts chained through the layer's own output included, and the output equals plain decoding."""
    from tokenfab.testing.tiny_checkpoints import perfect_mtp_pair
    path = perfect_mtp_pair(mtp_model(1), str(tmp_path / "perfect"))
    sp = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    base = token_ids(LLM(path, dtype="float32", progress=False).generate(spec_prompts(3), sp))
    llm = LLM(path, dtype="float32", progress=False, speculative_config=MTP)
    assert token_ids(llm.generate(spec_prompts(3), sp)) == base
    st = llm.llm_engine.get_stats()
    # per request: 1 token from the prefill, then 3 verification steps of 3 drafts + 1 bonus (13 = 1 + 3 * 4)
    assert st["spec_decode_num_drafts"] == 3 * 3 and st["spec_decode_num_draft_tokens"] == 3 * 3 * 3
    assert st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_draft_tokens"]
    assert st["spec_decode_num_accepted_tokens_per_pos"] == [9, 9, 9]
