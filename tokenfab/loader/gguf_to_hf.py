"""A GGUF file -> a cached Hugging Face checkpoint folder (bf16 safetensors, config, generation config, tokenizer).

A GGUF file whose architecture and types tokenfab's packed loader reads is served packed (loader/gguf_packed.py,
default_model.resolve_model); otherwise, and for the default model's bf16 twin (the folder ``tokenfab demo``
serves), it is dequantized once into ``<cache>/models/gguf/<file stem>-<key>/`` (``<cache>`` is
``$TOKENFAB_CACHE`` or ``~/.cache/tokenfab``):

* ``model.safetensors`` (or shards of about 4 GiB with ``model.safetensors.index.json``, written as the tensors are
  dequantized, so a large MoE file never sits in memory whole): every tensor dequantized to float32 by
  :mod:`tokenfab.loader.gguf_reader` (llama.cpp's reference dequantizer, q/k rows un-permuted, MoE experts and
  MLA tensors in Hugging Face's layout), then rounded to bfloat16 (round to nearest even, ``Tensor.to``);
* ``config.json`` / ``generation_config.json``: from the GGUF metadata (bos / eos / pad token ids);
* ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``: transformers' own GGUF tokenizer
  conversion (:func:`tokenfab.loader.gguf_reader.gguf_tokenizer`) saved with ``save_pretrained``;
* ``gguf_source.json``: the source file, its size and the cache key.

The folder is written under a temporary name and renamed into place, so a crash never leaves half a checkpoint;
the key (size plus a SHA-256 of the file's first and last MiB, which hold the metadata and tensor index, and the
converter version) changes when the file does. :func:`resolve_model_path` is the hook the engine entry points
call: a ``*.gguf`` path becomes its folder, anything else passes through.
"""
from __future__ import annotations

import hashlib
import json
import os

CONVERTER_VERSION = 1
_HEAD_TAIL_BYTES = 1 << 20
SHARD_BYTES = 4 << 30  # dequantized folder shards: at most about 4 GiB each (write_shards)


def is_gguf_path(model: str | None) -> bool:
    """True when ``model`` names a GGUF file (by its ``.gguf`` suffix, any case)."""
    return isinstance(model, str) and model.lower().endswith(".gguf")


