"""Engine settings (vLLM's names) and the KV-pool sizing that follows from them."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from tokenfab.config import ModelConfig
from tokenfab.errors import EngineConfigError, UnsupportedError

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
DEFAULT_KV_CACHE_MEMORY = 2 << 30  # bytes; the default pool is the smaller of this and max_num_seqs x max_model_len


def parse_bytes(value: int | str, field: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '800M' or an int -> bytes. Raises ValueError naming ``field``."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)\s*", str(value), re.IGNORECASE)
    if not m:
        raise EngineConfigError(f"{field}: cannot read '{value}' as a size; use e.g. 2GiB, 512MiB, 1.5GB or a byte count.")
    num, unit, ib = float(m.group(1)), m.group(2).upper(), m.group(3).lower()
    base = 1000 if ib == "b" else 1024
    return int(num * base ** " KMGT".index(unit or " "))


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' -> bfloat16 (CPU and GPU); otherwise the named dtype. Raises ValueError for unknown names."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16
    if dtype not in _DTYPES:
        raise EngineConfigError(f"dtype '{dtype}' is not supported; use auto, float32, bfloat16 or float16.")
    return _DTYPES[dtype]


def resolve_device(device: str | None) -> torch.device:
    """'auto' -> cuda when available (CUDA or ROCm builds), else cpu."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass
class EngineConfig:
    """Settings of one engine (names as in vLLM).

    Args:
        model: checkpoint folder.
        dtype: "auto" (bfloat16), "float32", "bfloat16", "float16".
        max_model_len: longest sequence (prompt + output) in tokens; default: the model's max_position_embeddings.
        max_num_seqs: most sequences in a step.
        max_num_batched_tokens: token budget per step (prefill chunks are cut to fit).
        block_size: tokens per KV block.
        num_kv_blocks: KV pool size in blocks; or give kv_cache_memory (bytes or "2GiB").
        seed: seed of the engine RNG (requests without their own seed).
        tensor_parallel_size: number of ranks (1 = this process).
        enforce_eager: never replay decode steps from CUDA graphs (engine/cuda_graph_runner.py; CUDA/ROCm only).
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | str | None = None
    seed: int = 0
    enable_prefix_caching: bool = False
    tensor_parallel_size: int = 1
    enforce_eager: bool = False

    def check_max_model_len(self, mc: ModelConfig) -> None:
        """Raise EngineConfigError when max_model_len (tokens) is < 1 or above mc.max_position_embeddings; run
        before any weight is read and again by :meth:`finalize`."""
        if self.max_model_len is None:
            return
        if self.max_model_len < 1:
            raise EngineConfigError(f"max_model_len must be >= 1, got {self.max_model_len}.")
        if self.max_model_len > mc.max_position_embeddings:
            raise EngineConfigError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                                    f"{mc.max_position_embeddings}; lower max_model_len.")

    def finalize(self, mc: ModelConfig, dtype: torch.dtype) -> None:
        """Fill max_model_len and num_kv_blocks from the model.

        Raises:
            ValueError: max_model_len above the model's limit, or a KV pool smaller than one max_model_len
                sequence (the message says what to raise).
        """
        if self.enable_prefix_caching:
            raise UnsupportedError("enable_prefix_caching is not implemented yet; leave it False.")
        self.check_max_model_len(mc)
        if self.max_model_len is None:
            self.max_model_len = mc.max_position_embeddings
        per_token = mc.kv_cache_bytes_per_token(torch.empty((), dtype=dtype).element_size())
        bs = self.block_size
        if self.num_kv_blocks is None:
            if self.kv_cache_memory is not None:
                mem = parse_bytes(self.kv_cache_memory, "kv_cache_memory")
                self.num_kv_blocks = mem // (per_token * bs)
            else:
                want = self.max_num_seqs * self.max_model_len
                cap = DEFAULT_KV_CACHE_MEMORY // per_token
                self.num_kv_blocks = (min(want, cap) + bs - 1) // bs
        need = (self.max_model_len + bs - 1) // bs
        if self.num_kv_blocks < need:
            raise EngineConfigError(f"the KV pool ({self.num_kv_blocks} blocks of {bs} tokens) cannot hold one "
                             f"max_model_len ({self.max_model_len}) sequence: raise num_kv_blocks / kv_cache_memory "
                             f"to at least {need} blocks ({need * bs * per_token} bytes) or lower max_model_len.")
