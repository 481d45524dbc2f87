"""The Hugging Face transformers reference: build it with settings that do not change low bits, run it teacher-forced.

Settings (see docs/DESIGN "Reference settings and traps"): ``attn_implementation="eager"`` and
``experts_implementation="eager"`` (transformers 5.x defaults, SDPA and grouped_mm, change the low bits), an explicit
dtype (float32 by default) and device (cpu by default). A standalone ``model_type: kimi_k2`` config is not registered
in transformers' AutoConfig, so it is built as a :class:`transformers.DeepseekV3Config`.
"""
from __future__ import annotations

import json
import os
from typing import Sequence

import torch

from tokenfab.eval import usage_error

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


def parse_dtype(name: str, flag: str) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' | 'float64' -> torch dtype; ValueError naming ``flag`` otherwise."""
    if name not in _DTYPES:
        raise usage_error(f"{flag}: unknown dtype '{name}'; use one of {sorted(_DTYPES)}.")
    return _DTYPES[name]


def _tf_version() -> str:
    import transformers
    return transformers.__version__


class TransformersReference:
    """A transformers causal LM loaded from a checkpoint folder, for teacher-forced log-probabilities.

    Args:
        path: checkpoint folder (config.json + safetensors).
        dtype: "float32" (default), "bfloat16", "float16" or "float64".
        device: torch device string, "cpu" by default.
    """

    def __init__(self, path: str, dtype: str = "float32", device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"--reference-model: no config.json in '{path}'.")
        self.path = path
        self.dtype = parse_dtype(dtype, "--reference-dtype")
        self.device = torch.device(device)
        kw = dict(dtype=self.dtype, attn_implementation="eager", experts_implementation="eager")
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        if raw.get("model_type") == "kimi_k2":
            from transformers import DeepseekV3Config
            raw = {k: v for k, v in raw.items() if k != "model_type"}
            kw["config"] = DeepseekV3Config(**raw)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, **kw)
        except (ValueError, KeyError, OSError) as e:
            raise usage_error(f"--reference-model: transformers {_tf_version()} cannot load '{path}' as a causal LM "
                              f"with eager attention and experts ({type(e).__name__}: {e}).") from e
        self.model = model.to(self.device).eval()
        self.vocab_size = int(self.model.config.get_text_config().vocab_size)

    @torch.inference_mode()
    def logprobs(self, token_ids: Sequence[int]) -> torch.Tensor:
        """One teacher-forced forward over ``token_ids`` (length T, no padding, no cache).

        Returns: float64 [T, V] natural-log probabilities on CPU; row t is the distribution of token t+1 given
        tokens 0..t (log-softmax taken in float64 from the model's logits).
        """
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        logits = self.model(input_ids=ids, use_cache=False).logits[0]
        return torch.log_softmax(logits.to("cpu", torch.float64), dim=-1)