def cache_key(path: str) -> str:
    """12 hex digits identifying the GGUF file's contents (size, first and last MiB) and the converter version."""
    size = os.path.getsize(path)
    h = hashlib.sha256(f"v{CONVERTER_VERSION}:{size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(_HEAD_TAIL_BYTES))
        if size > _HEAD_TAIL_BYTES:
            f.seek(max(_HEAD_TAIL_BYTES, size - _HEAD_TAIL_BYTES))
            h.update(f.read())
    return h.hexdigest()[:12]


def cached_folder(path: str, dtype: str = "bfloat16") -> str:
    """Where :func:`ensure_converted` keeps ``path``'s checkpoint: ``<cache>/models/gguf/<stem>-<key>`` (bfloat16),
    ``<stem>-<key>-float32`` for the float32 copy (the exact dequantized values: ``eval kl --reference
    dequantized``)."""
    from tokenfab.cache_paths import cache_dir

    stem = os.path.basename(path)[:-len(".gguf")] if is_gguf_path(path) else os.path.basename(path)
    suffix = "" if dtype == "bfloat16" else f"-{dtype}"
    return os.path.join(cache_dir(), "models", "gguf", f"{stem}-{cache_key(path)}{suffix}")


def hf_state_dict(path: str, dtype=None) -> dict:
    """All tensors of the GGUF file under Hugging Face names as torch tensors: the float32 dequantized values, or
    those rounded to ``dtype`` (e.g. ``torch.bfloat16``, round to nearest even) when given. The config is
    :func:`gguf_config`'s."""
    import torch

    from tokenfab.loader.gguf_reader import hf_config, iter_hf_tensors, metadata, open_gguf

    reader = open_gguf(path)
    cfg = hf_config(metadata(reader), {t.name for t in reader.tensors})
    out = {}
    for name, arr in iter_hf_tensors(reader, cfg):
        t = torch.from_numpy(arr)
        out[name] = t if dtype is None else t.to(dtype)
    return out


def gguf_config(path: str) -> dict:
    """The Hugging Face ``config.json`` dict of the GGUF file at ``path`` (see gguf_reader.hf_config)."""
    from tokenfab.loader.gguf_reader import hf_config, metadata, open_gguf

    reader = open_gguf(path)
    return hf_config(metadata(reader), {t.name for t in reader.tensors})


def write_shards(tensors, out_dir: str, shard_bytes: int | None = None) -> list[str]:
    """Save ``(name, tensor)`` pairs into ``out_dir`` as safetensors files of at most about ``shard_bytes`` each
    (default :data:`SHARD_BYTES`; a tensor larger than that gets a file of its own), so a large MoE file's experts
    never sit in memory at once: one file is ``model.safetensors``; several are ``model-00001-of-0000N.safetensors``
    ... with ``model.safetensors.index.json`` (Hugging Face's sharded layout). Returns the file names written."""
    shard_bytes = shard_bytes or SHARD_BYTES
    shards: list[dict] = []
    current: dict = {}
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > shard_bytes:
            shards.append(_save_part(current, out_dir, len(shards)))
            current, size = {}, 0
        current[name], size = t.contiguous(), size + nbytes
    if current or not shards:
        shards.append(_save_part(current, out_dir, len(shards)))
    if len(shards) == 1:
        os.replace(os.path.join(out_dir, shards[0]["file"]), os.path.join(out_dir, "model.safetensors"))
        return ["model.safetensors"]
    n, weight_map, total = len(shards), {}, 0
    for i, part in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(os.path.join(out_dir, part["file"]), os.path.join(out_dir, final))
        weight_map.update({name: final for name in part["names"]})
        total += part["bytes"]
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return sorted(set(weight_map.values()))


def _save_part(tensors: dict, out_dir: str, i: int) -> dict:
    """Write one shard under a temporary name; its file, tensor names and bytes."""
    from safetensors.torch import save_file

    file = f"part-{i:05d}.safetensors"
    save_file(tensors, os.path.join(out_dir, file), metadata={"format": "pt"})
    return {"file": file, "names": list(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def write_checkpoint(path: str, out_dir: str, dtype: str = "bfloat16") -> None:
    """Write the Hugging Face folder of GGUF file ``path`` into the existing empty folder ``out_dir``, its tensors
    stored in ``dtype`` ("bfloat16", or "float32": gguf's dequantized values unrounded).

    Raises the errors of :mod:`tokenfab.loader.gguf_reader` (UnsupportedError, WeightLoadError) for files it
    cannot convert.
    """
    import torch

    from tokenfab.loader.gguf_pretokenizer import pre_tokenizer_warning
    from tokenfab.loader.gguf_reader import gguf_tokenizer, hf_config, iter_hf_tensors, metadata, open_gguf

    reader = open_gguf(path)
    meta = metadata(reader)
    cfg = hf_config(meta, {t.name for t in reader.tensors})
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")
    write_shards(((name, torch.from_numpy(arr).to(getattr(torch, dtype)))
                  for name, arr in iter_hf_tensors(reader, cfg)), out_dir)
    del reader
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    warning = None
    if "tokenizer.ggml.model" in meta:
        gguf_tokenizer(path).save_pretrained(out_dir)
        warning = pre_tokenizer_warning(meta)
    with open(os.path.join(out_dir, "gguf_source.json"), "w") as f:
        json.dump({"source": os.path.abspath(path), "size": os.path.getsize(path), "key": cache_key(path),
                   "converter_version": CONVERTER_VERSION, "general.name": meta.get("general.name"),
                   "general.file_type": meta.get("general.file_type"), "stored_dtype": dtype,
                   "tokenizer_warning": warning}, f, indent=2)


def ensure_converted(path: str, quiet: bool = False, dtype: str = "bfloat16") -> str:
    """The cached Hugging Face folder of GGUF file ``path`` (tensors in ``dtype``: "bfloat16" or "float32"),
    converting it first when absent (~10 s for 135M parameters on 2 cores). Written to a temporary folder and
    renamed into place.

    Raises:
        FileNotFoundError: no file at ``path``.
        UnsupportedError / WeightLoadError: the file cannot be converted (architecture, quantization type ...).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file '{path}' does not exist.")
    final = cached_folder(path, dtype)
    if os.path.isfile(os.path.join(final, "config.json")):
        if not quiet:  # the folder's tokenizer splits text by a rule other than its vocabulary's: said each run
            from tokenfab.loader.gguf_reader import warn_pre_tokenizer
            source = os.path.join(final, "gguf_source.json")
            warn_pre_tokenizer(path, json.load(open(source)).get("tokenizer_warning") if os.path.isfile(source)
                               else None)
        return final
    gguf_config(path)  # an unreadable or refused file raises here, before the message below
    if not quiet:
        print(f"[tokenfab] dequantizing {os.path.basename(path)} to {dtype} into {final} (first use only) ...",
              flush=True)
    from tokenfab.cache_paths import write_folder
    write_folder(final, lambda tmp: write_checkpoint(path, tmp, dtype), "config.json")
    return final


def resolve_model_path(model: str | None, quiet: bool = False) -> str | None:
    """``*.gguf`` -> its cached Hugging Face folder (:func:`ensure_converted`); any other value unchanged."""
    if is_gguf_path(model):
        return ensure_converted(model, quiet=quiet)
    return model
