"""Read a llama / qwen2 / qwen3 / qwen3moe GGUF file (llama.cpp's format, parsed with the ``gguf`` package) with its
quantized linears and routed experts kept packed: ``LLM(model="path/file.gguf")``.

* Config: the ``llama.*`` metadata becomes a config.json-shaped dict (:func:`gguf_config`); the tokenizer and chat
  template come from the file (transformers' GGUF tokenizer loader) unless a tokenizer folder is given.
* Names: :func:`hf_name` maps llama.cpp tensor names to the Hugging Face names the models load by.
* Values: the linears (q, k, v, o, gate, up, down), the token embedding and an untied output in a packed block
  type (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) become :class:`~tokenfab.quant.gguf_weight.GGUFWeight` objects (their bytes, regrouped,
  never a float copy; the embedding is looked up row by row from them and a tied LM head multiplies them,
  ``CausalLM.load_weights``); qwen3moe's expert stacks ``ffn_{gate,up,down}_exps`` [E, out, in] in a packed
  block type become one GGUFWeight per expert, which the model's :class:`~tokenfab.quant.gguf_experts.GGUFExperts`
  stacks copy (gate and up of a layer in one type); every other tensor (norms, an embedding in another type) is
  read as float32 (quantized ones dequantized), the model casting it to its dtype. A linear in another quantized
  type is refused by name.
* llama.cpp's converter permutes q and k rows per head for its rotary layout (``LlamaModel.permute`` in
  convert_hf_to_gguf.py; llama only, not qwen2 / qwen3); the permutation is over output rows and GGUF blocks run
  along the input dimension, so it is undone on the packed rows (:func:`unpermute_rows`).
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator

import numpy as np
import torch

from tokenfab.errors import WeightLoadError
from tokenfab.loader.gguf_moe import EXPERT_STACKS as _EXPERT_STACKS
from tokenfab.loader.gguf_reader import open_gguf

_BLOCK_NAMES = {  # llama.cpp's per-layer names -> transformers' LlamaDecoderLayer names
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",  # qwen3moe's router (its expert stacks: gguf_moe.EXPERT_STACKS)
}
_PLAIN_TYPES = ("F32", "F16", "BF16")  # tensor types read as values (every other type is block-quantized)
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PACKED_TOP = {"token_embd.weight", "output.weight"}  # kept packed when in a packed block type (PackedEmbedding)
_LINEARS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def is_gguf(path: str) -> bool:
    """True when ``path`` names a GGUF file (by its .gguf suffix)."""
    return isinstance(path, str) and path.lower().endswith(".gguf")


def hf_name(name: str) -> str | None:
    """llama.cpp tensor name -> Hugging Face name (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.
    weight``), or None for a tensor tokenfab does not load (e.g. ``rope_freqs.weight``)."""
    m = _BLK.match(name)
    if m:
        mapped = _BLOCK_NAMES.get(m.group(2))
        return None if mapped is None else f"model.layers.{m.group(1)}.{mapped}.{m.group(3)}"
    base, _, kind = name.rpartition(".")
    mapped = _TOP_NAMES.get(base)
    return None if mapped is None else f"{mapped}.{kind}"


def gguf_config(path: str) -> dict:
    """The config.json-shaped dict (LlamaForCausalLM) of a llama-architecture GGUF file: the dequantizing
    reader's :func:`tokenfab.loader.gguf_reader.hf_config`, with its refusals as WeightLoadError naming the file.

    Raises:
        FileNotFoundError: no such file.
        WeightLoadError: an architecture other than llama, RoPE scaling tokenfab does not read, missing metadata.
    """
    from tokenfab.errors import UnsupportedError
    from tokenfab.loader.gguf_reader import hf_config, metadata

    r = open_gguf(path)
    try:
        return hf_config(metadata(r), {t.name for t in r.tensors})
    except (UnsupportedError, WeightLoadError) as e:
        raise WeightLoadError(f"{path}: {e}") from None


def unpermute_rows(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (:func:`tokenfab.loader.gguf_reader.unpermute_qk`) on ``rows`` [n, ...]:
    float values or packed GGUF rows alike, since only whole rows move."""
    from tokenfab.loader.gguf_reader import unpermute_qk
    return unpermute_qk(rows, n_head)


