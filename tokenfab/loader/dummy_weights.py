"""``load_format="dummy"`` (vLLM's name): seeded random weights at the checkpoint's real shapes, no weight file read.

Only config.json (and the tokenizer) are read; :func:`fill_dummy_weights` then gives every parameter a checkpoint
would fill a fresh tensor on the target device, filled there:

* tensors of 2 or more dimensions (linear and embedding matrices, routed-expert stacks, short-conv kernels):
  normal(0, ``std``), ``std`` 0.02 as transformers' ``initializer_range``;
* 1-D tensors named ``*.weight`` (RMSNorm / GatedRMSNorm weights: a checkpoint's only 1-D weights): ones;
* other 1-D tensors (biases, ``e_score_correction_bias``, KDA's ``A_log`` / ``dt_bias``): zeros.

Each tensor is drawn from its own generator seeded from (``seed``, its name), so its values depend only on the
seed, its name, shape, dtype and device (the same on every tensor-parallel rank for a replicated weight, whatever
order the parameters come in). A tied LM head shares the embedding, as :meth:`CausalLM.load_weights` ties it.

Checkpoints published packed (FP8 block-scaled, compressed-tensors INT4 / MXFP4 experts, Kimi's MXFP4) get their
packed tensors from :mod:`tokenfab.loader.dummy_packed` first; this module fills what is left.

Used to measure real shapes without checkpoint files (benchmarks/gpu_shapes.py, benchmarks/gpu_check.sh): the
model's parameters, buffers and KV / memory sizing are those a real checkpoint of the same config.json gives.
"""
from __future__ import annotations

import zlib

import torch
from torch import nn

from tokenfab.errors import UnsupportedError

LOAD_FORMATS = ("auto", "dummy")
DEFAULT_STD = 0.02


def check_load_format(value) -> str:
    """Return ``value`` when it is one of :data:`LOAD_FORMATS`.

    Raises:
        EngineConfigError: any other value, naming ``load_format`` and the accepted values.
    """
    if value not in LOAD_FORMATS:
        from tokenfab.errors import EngineConfigError
        raise EngineConfigError(f"load_format must be one of {', '.join(LOAD_FORMATS)} ('auto': read the "
                                f"checkpoint's weight files; 'dummy': seeded random weights at the config's shapes, "
                                f"no weight file read), got {value!r}.")
    return value


def refuse_packed(model, mc, gguf_file: bool, host_split: bool = False) -> None:
    """Refuse what dummy weights cannot fill: a GGUF file (its block types are kept as the file stores them), and
    host experts (host_experts / num_device_experts) for a checkpoint whose routed experts are packed (FP8
    block-scaled, compressed-tensors INT4 / MXFP4, Kimi's MXFP4: a real load dequantizes them for the split; a
    dummy load fills them packed, loader/dummy_packed.py).

    Raises:
        UnsupportedError: naming load_format and what to change.
    """
    if gguf_file:
        raise UnsupportedError("load_format='dummy' does not fill GGUF files (their linears are kept in the file's "
                               "block types); use load_format='auto' with the file, or a config-only Hugging Face "
                               "folder.")
    if host_split and (getattr(mc, "fp8_block_size", None) is not None or model.expert_quantization() is not None):
        raise UnsupportedError("load_format='dummy' fills this checkpoint's routed experts packed, and host experts "
                               "(host_experts / num_device_experts) need bf16 stacks; leave those unset, or remove "
                               "quantization_config from config.json (the same shapes in bf16).")


def _seed_for(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


@torch.no_grad()
def fill_tensor_(t: torch.Tensor, name: str, seed: int, std: float = DEFAULT_STD) -> torch.Tensor:
    """Fill ``t`` in place by the rules of the module docstring (``name`` picks the rule and seeds the draw)."""
    if t.dim() >= 2:
        g = torch.Generator(device=t.device).manual_seed(_seed_for(seed, name))
        t.normal_(0.0, std, generator=g)
    elif name.endswith(".weight") or name == "weight":
        t.fill_(1.0)
    else:
        t.zero_()
    return t


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, device: torch.device, seed: int = 0, std: float = DEFAULT_STD) -> list[str]:
    """Give every parameter of ``model`` (built by the loader, routed experts possibly still on the meta device) a
    new tensor on ``device`` of the same shape and dtype, filled with seeded random values (module docstring), and
    tie the LM head to the embedding when config.json ties them. The empty CPU tensors the model was built with are
    never touched, so a large model costs no host memory; buffers (RoPE tables) are left to the loader's
    ``model.to(device)``.

    Returns the names filled (the checkpoint's parameter names, routed experts as their stacks ``...experts.w13`` /
    ``w2``); raises nothing beyond torch's out-of-memory errors.
    """
    device = torch.device(device)
    tie = bool(getattr(model.cfg, "tie_word_embeddings", False))
    head = getattr(model, "lm_head", None)
    filled, new_of = [], {}  # id(old parameter) -> its new Parameter (a parameter shared by two modules stays shared)
    modules = dict(model.named_modules(remove_duplicate=False))
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if tie and name == "lm_head.weight":
            continue  # shares the embedding below, as load_weights ties it
        mod_name, _, attr = name.rpartition(".")
        mod = modules[mod_name] if mod_name else model
        if id(p) not in new_of:
            t = torch.empty(p.shape, dtype=p.dtype, device=device)  # routed experts may be meta: only the shape
            new_of[id(p)] = nn.Parameter(fill_tensor_(t, name, seed, std), requires_grad=False)
            filled.append(name)
        setattr(mod, attr, new_of[id(p)])
    if tie and head is not None and hasattr(head, "weight"):
        head.weight = model.model.embed_tokens.weight
    return filled
