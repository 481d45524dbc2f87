"""A checkpoint folder's ``tokenizer.json`` read without transformers' AutoConfig where AutoConfig cannot help.

``AutoTokenizer.from_pretrained`` builds the folder's model config first. For a ``model_type`` transformers does
not register (``kimi_k2``, ``kimi_linear``, ``kimi_k3``: their published config.json points at the checkpoint's own
Python code through ``auto_map``) it falls back to a generic ``PreTrainedConfig``, which fails on the published
rope settings (``'PreTrainedConfig' object has no attribute 'max_position_embeddings'``) or asks for
``trust_remote_code``. The tokenizer itself does not depend on the model config: a folder with a ``tokenizer.json``
loads it (and tokenizer_config.json's special tokens, chat template and max length) as a fast tokenizer, and no
checkpoint code runs.
"""
from __future__ import annotations

import json
import os

TOKENIZER_JSON = "tokenizer.json"


def _json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def reads_tokenizer_json_directly(path: str, trust_remote_code: bool = False) -> bool:
    """True when the folder ``path`` has a ``tokenizer.json`` that should be read without AutoTokenizer: remote code
    is not trusted and either its config.json's ``model_type`` is not one transformers registers (AutoConfig would
    fail or ask for remote code) or tokenizer_config.json maps AutoTokenizer to the checkpoint's own code
    (``auto_map``)."""
    if trust_remote_code or not os.path.isfile(os.path.join(path, TOKENIZER_JSON)):
        return False
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    model_type = _json(os.path.join(path, "config.json")).get("model_type")
    if isinstance(model_type, str) and model_type and model_type not in CONFIG_MAPPING:
        return True
    auto_map = _json(os.path.join(path, "tokenizer_config.json")).get("auto_map")
    return bool(auto_map.get("AutoTokenizer")) if isinstance(auto_map, dict) else bool(auto_map)


def load_tokenizer_json(path: str, **kwargs):
    """The folder's ``tokenizer.json`` as a transformers fast tokenizer (``PreTrainedTokenizerFast``), with the
    special tokens, chat template and ``model_max_length`` of its tokenizer_config.json; ``kwargs`` go to
    ``from_pretrained`` (``local_files_only``, ...). Never runs checkpoint code."""
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(path, **kwargs)
