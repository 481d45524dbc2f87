"""Build a model for a checkpoint folder and load its weights: config -> model class -> safetensors -> device."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from tokenfab.config import ModelConfig, load_config
from tokenfab.errors import WeightLoadError
from tokenfab.loader.gguf_packed import is_gguf, iterate_gguf_weights, load_gguf_tokenizer, packed_expert_stacks
from tokenfab.loader.safetensors_loader import iterate_weights
from tokenfab.models.registry import get_model_class

logger = logging.getLogger("tokenfab")


@dataclass
class LoadedModel:
    """What :func:`load_model` returns: the model on its device and dtype with weights loaded, its parsed config, the
    tokenizer (None where the folder has none), the checkpoint tensors deliberately not loaded, and under tensor
    parallel the launcher's group handle."""
    model: torch.nn.Module
    model_config: ModelConfig
    tokenizer: object | None
    device: torch.device
    dtype: torch.dtype
    skipped_weights: list[str]
    tp_group: object | None = None  # tensor parallel: the launcher's handle (tokenfab.parallel.launcher.TPGroup)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """transformers AutoTokenizer from a local folder, or None when the folder has no tokenizer files.

    A folder with ``tiktoken.model`` and no ``tokenizer.json`` (Kimi-K2 / Kimi Linear as published) gets
    tokenfab's :class:`~tokenfab.tokenizers.tiktoken_tokenizer.TiktokenTokenizer`: the checkpoint's own tokenizer
    code (``auto_map``, ``trust_remote_code``) is never run. A folder with a ``tokenizer.json`` whose model_type
    transformers does not register (``kimi_k2`` and the other Kimi families), or whose tokenizer_config.json maps
    to the checkpoint's own code, loads that file as a fast tokenizer without transformers' AutoConfig
    (tokenfab/tokenizers/hf_folder.py), unless ``trust_remote_code``."""
    from tokenfab.tokenizers.hf_folder import load_tokenizer_json, reads_tokenizer_json_directly
    from tokenfab.tokenizers.tiktoken_tokenizer import TiktokenTokenizer, is_tiktoken_folder
    if is_tiktoken_folder(path):
        return TiktokenTokenizer.from_pretrained(path)
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                                "tokenizer.model")):
        return None
    if reads_tokenizer_json_directly(path, trust_remote_code):
        return load_tokenizer_json(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_model(config, progress: bool = True, tp=None, device: torch.device | None = None) -> LoadedModel:
    """Parse config.json, build the model in the engine dtype and fill it from the checkpoint.

    ``tp`` (a :class:`tokenfab.parallel.distributed.TPContext`): build this rank's shard and read only its slices;
    ``device`` overrides ``config.device`` (one device per rank). ``config.model`` may be a llama ``.gguf`` file:
    its quantized linears are kept packed (tokenfab.loader.gguf_packed), its tokenizer read from the file unless
    ``config.tokenizer`` names one.

    ``config.load_format``: ``"auto"`` (default) reads the checkpoint's weight files; ``"dummy"`` reads only
    config.json (and the tokenizer) and fills every parameter on the device with seeded random values
    (``config.seed``; tokenfab/loader/dummy_weights.py), so a folder without any ``*.safetensors`` loads.

    Raises:
        FileNotFoundError / ConfigError / WeightLoadError: see tokenfab.config and models.base.
        UnsupportedError: ``load_format="dummy"`` for a GGUF file, or with host experts for a packed format.
    """
    from tokenfab.engine.engine_config import resolve_device, resolve_dtype

    gguf_file = is_gguf(config.model)
    if gguf_file and tp is not None:
        raise ValueError("tensor_parallel_size > 1 is not supported for GGUF files yet; use tensor_parallel_size=1.")
    if not gguf_file and not os.path.isdir(config.model):
        raise FileNotFoundError(f"model folder '{config.model}' does not exist (pass a Hugging Face checkpoint "
                                "folder with config.json and *.safetensors).")
    mc = load_config(config.model)
    device = device if device is not None else resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, bool(getattr(config, "batch_invariant", False)))
    max_len = config.max_model_len or mc.max_position_embeddings
    cls = get_model_class(mc)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    from tokenfab.layers.moe import deferred_expert_storage  # experts packed or allocated by load_weights
    try:
        if tp is None:
            with deferred_expert_storage():
                model = cls(mc, max_positions=max_len + 1).requires_grad_(False)
        else:
            from tokenfab.parallel.distributed import building_with
            with building_with(tp), deferred_expert_storage():
                model = cls(mc, max_positions=max_len + 1).requires_grad_(False)
    finally:
        torch.set_default_dtype(prev)
    host_split = (getattr(config, "host_experts", None) is not None
                  or getattr(config, "num_device_experts", None) is not None)
    if host_split:
        model.unpacked_experts = True  # the host/device expert split moves bf16 stacks (models/base.py)
    if getattr(config, "load_format", "auto") == "dummy":  # no weight file read (loader/dummy_weights.py)
        from tokenfab.loader.dummy_packed import build_dummy_packed
        from tokenfab.loader.dummy_weights import fill_dummy_weights, refuse_packed
        refuse_packed(model, mc, gguf_file, host_split)
        seed = getattr(config, "seed", 0)
        build_dummy_packed(model, mc, device, seed)  # FP8 Linears, packed expert stacks (as the checkpoint keeps)
        # filled where they will run; with host experts on the host first, then split below as loaded weights are
        fill_dummy_weights(model, torch.device("cpu") if host_split else device, seed=seed)
        skipped = []
    elif gguf_file:  # quantized linears and expert stacks stay packed (tokenfab.quant.gguf_weight, gguf_experts)
        model.gguf_expert_stacks = packed_expert_stacks(config.model)
        skipped = model.load_weights(iterate_gguf_weights(config.model, progress=progress))
    elif tp is None:
        try:
            weights = iterate_weights(config.model, progress=progress)
            if mc.fp8_block_size is not None:  # weight + weight_scale_inv pairs kept packed (quant.fp8_block_weight)
                from tokenfab.loader.fp8_block_loader import Fp8CheckpointWeights
                weights = Fp8CheckpointWeights(weights)
            skipped = model.load_weights(weights)
        except WeightLoadError as e:  # name the folder when the message names only files inside it
            msg = str(e)
            raise (e if msg.startswith(config.model) else WeightLoadError(f"{config.model}: {msg}")) from None
    else:
        from tokenfab.parallel.sharded_loading import iterate_rank_weights
        weights = iterate_rank_weights(config.model, tp.plan, tp.rank)
        if mc.fp8_block_size is not None:  # this rank's FP8 rows / columns, padded where they start inside a block
            from tokenfab.loader.fp8_block_loader import Fp8CheckpointWeights
            weights = Fp8CheckpointWeights(weights, plan=tp.plan, rank=tp.rank)
        skipped = model.load_weights(weights)
    if skipped:
        logger.info("skipped %d checkpoint tensors not used by tokenfab yet (e.g. MTP layers): %s%s",
                    len(skipped), ", ".join(skipped[:5]), " ..." if len(skipped) > 5 else "")
    placement = None
    if host_split:
        from tokenfab.layers import host_experts  # part of the routed experts kept in host memory
        from tokenfab.planner.expert_placement import placement_for_engine
        placement = placement_for_engine(config, mc, 1 if tp is None else tp.world_size)
        host_experts.install(model, placement, config.host_expert_threads, device)
    model.to(device).eval()
    model.post_load()
    if placement is not None:
        host_experts.finalize(model)
    if gguf_file and not config.tokenizer:
        tokenizer = load_gguf_tokenizer(config.model)
    else:
        tokenizer = (load_tokenizer(config.tokenizer or config.model, getattr(config, "trust_remote_code", False))
                     if tp is None or tp.rank == 0 else None)
    return LoadedModel(model, mc, tokenizer, device, dtype, skipped)
