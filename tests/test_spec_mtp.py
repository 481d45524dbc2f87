"""The target-hidden-state seam (every target forward shows a drafter its hidden states) and the MTP drafter
(``method: "mtp"``, DeepSeek-V3 next-token-prediction layers) against a hand-written reference on the same
weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import load_reference
from tokenfab import LLM, SamplingParams
from tokenfab.spec_decode.ngram_proposer import NgramProposer
from tokenfab.spec_decode.proposer import HiddenRequest

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "verify_token_cost": 0.0, "verify_step_overhead": 0.0, "random_row_cost": 0.0}


def _prompts(n=4):
    base = [11, 23, 37, 41, 53, 67, 79, 83, 97, 101, 113, 127]
    return [{"prompt_token_ids": (base[: 3 + i] * 8)[: 7 + 9 * i]} for i in range(n)]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


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
    outs = llm.generate(_prompts(), sp)
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
