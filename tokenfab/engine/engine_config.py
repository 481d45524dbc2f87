"""Engine settings (vLLM's names) and the KV-pool sizing that follows from them."""
from __future__ import annotations

import difflib
import json
import logging
import os
import re
from dataclasses import dataclass, fields

import torch

from tokenfab.config import ModelConfig
from tokenfab.engine.scheduling_policy import SCHEDULING_POLICIES
from tokenfab.errors import EngineConfigError, UnsupportedError
from tokenfab.kernels.cpu import isa as cpu_isa

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
DEFAULT_KV_CACHE_MEMORY = 2 << 30  # bytes; the default pool is the smaller of this and max_num_seqs x max_model_len
DEFAULT_MAX_LOGPROBS = 20  # vLLM's default cap on logprobs / prompt_logprobs per request

# quantization= values tokenfab runs, as config.json's quantization_config.quant_method names them.
SUPPORTED_QUANTIZATION = {
    "compressed-tensors": "routed experts kept packed: MXFP4 (format mxfp4-pack-quantized, Kimi K3) and INT4 "
                          "group-32 (format pack-quantized, Kimi K2-Thinking / DeepSeek-V3 layout)",
    "fp8": "FP8 block-scaled weights (DeepSeek-V3 / Kimi-K2 as published, weight_block_size [128, 128]), kept packed "
           "(routed experts included; MLA kv_b_proj dequantized to the engine dtype at load, and the routed experts "
           "too when host experts are requested)",
    "gguf": "a .gguf file: llama / qwen2 / qwen3 / qwen3moe with F16 / BF16 / Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / "
            "Q6_K tensors kept packed, routed experts included (loader/gguf_packed.py); deepseek2 (DeepSeek-V3, "
            "Kimi-K2) files and those holding other tensor types dequantized once to a cached bf16 folder "
            "(loader/gguf_to_hf.py)",
}
# generation_config.json keys that become default SamplingParams fields (vLLM's list; max_new_tokens -> max_tokens).
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}

logger = logging.getLogger("tokenfab")

# vLLM's opt-in to a max_model_len above the model's max_position_embeddings, and tokenfab's own name for it
ALLOW_LONG_ENV = ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "TOKENFAB_ALLOW_LONG_MAX_MODEL_LEN")


def allow_long_max_model_len() -> bool:
    """True when either variable of ``ALLOW_LONG_ENV`` is "1" or "true" (any case): max_model_len may then exceed
    the model's max_position_embeddings (RoPE tables are sized by max_model_len; the model was not trained there)."""
    return any(os.environ.get(n, "").strip().lower() in ("1", "true") for n in ALLOW_LONG_ENV)


class UnknownArgumentError(EngineConfigError, TypeError):
    """An engine keyword argument tokenfab does not know (both a ValueError and a TypeError, so code catching
    either sees it); the message names it and the nearest supported name."""