def _unpacked_architecture(cfg: dict) -> str | None:
    """Why a config's architecture is not served packed (deepseek2, tokenfab.loader.gguf_moe), or None for the
    ones this loader reads (llama / qwen2 / qwen3, and qwen3moe with its experts in tokenfab.quant.gguf_experts)."""
    if cfg["model_type"] in ("llama", "qwen3", "qwen3_moe"):
        return None
    arch = {"deepseek_v3": "deepseek2"}.get(cfg["model_type"], cfg["model_type"])
    return f"GGUF architecture {arch}: its MLA and expert tensors are not served packed yet"


def _expert_stack_reason(tensors, cfg: dict) -> str | None:
    """Why a qwen3moe file's expert stacks cannot stay packed (a layer mixing quantized and plain stacks, gate and
    up in two block types, gate rows not filling whole 16-row tiles), or None."""
    types: dict[str, dict[str, object]] = {}
    for t in tensors:
        m = _BLK.match(t.name)
        if m and m.group(2) in _EXPERT_STACKS:
            types.setdefault(m.group(1), {})[m.group(2)] = t.tensor_type
    mixed, two_types = [], []
    for layer, kinds in sorted(types.items(), key=lambda kv: int(kv[0])):
        quantized = {k for k, q in kinds.items() if q.name not in _PLAIN_TYPES}
        if quantized and len(quantized) < len(kinds):
            mixed.append(layer)
        elif quantized and kinds.get("ffn_gate_exps") != kinds.get("ffn_up_exps"):
            two_types.append((layer, f"{kinds['ffn_gate_exps'].name} / {kinds['ffn_up_exps'].name}"))
        elif quantized and cfg["moe_intermediate_size"] % 16:
            return f"expert intermediate size {cfg['moe_intermediate_size']} is not a multiple of 16"
    if mixed:
        return (f"{len(mixed)} of {len(types)} layers hold quantized and unquantized expert stacks, first layer "
                f"{mixed[0]}")
    if two_types:
        layer, pair = two_types[0]
        return (f"{len(two_types)} of {len(types)} layers hold ffn_gate_exps and ffn_up_exps in two block types, "
                f"first layer {layer}: {pair}; packed experts need one type for gate and up")
    return None


def packed_expert_stacks(path: str) -> frozenset:
    """The RoutedExperts module names (``model.layers.N.mlp.experts``) whose stacks the GGUF file at ``path``
    stores quantized: kept packed (:class:`~tokenfab.quant.gguf_experts.GGUFExperts`) when the file is served
    packed."""
    out = set()
    for t in open_gguf(path).tensors:
        m = _BLK.match(t.name)
        if m and m.group(2) == "ffn_gate_exps" and t.tensor_type.name not in _PLAIN_TYPES:
            out.add(f"model.layers.{m.group(1)}.mlp.experts")
    return frozenset(out)


def packed_unsupported_reason(path: str) -> str | None:
    """Why the GGUF file at ``path`` cannot be served packed (deepseek2, rope scaling, a linear or expert stack in a
    block type without a packed kernel, expert stacks :func:`_expert_stack_reason` refuses), or None when it can.
    Reads metadata and tensor headers only (the file is memory-mapped; no tensor data is touched).

    Raises:
        FileNotFoundError: no file at ``path``.
    """
    from tokenfab.quant import gguf_blocks

    try:
        cfg = gguf_config(path)
    except WeightLoadError as e:
        return str(e)
    if reason := _unpacked_architecture(cfg):
        return reason
    tensors = open_gguf(path).tensors
    for t in tensors:
        m = _BLK.match(t.name)
        if (m and (m.group(2) in _LINEARS or m.group(2) in _EXPERT_STACKS) and t.name.endswith(".weight")
                and t.tensor_type.name not in _PLAIN_TYPES and t.tensor_type.name not in gguf_blocks.BLOCK_TYPES):
            return f"tensor {t.name} is {t.tensor_type.name} (packed kernels: {', '.join(gguf_blocks.BLOCK_TYPES)})"
    return _expert_stack_reason(tensors, cfg)


