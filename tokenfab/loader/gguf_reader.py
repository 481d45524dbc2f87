"""Read a GGUF file (llama.cpp's format) through the ``gguf`` package: Hugging Face config, tensors, chat template.

GGUF stores a model's settings as metadata keys (``llama.block_count``, ``tokenizer.ggml.eos_token_id``,
``tokenizer.chat_template`` ...) and its weights under llama.cpp's names (``blk.3.attn_q.weight``), many of them
block-quantized (Q4_1, Q8_0, ...). This module turns them into what a Hugging Face Llama checkpoint holds:

* :func:`hf_config` -- a transformers-5 ``config.json`` dict (``LlamaForCausalLM``) from the metadata;
* :func:`iter_hf_tensors` -- ``(hf_name, float32 array)`` pairs, dequantized with ``gguf.quants.dequantize``
  (llama.cpp's own reference dequantizer) and renamed to the Hugging Face names;
* the inverse of llama.cpp's q/k row permutation. llama.cpp's ``convert_hf_to_gguf.py`` reorders the rows of
  ``q_proj`` / ``k_proj`` of Llama models from Hugging Face's "rotate half" RoPE layout to the interleaved layout
  (pairs ``(x[2i], x[2i+1])``) that ggml's RoPE rotates: for each head, the rows ``[h0 | h1]`` (the two halves,
  ``d/2`` rows each) become ``h0[0], h1[0], h0[1], h1[1], ...``. :func:`unpermute_qk` undoes it.

Architectures: ``llama`` (Llama, SmolLM, Mistral-style dense models), ``qwen2`` (Llama blocks with q/k/v biases:
read as a Llama config with ``attention_bias`` and a zero o_proj bias, the same function) and ``qwen3`` (per-head
q/k RMSNorm, ``attn_q_norm`` / ``attn_k_norm``: ``Qwen3ForCausalLM``); the MoE architectures ``qwen3moe`` and
``deepseek2`` (DeepSeek-V3, Kimi-K2) through :mod:`tokenfab.loader.gguf_moe`. llama.cpp permutes q/k rows for
``llama`` only: its Qwen2 / Qwen3 / DeepSeek converters keep Hugging Face's row order (ggml rotates them NEOX-style,
or, for DeepSeek's interleaved pairs, normally), as transformers' GGUF loader assumes (its q/k reverse permutation
is registered for "llama" alone). Others raise :class:`tokenfab.errors.UnsupportedError` naming the architecture.
``gguf`` is imported lazily.
"""
from __future__ import annotations

import os
import re
import threading
from typing import Iterator

import numpy as np

from tokenfab.errors import UnsupportedError, WeightLoadError
from tokenfab.loader import gguf_moe

DENSE_ARCHITECTURES = ("llama", "qwen2", "qwen3")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + gguf_moe.MOE_ARCHITECTURES
PERMUTED_QK_ARCHITECTURES = ("llama",)  # llama.cpp's converter reorders q/k rows for these only

# llama.cpp tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",  # qwen2
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


_READERS: dict[tuple, object] = {}  # (real path, size, mtime, inode) -> reader, the last _KEEP_READERS opened
_KEEP_READERS = 2
_READERS_LOCK = threading.Lock()


def open_gguf(path: str):
    """A ``gguf.GGUFReader`` on ``path`` (memory-mapped; nothing is dequantized yet), shared: parsing a file's
    metadata is slow (SmolLM2's Q4_1 file: ~5 s, its 49K-token vocabulary read field by field) and loading one model
    asks for it several times (config, tokenizer, the packed-format check, the weights), so the last two files'
    readers are kept, keyed by path, size, modification time and inode (a rewritten file is parsed again). Callers
    only read from it.

    Raises:
        FileNotFoundError: no file at ``path``.
        WeightLoadError: the file is not a readable GGUF file (bad magic, truncated ...).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file '{path}' does not exist.")
    try:
        import gguf
    except ImportError as e:  # a declared dependency; only a broken install lands here
        raise UnsupportedError("reading GGUF files needs the 'gguf' package: pip install gguf") from e
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)
    with _READERS_LOCK:
        reader = _READERS.get(key)
        if reader is not None:
            return reader
        try:
            reader = gguf.GGUFReader(path, "r")
        except Exception as e:  # gguf raises ValueError / struct.error / IndexError on foreign or truncated files
            raise WeightLoadError(f"'{path}' is not a readable GGUF file ({type(e).__name__}: {e}).") from None
        while len(_READERS) >= _KEEP_READERS:
            _READERS.pop(next(iter(_READERS)))
        _READERS[key] = reader
        return reader


def metadata(reader) -> dict:
    """All metadata keys of ``reader`` as plain Python values (str, int, float, bool, lists of those).

    Read once per reader and kept on it (a 49K-token vocabulary takes ~1 s to read field by field, and loading one
    model asks several times: config, packed-format check, weights). The dict is shared: callers only read it.
    """
    out = getattr(reader, "_tokenfab_metadata", None)
    if out is None:
        out = {key: field.contents() for key, field in reader.fields.items()}
        reader._tokenfab_metadata = out
    return out


def architecture(meta: dict) -> str:
    """``general.architecture``; raises UnsupportedError unless it is one of :data:`SUPPORTED_ARCHITECTURES`."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedError(f"GGUF architecture '{arch}' is not supported (general.architecture); supported: "
                               f"{', '.join(SUPPORTED_ARCHITECTURES)}.")
    return arch