def check_argument_names(given, supported, where: str = "LLM()") -> None:
    """Raise UnknownArgumentError for the first name in ``given`` that is not in ``supported``, naming the
    nearest supported one (difflib.get_close_matches) or listing them all."""
    supported = sorted(supported)
    for name in given:
        if name in supported:
            continue
        near = difflib.get_close_matches(name, supported, n=1, cutoff=0.5)
        hint = f"did you mean '{near[0]}'?" if near else f"supported: {', '.join(supported)}."
        raise UnknownArgumentError(f"{where} got an unknown argument '{name}'; {hint}")


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


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str, batch_invariant: bool = False) -> torch.dtype:
    """'auto' -> bfloat16, except float32 on a CPU at the ``avx2`` ISA level (kernels/cpu/isa.py: no AVX512-BF16 dot
    products; PyTorch's bf16 GEMMs there take 3x / 7x float32's time at 16 / 256 rows and bf16 batched GEMMs far
    more, NOTES 77 and 80) unless ``batch_invariant`` (its kernels are bf16); otherwise the named dtype.

    Raises:
        EngineConfigError: an unknown name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if torch.device(device).type == "cpu" and not batch_invariant and cpu_isa.selected_level() == "avx2":
            return torch.float32
        return torch.bfloat16
    if dtype not in _DTYPES:
        raise EngineConfigError(f"dtype '{dtype}' is not supported; use auto, float32, bfloat16 or float16.")
    return _DTYPES[dtype]


def resolve_kv_cache_dtype(kv_cache_dtype: str | torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype: 'auto' -> the activation ``dtype`` (vLLM's meaning); otherwise the named dtype
    (float32, bfloat16 / bf16, float16 / fp16 / half).

    A pool narrower than the activations halves the bytes decode attention reads per context token (float32
    activations with a bf16 pool: 2 bytes a value instead of 4). Keys and values are rounded to it when written
    (PyTorch's round-to-nearest-even cast) and widened exactly when read.

    Raises:
        EngineConfigError: an unknown name, or fp8 (the planner sizes fp8 pools, ``tokenfab plan --kv-cache-dtype
            fp8``; the engine does not store them yet).
    """
    if isinstance(kv_cache_dtype, torch.dtype):
        return kv_cache_dtype
    if kv_cache_dtype == "auto":
        return dtype
    if str(kv_cache_dtype).startswith("fp8"):
        raise EngineConfigError(f"kv_cache_dtype '{kv_cache_dtype}' is not supported by the engine yet (only "
                                "`tokenfab plan --kv-cache-dtype fp8` sizes such a pool); use auto, bfloat16, "
                                "float16 or float32.")
    if kv_cache_dtype not in _DTYPES:
        raise EngineConfigError(f"kv_cache_dtype '{kv_cache_dtype}' is not supported; use auto, bfloat16, float16 "
                                "or float32.")
    return _DTYPES[kv_cache_dtype]


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
        dtype: "auto" (bfloat16; float32 on a CPU without AVX512-BF16, :func:`resolve_dtype`), "float32",
            "bfloat16", "float16".
        max_model_len: longest sequence (prompt + output) in tokens; default: the model's max_position_embeddings.
        max_num_seqs: most sequences in a step.
        max_num_batched_tokens: token budget per step (prefill chunks are cut to fit).
        block_size: tokens per KV block.
        num_kv_blocks: KV pool size in blocks; or give kv_cache_memory (bytes or "2GiB").
        seed: seed of the engine RNG (requests without their own seed).
        tensor_parallel_size: number of ranks (1 = this process).
        enforce_eager: never replay decode steps from CUDA graphs (engine/cuda_graph_runner.py; CUDA/ROCm only).
        async_scheduling: schedule and launch each step before the previous step's ids reach the host
            (engine/async_scheduling.py; vLLM's flag). None (default): ``TOKENFAB_ASYNC_SCHEDULING`` decides, which
            by default turns it on for CUDA / ROCm engines; True with speculative decoding or tensor parallel is
            refused when the engine is built (UnsupportedError).
        load_format: "auto" (default: read the checkpoint's weight files) or "dummy" (vLLM's name: read only
            config.json and the tokenizer, and fill every weight on the device with random values seeded by
            ``seed`` at the config's real shapes: tokenfab/loader/dummy_weights.py; for measuring shapes without
            checkpoint files; packed formats are refused when loading).
        kv_cache_dtype: the KV pool's dtype: "auto" (default: the activation dtype), "bfloat16", "float16" or
            "float32" (:func:`resolve_kv_cache_dtype`). Another dtype than the activations' runs on CPU only (the
            decode attention kernel widens the pool's rows as it reads them); refused on CUDA / ROCm.
        tokenizer: tokenizer folder (default: the model folder).
        trust_remote_code: let transformers run a tokenizer's own code (e.g. Kimi's tiktoken tokenizer); tokenfab
            never runs a checkpoint's modeling code.
        gpu_memory_utilization: share (0, 1] of the device's memory for weights + KV pool; on CPU the share of
            host memory (the smaller of physical memory and the cgroup limit). The KV pool gets that share minus
            the loaded weights (see :meth:`finalize`). None: the default pool below. num_kv_blocks and
            kv_cache_memory take precedence.
        enable_prefix_caching: share the KV blocks of common prompt prefixes between requests (engine/prefix_cache.py;
            hybrid KDA models restore state snapshots, engine/state_snapshots.py). Default False.
        quantization: None or "auto" (the checkpoint's own format); a method name must match config.json's
            quantization_config.quant_method and be one tokenfab runs (SUPPORTED_QUANTIZATION).
        generation_config: "auto" (default sampling fields from the model folder's generation_config.json),
            "vllm" (ignore that file) or a folder holding a generation_config.json; see
            :meth:`generation_defaults`.
        max_logprobs: most logprobs / prompt_logprobs a request may ask for (vLLM's default 20; -1: no limit).
        speculative_config: None, or vLLM's dict (or its JSON text), e.g. {"method": "ngram",
            "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1} or {"method":
            "draft_model", "model": PATH, "num_speculative_tokens": 3}; normalized to a
            :class:`~tokenfab.spec_decode.config.SpeculativeConfig` (tokenfab/spec_decode/config.py).
        scheduling_policy: "fcfs" (default), "fair" (decodes first, the rest of each step's budget shared by a few
            prefills) or "priority" (requests' ``priority``, lower first, then arrival); see
            tokenfab/engine/scheduling_policy.py.
        host_experts: keep part of each MoE layer's routed experts in host memory and compute them on the host's
            CPUs (tokenfab/layers/host_experts.py): a share ("50%") or a count of experts per MoE layer; None: all
            on the device. num_device_experts: instead, how many experts per MoE layer stay on the devices.
        expert_popularity: a JSON file of routed-token counts per layer per expert (written by
            record_expert_popularity): the most used experts stay on the devices (tokenfab/planner/expert_placement.py).
        host_expert_threads: intra-op threads of the host-expert worker (default: every core beside a GPU, half
            of this process's threads on CPU).
        record_expert_popularity: a path where the engine writes those counts when it shuts down
            (tokenfab/engine/expert_popularity.py).
        batch_invariant: run every kernel in an order that does not depend on the batch (as vLLM's batch-invariant
            mode): a request's tokens and logprobs are then bit-identical alone, beside any other requests and
            under any ``max_num_batched_tokens`` (docs/batch_invariance.md). CPU, bfloat16, models the fused
            decode stack covers; every token runs as a one-query row over its own context. Costs prefill speed
            (benchmarks/results/2026-12-01-batch-invariant.md). See :meth:`check_batch_invariant` for what is
            refused.

    Raises:
        EngineConfigError / UnsupportedError (ValueError): a setting out of range or not supported, naming it;
        checked when the config is made, before any weight is read.
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
    kv_cache_dtype: str = "auto"
    seed: int = 0
    enable_prefix_caching: bool = False
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    async_scheduling: bool | None = None
    trust_remote_code: bool = False
    gpu_memory_utilization: float | None = None
    quantization: str | None = None
    generation_config: str = "auto"
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    speculative_config: dict | str | None = None
    scheduling_policy: str = "fcfs"
    host_experts: str | int | None = None
    num_device_experts: int | None = None
    expert_popularity: str | None = None
    host_expert_threads: int | None = None
    record_expert_popularity: str | None = None
    batch_invariant: bool = False
    load_format: str = "auto"

    @classmethod
    def from_kwargs(cls, model: str, where: str = "LLM()", **kwargs) -> "EngineConfig":
        """EngineConfig(model, **kwargs) whose unknown keywords raise UnknownArgumentError naming the nearest
        supported one, instead of the dataclass's bare TypeError."""
        check_argument_names(kwargs, {f.name for f in fields(cls)} - {"model"}, where)
        return cls(model=model, **kwargs)

    def __post_init__(self) -> None:
        from tokenfab.loader.dummy_weights import check_load_format
        check_load_format(self.load_format)
        if not isinstance(self.enable_prefix_caching, bool):
            raise EngineConfigError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}.")
        u = self.gpu_memory_utilization
        if u is not None and not (isinstance(u, (int, float)) and 0 < u <= 1):
            raise EngineConfigError(f"gpu_memory_utilization must be in (0, 1] (a share of device memory; on CPU "
                                    f"of host memory), got {u!r}.")
        if u is not None and self.tensor_parallel_size != 1:
            raise UnsupportedError("gpu_memory_utilization with tensor_parallel_size > 1 is not supported yet (each "
                                   "rank sizes its own pool and they must agree); size the pool with "
                                   "kv_cache_memory or num_kv_blocks instead.")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise EngineConfigError(f"max_logprobs must be an integer >= 0 (or -1 for no limit), got "
                                    f"{self.max_logprobs!r}.")
        self.check_host_experts()
        from tokenfab.spec_decode.config import parse_speculative_config
        self.speculative_config = parse_speculative_config(self.speculative_config)  # strict: names a bad field
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise EngineConfigError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                                    f"{self.scheduling_policy!r}.")
        self.check_quantization()
        self.check_kv_cache_dtype()
        self.generation_defaults()  # a missing folder or a bad value fails now, not at the first request
        self.check_batch_invariant()

    def check_kv_cache_dtype(self) -> None:
        """Refuse, before any weight is read, a KV pool dtype the engine cannot run here.

        Raises:
            EngineConfigError: an unknown name or fp8 (:func:`resolve_kv_cache_dtype`).
            UnsupportedError: a pool dtype other than the activations' on CUDA / ROCm (the GPU kernels read pools
                of the activation dtype), or with ``batch_invariant`` (its kernels read bf16 pools).
        """
        if self.kv_cache_dtype == "auto":
            return
        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device, self.batch_invariant)
        kv = resolve_kv_cache_dtype(self.kv_cache_dtype, dtype)
        if kv == dtype:
            return
        if device.type != "cpu":
            raise UnsupportedError(f"kv_cache_dtype={self.kv_cache_dtype!r} with {dtype} activations runs on CPU "
                                   f"only (the GPU kernels read a pool of the activation dtype); use "
                                   f"kv_cache_dtype='auto' on {device.type}.")
        if self.batch_invariant:
            raise UnsupportedError(f"batch_invariant=True reads a bfloat16 KV pool; got kv_cache_dtype="
                                   f"{self.kv_cache_dtype!r}: use 'auto' or leave batch_invariant off.")

    def check_batch_invariant(self) -> None:
        """With ``batch_invariant=True``, refuse (by name, before any weight is read) what the mode does not cover.

        Raises:
            EngineConfigError: batch_invariant is not a bool.
            UnsupportedError: a dtype other than bfloat16, a CUDA/ROCm device, tensor_parallel_size > 1 or a
                speculative_config. The model itself is checked after loading (ModelRunner).
        """
        if not isinstance(self.batch_invariant, bool):
            raise EngineConfigError(f"batch_invariant must be True or False, got {self.batch_invariant!r}.")
        if not self.batch_invariant:
            return
        if self.dtype not in ("auto", "bfloat16", "bf16", torch.bfloat16):
            raise UnsupportedError(f"batch_invariant=True runs bfloat16 only (its kernels are tokenfab's bf16 CPU "
                                   f"kernels); got dtype={self.dtype!r}: use dtype='bfloat16' (or 'auto'), or "
                                   "leave batch_invariant off.")
        if resolve_device(self.device).type != "cpu":
            raise UnsupportedError("batch_invariant=True is implemented on CPU only: on CUDA/ROCm the Triton decode "
                                   "attention splits each context over programs by its length and merges the "
                                   "splits (flash-decoding), the routed experts' grouped GEMM tiles depend on "
                                   "how many tokens each expert gets, and cuBLAS picks GEMM kernels (and "
                                   "split-K) by batch size; use device='cpu' or leave batch_invariant off "
                                   "(docs/batch_invariance.md says what a GPU version needs).")
        if self.tensor_parallel_size != 1:
            raise UnsupportedError("batch_invariant=True with tensor_parallel_size > 1 is not supported (the ranks' "
                                   "partial sums are all-reduced in an order the mode does not fix); use "
                                   "tensor_parallel_size=1.")
        if self.speculative_config is not None:
            raise UnsupportedError("batch_invariant=True with speculative_config is not supported yet; leave one "
                                   "of them off.")

    def check_host_experts(self) -> None:
        """Check the host-expert settings (host_experts, num_device_experts, expert_popularity,
        host_expert_threads, record_expert_popularity) before any weight is read.

        Raises:
            EngineConfigError: a bad value, both host_experts and num_device_experts, a popularity file without
                either, an unreadable file or a missing folder; the message names the field.
        """
        from tokenfab.planner.expert_placement import PlacementError, load_popularity, parse_host_experts
        try:
            if self.host_experts is not None:
                parse_host_experts(self.host_experts, "host_experts (--host-experts)")
            nd = self.num_device_experts
            if nd is not None and (isinstance(nd, bool) or not isinstance(nd, int) or nd < 0):
                raise PlacementError(f"num_device_experts (--num-device-experts) must be an integer >= 0, got {nd!r}")
            if self.host_experts is not None and nd is not None:
                raise PlacementError("host_experts (--host-experts) and num_device_experts (--num-device-experts) "
                                     "both say how many experts go to the host; give one of them")
            if self.expert_popularity is not None:
                if self.host_experts is None and nd is None:
                    raise PlacementError("expert_popularity (--expert-popularity) chooses which experts stay on the "
                                         "device; also give host_experts (--host-experts) or num_device_experts "
                                         "(--num-device-experts)")
                load_popularity(self.expert_popularity, None, "expert_popularity (--expert-popularity)")
            t = self.host_expert_threads
            if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
                raise PlacementError(f"host_expert_threads (--host-expert-threads) must be an integer >= 1, got {t!r}")
            r = self.record_expert_popularity
            if r is not None:
                folder = os.path.dirname(os.path.abspath(str(r)))
                if not os.path.isdir(folder):
                    raise PlacementError(f"record_expert_popularity (--record-expert-popularity): folder '{folder}' "
                                         "does not exist")
        except PlacementError as e:
            raise EngineConfigError(str(e)) from None

    def check_quantization(self) -> None:
        """Accept quantization None / "auto" / "none"; a method name only when tokenfab runs it and the
        checkpoint's config.json declares the same quant_method.

        Raises:
            UnsupportedError: a method tokenfab does not run (on-the-fly quantization included).
            EngineConfigError: a supported method that does not match the checkpoint.
        """
        q = self.quantization
        if q is None or str(q).lower() in ("auto", "none"):
            self.quantization = None
            return
        q = str(q).lower()
        ckpt = checkpoint_quant_method(self.model)
        if q not in SUPPORTED_QUANTIZATION:
            runs = "; ".join(f"'{k}' ({v})" for k, v in SUPPORTED_QUANTIZATION.items())
            raise UnsupportedError(f"quantization='{q}' is not supported by tokenfab (it runs the checkpoint's own "
                                   f"weights and does not quantize on the fly); leave quantization unset or 'auto'"
                                   f" (this checkpoint: {ckpt or 'not quantized'}). Supported methods: {runs}.")
        if ckpt != q:
            raise EngineConfigError(f"quantization='{q}' does not match the checkpoint: its config.json "
                                    + (f"declares quant_method '{ckpt}'" if ckpt else "has no quantization_config")
                                    + "; leave quantization unset or 'auto'.")
        self.quantization = q

    def generation_defaults(self) -> dict:
        """Default SamplingParams fields from ``generation_config`` (vLLM's semantics): "auto" reads the model
        folder's generation_config.json, a folder path reads that folder's, "vllm" gives {}.

        Keys kept: temperature, top_p, top_k, min_p, repetition_penalty (the last two only when SamplingParams
        has them) and max_new_tokens as ``max_tokens``. A missing file gives {}.

        Raises:
            EngineConfigError: generation_config is neither "auto", "vllm" nor an existing folder, or the file
                is unreadable or holds a value SamplingParams refuses (the message names the file and field).
        """
        g = self.generation_config
        if g is None or g == "vllm":
            return {}
        if g == "auto":
            folder = self.model
        elif os.path.isdir(str(g)):
            folder = str(g)
        else:
            raise EngineConfigError(f"generation_config must be 'auto', 'vllm' or a folder holding a "
                                    f"generation_config.json; '{g}' is not a folder.")
        path = os.path.join(folder, "generation_config.json")
        if not os.path.isfile(path):
            return {}
        from tokenfab.config import read_json_file
        try:
            raw = read_json_file(path)
        except OSError as e:
            raise EngineConfigError(f"generation_config: cannot read {path}: {e}") from None
        except ValueError as e:  # not valid JSON: the file, line and column
            raise EngineConfigError(f"generation_config: {e}") from None
        from tokenfab.sampling_params import SamplingParams
        known = {f.name for f in fields(SamplingParams)}
        out = {dst: raw[src] for src, dst in GENERATION_CONFIG_FIELDS.items()
               if raw.get(src) is not None and dst in known}
        try:
            SamplingParams(**out)
        except (TypeError, ValueError) as e:
            raise EngineConfigError(f"generation_config: {path} gives default sampling settings {out} that "
                                    f"SamplingParams refuses: {e} (use generation_config='vllm' to ignore the "
                                    "file).") from None
        return out

    def check_logprobs(self, params) -> None:
        """Raise ValueError when ``params`` (SamplingParams) asks for more logprobs or prompt_logprobs than
        max_logprobs (-1: no limit)."""
        cap = self.max_logprobs
        if cap < 0:
            return
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name, None)
            if k is not None and k > cap:
                raise ValueError(f"{name}={k} is more than max_logprobs ({cap}); ask for at most {cap} or raise "
                                 f"max_logprobs (LLM(max_logprobs=...), tokenfab serve --max-logprobs).")

    def check_max_model_len(self, mc: ModelConfig) -> None:
        """Raise EngineConfigError when max_model_len (tokens) is < 1 or above mc.max_position_embeddings; run
        before any weight is read and again by :meth:`finalize`."""
        if self.max_model_len is None:
            return
        if self.max_model_len < 1:
            raise EngineConfigError(f"max_model_len must be >= 1, got {self.max_model_len}.")
        if self.max_model_len > mc.max_position_embeddings:
            if allow_long_max_model_len():
                logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d (allowed by %s=1): "
                               "positions past it are outside what the model was trained on.", self.max_model_len,
                               mc.max_position_embeddings, " / ".join(ALLOW_LONG_ENV))
                return
            raise EngineConfigError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                                    f"{mc.max_position_embeddings}; lower max_model_len (or set "
                                    f"{ALLOW_LONG_ENV[1]}=1 to run past it anyway, e.g. for a benchmark).")

    def finalize(self, mc: ModelConfig, dtype: torch.dtype, model: torch.nn.Module | None = None) -> None:
        """Fill max_model_len and num_kv_blocks from the model.

        Pool size, first that applies: num_kv_blocks; kv_cache_memory bytes; gpu_memory_utilization (with the
        loaded ``model``: :func:`kv_bytes_for_memory_share` bytes); else the smaller of DEFAULT_KV_CACHE_MEMORY and
        max_num_seqs x max_model_len tokens. Bytes become blocks as bytes // (kv bytes per token x block_size).

        Raises:
            ValueError: max_model_len above the model's limit, a memory share smaller than the weights, or a KV
                pool smaller than one max_model_len sequence (the message says what to raise).
        """
        self.check_max_model_len(mc)
        if self.max_model_len is None:
            self.max_model_len = mc.max_position_embeddings
        kv_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, dtype)
        per_token = mc.kv_cache_bytes_per_token(torch.empty((), dtype=kv_dtype).element_size())
        bs = self.block_size
        if self.num_kv_blocks is None:
            if self.kv_cache_memory is not None:
                mem = parse_bytes(self.kv_cache_memory, "kv_cache_memory")
                self.num_kv_blocks = mem // (per_token * bs)
            elif self.gpu_memory_utilization is not None and model is not None:
                device = next((t.device for t in model.parameters()), torch.device("cpu"))
                mem = kv_bytes_for_memory_share(self.gpu_memory_utilization, device, model)
                self.num_kv_blocks = mem // (per_token * bs)
            else:
                want = self.max_num_seqs * self.max_model_len
                cap = DEFAULT_KV_CACHE_MEMORY // per_token
                self.num_kv_blocks = (min(want, cap) + bs - 1) // bs
        need = (self.max_model_len + bs - 1) // bs
        if self.num_kv_blocks < need:
            knob = ("gpu_memory_utilization" if self.num_kv_blocks is not None and self.kv_cache_memory is None
                    and self.gpu_memory_utilization is not None else "num_kv_blocks / kv_cache_memory")
            raise EngineConfigError(f"the KV pool ({self.num_kv_blocks} blocks of {bs} tokens) cannot hold one "
                             f"max_model_len ({self.max_model_len}) sequence: raise {knob} "
                             f"to at least {need} blocks ({need * bs * per_token} bytes) or lower max_model_len.")