def iterate_gguf_weights(path: str, progress: bool = True) -> Iterator[tuple[str, torch.Tensor | object]]:
    """Yield (Hugging Face name, value) for every tensor tokenfab loads from a llama / qwen2 / qwen3 / qwen3moe GGUF
    file: a :class:`~tokenfab.quant.gguf_weight.GGUFWeight` for packed linears and for each expert of a quantized
    expert stack (``model.layers.N.mlp.experts.{e}.{proj}.weight``; :func:`packed_expert_stacks` names the stacks
    the model keeps packed), else a float32 tensor.

    Raises:
        WeightLoadError: a linear in a quantized type tokenfab does not execute packed, or a non-linear tensor in a
            type gguf cannot dequantize.
    """
    import gguf
    from tqdm import tqdm

    from tokenfab.quant import gguf_blocks
    from tokenfab.quant.gguf_weight import GGUFWeight

    from tokenfab.loader.gguf_reader import permutes_qk, zero_o_biases

    r = open_gguf(path)
    cfg = gguf_config(path)
    reason = _unpacked_architecture(cfg) or _expert_stack_reason(r.tensors, cfg)
    if reason:
        raise WeightLoadError(f"{path}: {reason}")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    permuted = permutes_qk(r)  # llama only; qwen2 / qwen3 rows are in Hugging Face order
    plain = {getattr(gguf.GGMLQuantizationType, name) for name in _PLAIN_TYPES}
    for t in tqdm(r.tensors, desc="Loading GGUF", unit="tensor", disable=not progress, leave=False):
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else None
        if kind in _EXPERT_STACKS:  # [E, out, in]: one weight per expert (GGUFWeight rows, or float32 values)
            yield from _expert_weights(t, kind, [int(s) for s in reversed(t.shape)], t.tensor_type not in plain)
            continue
        name = hf_name(t.name)
        if name is None:
            continue
        n_head = heads if kind == "attn_q" else kv_heads if kind == "attn_k" else None
        if not permuted or not t.name.endswith(".weight"):
            n_head = None
        shape = [int(s) for s in reversed(t.shape)]  # GGUF lists ne0 (the input dim) first
        qtype = t.tensor_type
        if kind in _LINEARS and t.name.endswith(".weight") and qtype not in plain:
            if qtype.name not in gguf_blocks.BLOCK_TYPES:
                raise WeightLoadError(f"{path}: tensor {t.name} is {qtype.name}; tokenfab executes "
                                      f"{', '.join(gguf_blocks.BLOCK_TYPES)} packed (other types not yet).")
            rows = torch.from_numpy(np.array(t.data)).reshape(shape[0], -1)
            if n_head is not None:
                rows = unpermute_rows(rows, n_head)
            yield name, GGUFWeight.from_rows(rows, qtype.name, shape[1])
            continue
        if t.name in _PACKED_TOP and qtype.name in gguf_blocks.BLOCK_TYPES:  # embedding / LM head kept packed too
            rows = torch.from_numpy(np.array(t.data)).reshape(shape[0], -1)
            yield name, GGUFWeight.from_rows(rows, qtype.name, shape[1])
            continue
        if qtype in plain:  # BF16 data arrives as uint16 bit patterns: gguf's dequantize widens each kind exactly
            values = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, qtype), dtype=np.float32)).reshape(shape)
        elif qtype.name in gguf_blocks.BLOCK_TYPES:
            values = gguf_blocks.dequantize_rows(torch.from_numpy(np.array(t.data)).reshape(shape[0], -1),
                                                 gguf_blocks.block_type(qtype.name)).reshape(shape)
        else:
            try:
                values = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, qtype))).reshape(shape)
            except NotImplementedError as e:
                raise WeightLoadError(f"{path}: tensor {t.name} is {qtype.name}, which gguf cannot dequantize") from e
        if n_head is not None:
            values = unpermute_rows(values, n_head)
        yield name, values
    for name, zeros in zero_o_biases(cfg):
        yield name, torch.from_numpy(zeros)


