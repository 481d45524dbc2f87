"""An FP8 block-scaled DeepSeek-V3 checkpoint with an MTP layer (``num_nextn_predict_layers: 1``), stored as the
published DeepSeek-V3 stores it: the MTP layer's attention, shared expert and routed experts (one Linear per expert)
FP8 with their ``weight_scale_inv``.

* it loads at tensor parallel 1 and 2 (gloo worker processes) without speculation (the ranks do not read the MTP
  layer: its scales are not lone halves of pairs), and with ``speculative_config={"method": "mtp"}`` (the MTP layer
  unsharded on rank 0, its routed experts kept packed FP8): greedy tokens in float32 equal plain decoding's at TP 1;
* an FP8 target whose MTP layer is stored unquantized (transformers' stacked experts) loads its MTP experts into
  bf16 stacks instead of refusing them.
"""
from __future__ import annotations

import os
import random

import pytest

from tokenfab import LLM, SamplingParams

os.environ.setdefault("TOKENFAB_TP_TIMEOUT", "120")  # a broken test fails instead of hanging

DIMS = dict(hidden_size=160, intermediate_size=300, moe_intermediate_size=160, q_lora_rank=64)  # tests/test_tp_fp8.py
ENGINE_KW = dict(dtype="float32", max_model_len=96, max_num_batched_tokens=16, block_size=8, progress=False)
MTP = {"method": "mtp", "num_speculative_tokens": 2, "verify_token_cost": 0.0, "verify_step_overhead": 0.0,
       "random_row_cost": 0.0}  # always draft
N_NEW = 10


def _prompts() -> list[dict]:
    rng = random.Random(11)
    return [{"prompt_token_ids": [rng.randrange(5, 512) for _ in range(n)]} for n in (3, 21, 11)]


@pytest.fixture(scope="module")
def fp8_mtp(tmp_path_factory, tokenizer_dir):
    """(FP8 checkpoint with an FP8 MTP layer, the same with the MTP layer unquantized)."""
    from safetensors.torch import load_file, save_file

    from tokenfab.testing.fp8_checkpoint import write_fp8_checkpoint
    from tokenfab.testing.tiny_checkpoints import add_mtp_layers, make_tiny_checkpoint
    root = tmp_path_factory.mktemp("fp8mtp")
    src = make_tiny_checkpoint(str(root / "src"), "deepseek_v3", vocab_size=512, tokenizer_dir=tokenizer_dir, **DIMS)
    add_mtp_layers(src, 1, seed=3)
    fp8 = write_fp8_checkpoint(src, str(root / "fp8"))
    mixed = write_fp8_checkpoint(src, str(root / "mixed"))  # then the MTP layer as add_mtp_layers wrote it
    path = os.path.join(mixed, "model.safetensors")
    sd = {k: v for k, v in load_file(path).items() if not k.startswith("model.layers.2.")}
    sd.update(load_file(os.path.join(src, "model-mtp.safetensors")))
    save_file(sd, path, metadata={"format": "pt"})
    return fp8, mixed


def _generate(path: str, n: int, spec=None):
    """Greedy tokens of _prompts() on ``n`` ranks, and the engine's speculative drafts count (None without)."""
    llm = LLM(path, tensor_parallel_size=n, speculative_config=spec, **ENGINE_KW)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
        outs = llm.generate(_prompts(), sp, use_tqdm=False)
        eng = llm.llm_engine
        experts = None if spec is None else eng.spec.proposer.mtp.model.layers[0].mlp.experts
        return ([o.outputs[0].token_ids for o in outs], eng.get_stats().get("spec_decode_num_drafts"), experts)
    finally:
        llm.llm_engine.shutdown()


_PLAIN: dict = {}


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("spec", [None, MTP], ids=["plain", "mtp"])
def test_fp8_mtp_checkpoint_loads_and_speculates(fp8_mtp, n, spec):
    from tokenfab.quant.fp8_block_experts import Fp8BlockExperts
    fp8, _ = fp8_mtp
    if "ref" not in _PLAIN:
        _PLAIN["ref"] = _generate(fp8, 1)[0]
    tokens, drafts, experts = _generate(fp8, n, spec)
    assert tokens == _PLAIN["ref"]
    if spec is not None:
        assert drafts > 0
        assert isinstance(experts.q13, Fp8BlockExperts) and experts.w13 is None  # the MTP experts kept packed


def test_fp8_target_with_unquantized_mtp_layer(fp8_mtp):
    fp8, mixed = fp8_mtp
    if "ref" not in _PLAIN:
        _PLAIN["ref"] = _generate(fp8, 1)[0]
    tokens, drafts, experts = _generate(mixed, 1, MTP)
    assert tokens == _PLAIN["ref"] and drafts > 0
    assert experts.q13 is None and experts.w13 is not None  # bf16 stacks, as stored


def test_unquantized_expert_stack_in_fp8_target_refused_by_name(fp8_mtp, tmp_path):
    """A target layer whose routed experts are an unquantized stack in an FP8 checkpoint is refused naming the
    stack, without listing each of its experts as missing as well."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from tokenfab.errors import WeightLoadError
    fp8, _ = fp8_mtp
    bad = tmp_path / "bad"
    shutil.copytree(fp8, bad)
    sd = load_file(str(bad / "model.safetensors"))
    pre = "model.layers.1.mlp.experts."
    E = 1 + max(int(k[len(pre):].split(".")[0]) for k in sd if k.startswith(pre))
    w = {p: [sd.pop(f"{pre}{e}.{p}.weight").float() for e in range(E)] for p in ("gate_proj", "up_proj", "down_proj")}
    for k in [k for k in sd if k.startswith(pre)]:
        del sd[k]
    sd[pre + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(w["gate_proj"], w["up_proj"])])
    sd[pre + "down_proj"] = torch.stack(w["down_proj"])
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"experts\.gate_up_proj.*unquantized expert stack") as e:
        LLM(str(bad), **ENGINE_KW)
    assert "missing" not in str(e.value)