def checkpoint_quant_method(model_dir: str) -> str | None:
    """config.json's quantization_config.quant_method (lower case; also under text_config); "gguf" for a folder
    converted from a .gguf file (it holds gguf_source.json); None when the folder has no config.json or declares
    no quantization."""
    path = os.path.join(str(model_dir), "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    qc = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config") or {}
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if not method and os.path.isfile(os.path.join(str(model_dir), "gguf_source.json")):
        return "gguf"
    return str(method).lower() if method else None


def host_memory_bytes() -> int:
    """Memory this process may use on the host (bytes): the smaller of physical memory
    (``sysconf(SC_PHYS_PAGES) x SC_PAGE_SIZE``) and the cgroup v2 / v1 memory limit when one is set."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit():
            total = min(total, int(raw))
    return total


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of ``device`` in bytes: the GPU's (torch.cuda.mem_get_info) or, on CPU, host_memory_bytes()."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return host_memory_bytes()


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a loaded model holds: parameters and the packed copies kept as plain tensor
    attributes (engine/hugepages.py's module_tensors), each storage counted once; buffers (RoPE tables) are not
    weights and are left out, except the compressed bytes a PackedWeight or a PackedExperts stack holds as buffers
    (GGUF tiles, FP8 bytes and scales, packed routed experts)."""
    from tokenfab.engine.hugepages import module_tensors
    from tokenfab.quant.packed_experts import PackedExperts
    from tokenfab.quant.packed_weight import PackedWeight
    packed = {id(b) for m in model.modules() if isinstance(m, (PackedWeight, PackedExperts)) for b in m.buffers()}
    buffers = {id(b) for b in model.buffers()} - packed
    seen: dict[tuple, int] = {}
    for t in module_tensors(model):
        if id(t) in buffers:
            continue
        s = t.untyped_storage()
        seen[(t.device.type, t.device.index, s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def kv_bytes_for_memory_share(share: float, device: torch.device, model: torch.nn.Module) -> int:
    """KV-pool bytes for ``gpu_memory_utilization = share``: floor(share x total) - weights.

    total: :func:`device_memory_bytes` of ``device`` (host memory on CPU); weights: :func:`model_weight_bytes`
    of the loaded model. Activations and the Python process are not counted.

    Raises:
        EngineConfigError: the share does not even hold the weights (the message gives the numbers).
    """
    total = device_memory_bytes(device)
    weights = model_weight_bytes(model)
    budget = int(share * total)
    if budget <= weights:
        where = "host memory" if device.type == "cpu" else f"{device} memory"
        raise EngineConfigError(f"gpu_memory_utilization={share} gives {budget / 2**30:.3f} GiB of "
                                f"{total / 2**30:.2f} GiB {where}, not more than the weights "
                                f"({weights / 2**30:.3f} GiB): raise gpu_memory_utilization above "
                                f"{weights / total:.4f}, or size the pool with kv_cache_memory.")
    return budget - weights