def _expert_weights(t, kind: str, shape: list[int], quantized: bool) -> Iterator[tuple[str, torch.Tensor | object]]:
    """A stacked expert tensor ``t`` [E, out, in] as (``model.layers.N.mlp.experts.{e}.{proj}.weight``, value) per
    expert: a :class:`~tokenfab.quant.gguf_weight.GGUFWeight` over the expert's rows of the file when quantized,
    else its float32 values."""
    from tokenfab.loader.gguf_moe import expert_matrix
    from tokenfab.quant import gguf_blocks
    from tokenfab.quant.gguf_weight import GGUFWeight

    if quantized and t.tensor_type.name not in gguf_blocks.BLOCK_TYPES:
        raise WeightLoadError(f"tensor {t.name} is {t.tensor_type.name}; tokenfab executes "
                              f"{', '.join(gguf_blocks.BLOCK_TYPES)} packed (other types not yet).")
    layer = t.name.split(".")[1]
    for e in range(shape[0]):
        name = f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_STACKS[kind]}.weight"
        if quantized:
            rows = torch.from_numpy(np.array(t.data[e])).reshape(shape[1], -1)
            yield name, GGUFWeight.from_rows(rows, t.tensor_type.name, shape[2])
        else:
            yield name, torch.from_numpy(expert_matrix(t, e))


def tokenizer_cache_folder(path: str) -> str:
    """Where :func:`load_gguf_tokenizer` keeps ``path``'s converted tokenizer:
    ``<cache>/tokenizers/gguf/<stem>-<key>`` (the key of :func:`tokenfab.loader.gguf_to_hf.cache_key`, which changes
    with the file)."""
    from tokenfab.cache_paths import cache_dir
    from tokenfab.loader.gguf_to_hf import cache_key, is_gguf_path

    stem = os.path.basename(path)[:-len(".gguf")] if is_gguf_path(path) else os.path.basename(path)
    return os.path.join(cache_dir(), "tokenizers", "gguf", f"{stem}-{cache_key(path)}")


def load_gguf_tokenizer(path: str):
    """transformers' tokenizer built from the GGUF file's tokenizer metadata (and chat template).

    transformers' GGUF conversion parses the whole file again (~5 s for SmolLM2's 49K-token vocabulary), so the
    converted tokenizer is saved once (``save_pretrained``, as the dequantized folders keep theirs) into
    :func:`tokenizer_cache_folder` and later loads read that folder. The folder is written under a temporary name and
    renamed into place; where the cache cannot be written, the tokenizer is converted each time.

    Raises:
        FileNotFoundError: no file at ``path``.
    """
    from transformers import AutoTokenizer

    from tokenfab.cache_paths import write_folder
    from tokenfab.loader.gguf_reader import gguf_tokenizer

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file '{path}' does not exist.")
    folder = tokenizer_cache_folder(path)
    if os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        from tokenfab.loader.gguf_pretokenizer import pre_tokenizer_warning
        from tokenfab.loader.gguf_reader import metadata, open_gguf, warn_pre_tokenizer
        warn_pre_tokenizer(path, pre_tokenizer_warning(metadata(open_gguf(path))))  # the reader the load shares
        return AutoTokenizer.from_pretrained(folder)
    tok = gguf_tokenizer(path)
    try:
        write_folder(folder, tok.save_pretrained, "tokenizer_config.json")
    except OSError:  # the cache is not writable: converted again next time
        pass
    return tok


def save_dequantized(path: str, out_dir: str, dtype: torch.dtype = torch.float32) -> str:
    """Write a Hugging Face checkpoint folder (config.json, model.safetensors in ``dtype``, tokenizer files) holding
    the GGUF file's weights dequantized: the reference the packed model is compared with. Returns ``out_dir``."""
    import json

    from safetensors.torch import save_file

    from tokenfab.quant.packed_weight import PackedWeight

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(gguf_config(path), f, indent=1)
    tensors = {name: (v.dequantize() if isinstance(v, PackedWeight) else v).to(dtype).contiguous()
               for name, v in iterate_gguf_weights(path, progress=False)}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    load_gguf_tokenizer(path).save_pretrained(out_dir)
    return out_dir
