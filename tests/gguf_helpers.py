"""Shared pieces of the GGUF tests: the model header and closing of a ``gguf.GGUFWriter`` file (from
tokenfab/testing/gguf_writer.py, which the GPU check's GGUF files use too), the folder of
dequantized reference weights, the packed-versus-reference generation run, and the kernel products against their
float64 bound (test_gguf_linear.py, test_gguf_kquants.py).

Import with ``from gguf_helpers import ...`` (tests/ is on the path).
"""
from __future__ import annotations

import contextlib
import os
import shutil

import numpy as np
import torch

from tokenfab.testing.gguf_writer import add_model_header, finish_gguf  # noqa: F401  (re-exported)

U = 2.0 ** -24  # float32 unit roundoff


GGUF_TOP_LEVEL = {"model.embed_tokens.weight": ("token_embd.weight", "token_embd"),
                  "model.norm.weight": ("output_norm.weight", None), "lm_head.weight": ("output.weight", "output")}


def gguf_name(name: str, modules: dict[str, str]) -> tuple[str, str | None]:
    """(GGUF name, kind) of Hugging Face tensor ``name``: ``modules`` maps a layer's module path to its GGUF name
    (``self_attn.q_proj`` -> ``attn_q``); the kind, the key into a quant-types table, is that name for a layer's
    weights, ``token_embd`` / ``output`` for the embedding and LM head, None for biases and the final norm."""
    if name in GGUF_TOP_LEVEL:
        return GGUF_TOP_LEVEL[name]
    layer, rest = name[len("model.layers."):].split(".", 1)
    mod, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{modules[mod]}.{suffix}", modules[mod] if suffix == "weight" else None


def reference_folder(ckpt: str, out: str, ref: dict[str, np.ndarray]) -> str:
    """The checkpoint folder with the dequantized weights (config and tokenizer copied)."""
    from safetensors.torch import save_file
    shutil.copytree(ckpt, out)
    save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in ref.items()},
              os.path.join(out, "model.safetensors"))
    return out


def generate_packed_and_reference(path: str, ref: str, tokenizer_dir: str, prompts, sp, check_packed=None) -> dict:
    """Outputs of the GGUF file ``path`` (packed) and of the reference folder ``ref``, each served in float32:
    ``{"packed": ..., "reference": ...}``; ``check_packed(llm)`` runs on the packed engine after its generation."""
    from tokenfab import LLM
    outs = {}
    for key, model in (("packed", path), ("reference", ref)):
        llm = LLM(model, dtype="float32", tokenizer=tokenizer_dir, max_model_len=128, progress=False)
        outs[key] = llm.generate(prompts, sp, use_tqdm=False)
        if key == "packed" and check_packed is not None:
            check_packed(llm)
    return outs


def with_bias(y: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y + bias, s + |bias|) in float64 for an exact product y and its bound's S; unchanged without a bias."""
    return (y, s) if bias is None else (y + bias.double(), s + bias.double().abs())


def assert_within_bound(y: torch.Tensor, x: torch.Tensor, ye: torch.Tensor, s: torch.Tensor) -> None:
    """``y`` (a product over ``x``'s last dimension K) within (3K + 64) u S of the exact float64 ``ye``, plus one
    bf16 rounding of |ye| for a bf16 ``y`` (the bound derived in test_gguf_linear.py's docstring)."""
    y64 = y.double().reshape(ye.shape)
    tol = (3 * x.shape[-1] + 64) * U * s + (2.0 ** -8 * ye.abs() if y.dtype == torch.bfloat16 else 0)
    bad = (y64 - ye).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} outputs off: max err {(y64 - ye).abs().max():.3g}, tol {tol.max():.3g}"


@contextlib.contextmanager
def int8_activations(on: bool):
    """The packed linears' int8-activation setting (``cpu_gguf.gguf_int8_activations``) at ``on`` inside the block,
    restored after it."""
    from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf
    before = cpu_gguf.gguf_int8_activations(on)
    try:
        yield
    finally:
        cpu_gguf.gguf_int8_activations(before)


def check_kernel_product(raw: np.ndarray, name: str, k: int, rows: int, dtype: torch.dtype, check_close):
    """A ``GGUFWeight`` of GGUF rows ``raw`` ([n, bytes], type ``name``, ``k`` inputs) run by its kernel on ``rows``
    random rows of ``dtype`` (a random bias for 3 and 17 rows, torch seeded by ``rows``): output dtype and shape,
    then ``check_close`` on the kernel's product (bf16 and float32 outputs) and on the PyTorch reference path's.
    bf16 x of more than 16 rows (prefill) multiplies the weight rounded once to bf16, the dequantized bf16 twin's:
    those products are checked against that weight (``check_close(..., bf16_weight=True)``). bf16 x of 5..16 rows
    that would run on int8 activations (``cpu_gguf.gguf_int8_path``; test_gguf_int8_activations.py checks that path
    against its own definition) runs the exact GEMV here (the setting off for the call). Returns (x, y, bias)."""
    from tokenfab.quant.gguf_weight import GGUFWeight
    torch.manual_seed(rows)
    n = raw.shape[0]
    w = GGUFWeight.from_rows(torch.from_numpy(raw), name, k)
    w.prepare()
    assert w._kernel
    bias = torch.randn(n) if rows in (3, 17) else None
    x = torch.randn(rows, k).to(dtype)
    with int8_activations(False):
        y = w.linear(x, bias)
        assert y.dtype == dtype and y.shape == (rows, n)
        prefill_bf16 = dtype == torch.bfloat16 and rows > 16  # the dequantizing brgemm on bf16-rounded weights
        check_close(y, x, raw, name, bias, bf16_weight=prefill_bf16)
        y32 = w.linear_f32(x, bias)
    assert y32.dtype == torch.float32 and y32.shape == (rows, n)
    check_close(y32, x, raw, name, bias, bf16_weight=prefill_bf16)
    check_close(w.reference_linear(x, bias), x, raw, name, bias)  # and the PyTorch path under the same bound
    return x, y, bias


def add_hf_tokenizer(w, hf_dir: str, cfg: dict, pre: str = "default") -> None:
    """The Hugging Face tokenizer at ``hf_dir`` (a byte-level BPE ``tokenizer.json``) and its chat template
    written into the ``gguf.GGUFWriter`` ``w`` as llama.cpp's converter writes a gpt2-style vocabulary
    (``tokenizer.ggml.tokens`` / ``token_type`` / ``merges``, bos / eos / pad ids from ``cfg``; ``pre``: the
    ``tokenizer.ggml.pre`` name)."""
    import json

    tok = json.load(open(os.path.join(hf_dir, "tokenizer.json")))
    vocab = tok["model"]["vocab"]
    for t in tok["added_tokens"]:
        vocab[t["content"]] = t["id"]
    tokens = [None] * cfg["vocab_size"]
    for s, i in vocab.items():
        tokens[i] = s
    special = {t["id"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(False)
    tcfg = json.load(open(os.path.join(hf_dir, "tokenizer_config.json")))
    template = tcfg.get("chat_template")
    if template is None and os.path.isfile(os.path.join(hf_dir, "chat_template.jinja")):
        template = open(os.path.join(hf_dir, "chat_template.jinja")).read()
    w.add_chat_template(template)