def hf_config(meta: dict, tensor_names: set[str]) -> dict:
    """A transformers-5 ``config.json`` dict from GGUF metadata: ``LlamaForCausalLM`` (llama, qwen2:
    ``attention_bias`` true), ``Qwen3ForCausalLM`` (qwen3), ``Qwen3MoeForCausalLM`` (qwen3moe) or
    ``DeepseekV3ForCausalLM`` (deepseek2; :func:`tokenfab.loader.gguf_moe.moe_config`).

    ``tensor_names``: the GGUF tensor names (``output.weight`` absent means tied input/output embeddings).
    RoPE: ``{arch}.rope.freq_base`` (default 10000) and, when present, ``{arch}.rope.scaling.type`` ``linear``
    with ``.factor`` or ``yarn`` (:func:`tokenfab.loader.gguf_moe.yarn_parameters`); llama3-style ``rope_freqs``
    tensors and other scalings raise UnsupportedError (GGUF keeps only their precomputed frequencies, not the
    parameters transformers needs).

    Raises:
        UnsupportedError: architecture, RoPE scaling or routing not handled.
        WeightLoadError: a required metadata key is missing.
    """
    arch = architecture(meta)

    def need(key: str):
        full = f"{arch}.{key}"
        if full not in meta:
            raise WeightLoadError(f"GGUF metadata key '{full}' is missing; the file is incomplete.")
        return meta[full]

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if arch in DENSE_ARCHITECTURES + ("qwen3moe",) and rope_dim != head_dim:
        raise UnsupportedError(f"GGUF {arch}.rope.dimension_count {rope_dim} != head dim {head_dim}: partial "
                               "rotary embeddings are not supported for this architecture.")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(meta.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
    if vocab <= 0:
        raise WeightLoadError(f"GGUF metadata has neither '{arch}.vocab_size' nor 'tokenizer.ggml.tokens'.")
    rope = {"rope_type": "default", "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0))}
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope = {"rope_type": "linear", "rope_theta": rope["rope_theta"],
                "factor": float(need("rope.scaling.factor"))}
    elif scaling == "yarn":
        rope = gguf_moe.yarn_parameters(arch, meta, rope["rope_theta"], need)
    elif scaling not in ("none", None):
        raise UnsupportedError(f"GGUF {arch}.rope.scaling.type '{scaling}' is not supported (supported: none, "
                               "linear, yarn).")
    if "rope_freqs.weight" in tensor_names:
        raise UnsupportedError("GGUF file holds 'rope_freqs.weight' (llama3-style RoPE scaling), which is not "
                               "supported; use a model without it or its Hugging Face checkpoint.")
    cfg = {
        "architectures": ["Qwen3ForCausalLM" if arch == "qwen3" else "LlamaForCausalLM"],
        "model_type": "qwen3" if arch == "qwen3" else "llama",
        "hidden_size": hidden, "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_parameters": rope, "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": arch == "qwen2", "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "use_cache": True, "dtype": "bfloat16",
    }
    if arch in gguf_moe.MOE_ARCHITECTURES:
        cfg.update(gguf_moe.moe_config(arch, meta, tensor_names, need))
    for key in ("bos", "eos", "padding"):
        tid = meta.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None:
            cfg["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(tid)
    return cfg


def gguf_tokenizer(path: str):
    """transformers' tokenizer converted from the file's ``tokenizer.*`` metadata (vocabulary, merges, special
    tokens, chat template) by transformers' own GGUF tokenizer conversion, its text split set where transformers
    lacks the vocabulary's (:func:`tokenfab.loader.gguf_pretokenizer.fix_pre_tokenizer`; a pre-tokenizer neither
    knows is said once, :func:`warn_pre_tokenizer`). ``AutoTokenizer`` first reads the model config transformers
    derives from the file and refuses architectures it has none for (deepseek2), so those are converted through the
    generic fast tokenizer class, the same conversion without the config.

    Raises FileNotFoundError / WeightLoadError as :func:`open_gguf`."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from tokenfab.loader.gguf_pretokenizer import fix_pre_tokenizer

    meta = metadata(open_gguf(path))
    arch = meta.get("general.architecture")
    cls = AutoTokenizer if arch in DENSE_ARCHITECTURES + ("qwen3moe",) else PreTrainedTokenizerFast
    folder, name = os.path.split(os.path.abspath(path))
    tok = cls.from_pretrained(folder, gguf_file=name)
    warn_pre_tokenizer(path, fix_pre_tokenizer(tok, meta))
    return tok


_WARNED: set[str] = set()


def warn_pre_tokenizer(path: str, warning: str | None) -> None:
    """Print ``warning`` (from :func:`tokenfab.loader.gguf_pretokenizer.fix_pre_tokenizer`) about the GGUF file
    at ``path`` to stderr, once per file and process; None prints nothing."""
    import sys

    if warning and path not in _WARNED:
        _WARNED.add(path)
        print(f"[tokenfab] {os.path.basename(path)}: {warning}", file=sys.stderr, flush=True)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: [n_head * d, in] interleaved rows -> Hugging Face's half-split rows.

    llama.cpp writes ``w.reshape(n_head, 2, d/2, in).swapaxes(1, 2)`` (convert_hf_to_gguf.py, ``permute``);
    this is its inverse, ``w.reshape(n_head, d/2, 2, in).swapaxes(1, 2)``. ``n_head``: query heads for q_proj,
    KV heads for k_proj. Raises ValueError when the row count is not a multiple of ``2 * n_head``.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"q/k weight with {rows} rows cannot be split into {n_head} heads of even size.")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor that maps to one Hugging Face tensor (every one but the expert stacks
    and DeepSeek's ``attn_k_b`` / ``attn_v_b``: :func:`tokenfab.loader.gguf_moe.moe_tensors`); raises
    WeightLoadError for names it does not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    if m and m.group(2) in gguf_moe.LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{gguf_moe.LAYER_NAMES[m.group(2)]}"
    raise WeightLoadError(f"GGUF tensor '{gguf_name}' has no Hugging Face counterpart (unknown name).")


def dequantize(tensor) -> np.ndarray:
    """One ``gguf.ReaderTensor`` -> float32 array in row-major (Hugging Face) shape, e.g. [out, in] for linears.

    Uses ``gguf.quants.dequantize`` (F32/F16/BF16 and every block type gguf-py implements: Q4_0, Q4_1, Q8_0,
    K-quants ...). Raises UnsupportedError for a type it cannot dequantize.
    """
    from gguf.quants import dequantize as gguf_dequantize

    try:
        arr = gguf_dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise UnsupportedError(f"GGUF tensor '{tensor.name}': quantization type {tensor.tensor_type.name} cannot "
                               "be dequantized by the installed gguf package.") from None
    shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))  # GGUF lists ne0 (innermost) first
    return np.asarray(arr, dtype=np.float32).reshape(shape)


def permutes_qk(reader) -> bool:
    """True when the file's architecture is one whose q/k rows llama.cpp's converter permuted (llama)."""
    return reader.fields["general.architecture"].contents() in PERMUTED_QK_ARCHITECTURES


def zero_o_biases(cfg: dict) -> Iterator[tuple[str, np.ndarray]]:
    """qwen2 read as a Llama config with ``attention_bias``: the o_proj biases Qwen2 does not have, as zeros (so
    the Llama layer computes exactly Qwen2's function)."""
    if cfg.get("attention_bias") and cfg["model_type"] == "llama":
        for i in range(cfg["num_hidden_layers"]):
            yield f"model.layers.{i}.self_attn.o_proj.bias", np.zeros(cfg["hidden_size"], dtype=np.float32)


def iter_hf_tensors(reader, cfg: dict) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(hf_name, float32 array)`` for every tensor of ``reader``, q/k rows un-permuted (llama), then
    qwen2's zero o_proj biases (:func:`zero_o_biases`); MoE architectures through
    :func:`tokenfab.loader.gguf_moe.moe_tensors` (experts split, MLA's kv_b joined).

    ``cfg``: the dict from :func:`hf_config` (head counts). Arrays are fresh (not views of the memory map).
    """
    if reader.fields["general.architecture"].contents() in gguf_moe.MOE_ARCHITECTURES:
        yield from gguf_moe.moe_tensors(reader, cfg, dequantize, hf_name)
        return
    permuted = permutes_qk(reader)
    for t in reader.tensors:
        name = hf_name(t.name)
        w = dequantize(t)
        if permuted and name.endswith("self_attn.q_proj.weight"):
            w = unpermute_qk(w, cfg["num_attention_heads"])
        elif permuted and name.endswith("self_attn.k_proj.weight"):
            w = unpermute_qk(w, cfg["num_key_value_heads"])
        yield name, np.array(w, dtype=np.float32, copy=True)
    yield from zero_o_biases(cfg)
