"""Device memory planner: weights per rank under the :class:`~tokenfab.parallel.ShardPlan`, KV bytes per token,
the activation reserve, and the largest KV pool (in tokens) that fits.

Per rank ``r`` on a device of ``M`` bytes with reserve ``R``::

    free_for_kv[r]   = M - R - weight_bytes[r] - S x state_bytes[r]  (bytes)
    max_kv_tokens    = min over ranks of floor(free_for_kv[r] / kv_bytes_per_token[r])
    kv_bytes_per_token[r] = (kv_lora_rank + qk_rope_head_dim) x layers x kv_dtype_bytes        (MLA)
                          = 2 x kv_heads_on_rank x head_dim x layers x kv_dtype_bytes          (MHA / GQA)

Hybrid models (Kimi Linear / K3) also keep a per-request KDA state (conv + fp32 recurrent state, split with the
KDA heads): ``state_bytes[r]`` per request, reserved for S = ``max_num_seqs`` requests before the pool is sized.
Every rank holds the same tokens (tensor-parallel attention), so the pool is the minimum over ranks. MLA's latent
is not split by heads: every rank holds the full latent for every token, so adding devices does not shrink the
per-rank KV of MLA models (data-parallel attention is not modelled). A request of ``T`` tokens fits when the weights
fit and ``max_kv_tokens >= T``.

Weight bytes come from the checkpoint's safetensors headers when present (real dtypes: FP8 block-scaled,
INT4 pack-quantized, ... — only the 8-byte length and the JSON header of each file are read) or else from the
config with a stated weight format (see :func:`tokenfab.model_tensors.model_tensors`).
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any

from tokenfab.config import ModelConfig, load_config, parse_config
from tokenfab.model_tensors import TensorRecord, count_parameters, model_tensors
from tokenfab.parallel.shard_plan import TENSOR_CLASSES, ShardPlan, WeightInventory
from tokenfab.planner.plan_inputs import PlanError, parse_reserve


KV_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def kv_dtype_bytes(kv_cache_dtype: str, model_config: ModelConfig | None = None) -> int:
    """Bytes per cached element: ``auto`` follows the config's ``torch_dtype`` / ``dtype`` (bfloat16 when absent or
    not a float dtype), else bfloat16/float16 = 2, float32 = 4, fp8 = 1.

    Raises:
        PlanError: an unknown dtype, naming ``--kv-cache-dtype``.
    """
    if kv_cache_dtype == "auto":
        raw = (model_config.raw if model_config else {}) or {}
        d = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
        return KV_DTYPE_BYTES.get(str(d), 2) if str(d) in ("bfloat16", "float16", "float32") else 2
    if kv_cache_dtype not in KV_DTYPE_BYTES:
        raise PlanError(f"--kv-cache-dtype: '{kv_cache_dtype}' is not supported; supported: auto, "
                        f"{', '.join(KV_DTYPE_BYTES)}")
    return KV_DTYPE_BYTES[kv_cache_dtype]


# ----------------------------------------------------------------------------------------- model and weights
def resolve_model(model: str | dict | ModelConfig) -> tuple[ModelConfig, str | None]:
    """(ModelConfig, checkpoint folder or None) from a folder, a ``config.json`` path, a dict or a ModelConfig.

    Raises:
        FileNotFoundError: the path does not exist or holds no config.json.
        ConfigError: the config is refused (see :func:`tokenfab.config.parse_config`).
    """
    if isinstance(model, ModelConfig):
        return model, None
    if isinstance(model, dict):
        return parse_config(model), None
    path = os.fspath(model)
    return load_config(path), (path if os.path.isdir(path) else os.path.dirname(path) or ".")


def read_safetensors_header(path: str) -> dict[str, dict]:
    """The JSON header of one ``.safetensors`` file (tensor name -> {dtype, shape, data_offsets}).

    Reads only the 8-byte little-endian header length and the header itself, never tensor data.

    Raises:
        PlanError: the file is not a safetensors file.
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise PlanError(f"'{path}' is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        size = os.fstat(f.fileno()).st_size
        if n > size - 8 or n > 512 * 1024 * 1024:
            raise PlanError(f"'{path}' is not a safetensors file (header length {n} for a {size}-byte file)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise PlanError(f"'{path}': safetensors header is not valid JSON ({e})") from None
    header.pop("__metadata__", None)
    return header


def checkpoint_tensors(model_dir: str) -> list[TensorRecord] | None:
    """Tensor records from a checkpoint's safetensors headers (``model.safetensors.index.json`` + its shards, or
    every ``*.safetensors`` in the folder); None when the folder holds no safetensors. Byte counts are the exact
    ``data_offsets`` spans, so any dtype (F8_E4M3, I32 packed INT4, F8_E8M0 ...) is counted as stored.

    Raises:
        FileNotFoundError: the index names a shard that is missing.
    """
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(x for x in os.listdir(model_dir) if x.endswith(".safetensors"))
    if not files:
        return None
    recs = []
    for fn in files:
        path = os.path.join(model_dir, fn)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"'{index}' names shard '{fn}', which is missing from '{model_dir}'")
        for name, info in read_safetensors_header(path).items():
            s, e = info["data_offsets"]
            recs.append(TensorRecord(name, tuple(int(x) for x in info["shape"]), int(e) - int(s), 1,
                                     str(info["dtype"])))
    return recs


def auto_weight_format(model_config: ModelConfig) -> str:
    """Weight format implied by config.json alone: ``quantization_config`` fp8 -> ``fp8``; compressed-tensors with
    4-bit weights -> ``int4``; else the config's ``dtype`` / ``torch_dtype`` (bfloat16 when absent)."""
    if getattr(model_config, "mxfp4_experts", False):  # Kimi K3: MXFP4 routed experts (tokenfab/config_kimi.py)
        return "mxfp4"
    raw = model_config.raw or {}
    qc = raw.get("quantization_config") or {}
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        return "fp8"
    if method == "compressed-tensors":
        groups = (qc.get("config_groups") or {}).values()
        if any(int(((g or {}).get("weights") or {}).get("num_bits") or 0) == 4 for g in groups):
            return "int4"
    d = str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16")
    return d if d in ("bfloat16", "float16", "float32") else "bfloat16"


@dataclass
class WeightEstimate:
    """Weight bytes of a model under a shard plan.

    ``per_rank[r]`` maps tensor class -> bytes on rank r (replicated classes counted on every rank);
    ``total_bytes`` is one copy of every loaded tensor; ``skipped_bytes`` are tensors not loaded (MTP layers);
    ``num_params`` the logical parameter count from the config (MTP excluded).
    """

    source: str              # "safetensors" or "config"
    weight_format: str       # e.g. "fp8" or "safetensors: F8_E4M3 98.9%, BF16 0.9%, F32 0.2%"
    world_size: int
    per_rank: list[dict[str, int]]
    total_bytes: int
    replicated_bytes: int
    skipped_bytes: int
    num_params: int
    inventory: WeightInventory = field(repr=False)

    def rank_bytes(self, rank: int, exclude: tuple[str, ...] = ()) -> int:
        """Total bytes on ``rank``, without the classes in ``exclude`` (e.g. ``("experts",)`` when offloaded)."""
        return sum(v for k, v in self.per_rank[rank].items() if k not in exclude)


def estimate_weight_bytes(model_dir_or_config: str | dict | ModelConfig, world_size: int,
                          weight_dtype: str | int = "auto") -> WeightEstimate:
    """Per-rank weight bytes for ``world_size`` ranks.

    ``weight_dtype="auto"`` reads the safetensors headers when the folder has them (real dtypes and bytes), else
    uses :func:`auto_weight_format`. Any other value (``bfloat16``, ``float16``, ``float32``, ``fp8``, ``int4`` or
    bytes per parameter) computes the bytes from the config in that format.

    Raises:
        PlanError / ConfigError / FileNotFoundError: bad inputs, named.
    """
    mc, folder = resolve_model(model_dir_or_config)
    recs = None
    if weight_dtype == "auto" and folder is not None:
        recs = checkpoint_tensors(folder)
    if recs is not None:
        by_dtype: dict[str, int] = {}
        for r in recs:
            by_dtype[r.dtype] = by_dtype.get(r.dtype, 0) + r.nbytes
        tot = sum(by_dtype.values()) or 1
        fmt = "safetensors: " + ", ".join(f"{k} {100 * v / tot:.1f}%"
                                          for k, v in sorted(by_dtype.items(), key=lambda kv: -kv[1]))
        source = "safetensors"
    else:
        fmt = auto_weight_format(mc) if weight_dtype == "auto" else weight_dtype
        if isinstance(fmt, str) and fmt not in ("bfloat16", "float16", "float32", "fp8", "int4", "mxfp4"):
            raise PlanError(f"--weight-dtype: '{fmt}' is not supported; supported: auto, bfloat16, float16, "
                            "float32, fp8, int4")
        try:
            recs = model_tensors(mc, fmt)
        except ValueError as e:  # a format this family cannot be stored in (e.g. fp8 for Kimi): name the flag
            raise PlanError(f"--weight-dtype: {e}") from None
        fmt = f"{fmt} bytes/param" if isinstance(fmt, int) else str(fmt)
        source = "config"
    try:
        inv = WeightInventory(recs, mc)
        plan = ShardPlan.for_model(mc, world_size)
        per_rank = inv.per_rank(plan)
    except ValueError as e:
        raise PlanError(str(e)) from None
    return WeightEstimate(source, fmt, world_size, per_rank, inv.total_bytes, inv.replicated_bytes(),
                          inv.skipped_bytes, count_parameters(mc), inv)


# ------------------------------------------------------------------------------------------------------ KV
def kv_bytes_per_token_per_rank(model_config: ModelConfig, plan: ShardPlan, kv_dtype_bytes: int) -> list[int]:
    """KV cache bytes per token on each rank (all layers).

    MLA: (kv_lora_rank + qk_rope_head_dim) x layers x bytes on every rank that has heads (the latent is not split
    by heads; ranks beyond the number of heads hold none).
    MHA/GQA: 2 x kv_heads_on_rank x head_dim x layers x bytes (0 on ranks without heads).
    """
    mc = model_config
    if mc.is_mla:
        return [mc.kv_cache_bytes_per_token(kv_dtype_bytes) if plan.num_heads(r) else 0
                for r in range(plan.world_size)]
    return [2 * plan.num_kv_heads(r) * mc.head_dim * mc.num_hidden_layers * kv_dtype_bytes
            for r in range(plan.world_size)]


def kv_pool_tokens(model_config: ModelConfig, world_size: int, device_memory_bytes: int,
                   weight_bytes_per_rank: int | list[int], kv_dtype_bytes: int, reserve_bytes: int,
                   block_size: int = 1) -> int:
    """Largest KV pool (tokens, a multiple of ``block_size``) every rank can hold.

    tokens = min over ranks r of floor((device_memory_bytes - reserve_bytes - weight_bytes[r]) / kv_bytes_per_token[r]),
    rounded down to ``block_size``; 0 when the weights and reserve alone do not fit. ``weight_bytes_per_rank`` is
    one int (the same on every rank, e.g. the engine's measured max) or a list indexed by rank.
    """
    plan = ShardPlan.for_model(model_config, world_size)
    kv = kv_bytes_per_token_per_rank(model_config, plan, kv_dtype_bytes)
    ws = weight_bytes_per_rank if isinstance(weight_bytes_per_rank, list) else [weight_bytes_per_rank] * world_size
    best = None
    for r in range(world_size):
        free = device_memory_bytes - reserve_bytes - ws[r]
        if free < 0:
            return 0
        if kv[r] == 0:
            continue
        t = free // kv[r]
        best = t if best is None else min(best, t)
    if best is None:
        return 0
    return best // block_size * block_size


# ------------------------------------------------------------------------------------------------ the plan
@dataclass
class RankPlan:
    """One rank's memory budget (bytes) and ranges."""

    rank: int
    ranges: dict
    weight_bytes: int            # bytes of weights on the device (offloaded experts excluded)
    weight_bytes_by_class: dict
    offloaded_bytes: int         # routed-expert bytes moved to host memory (0 without --offload-experts)
    kv_bytes_per_token: int
    reserve_bytes: int
    free_bytes_for_kv: int       # device memory - reserve - weight bytes (negative: weights do not fit)
    max_kv_tokens: int | None    # None: this rank holds no KV (no heads)
    state_bytes: int = 0         # KDA state reserved for max_num_seqs requests (hybrid models; 0 otherwise)


@dataclass
class MemoryPlan:
    """Result of :func:`plan_memory`; ``to_dict()`` is the ``--json`` output."""

    model: dict
    devices: int
    device_memory_bytes: int
    reserve_bytes: int
    kv_cache_dtype: str
    kv_dtype_bytes: int
    weights: WeightEstimate
    offload_experts: bool
    ranks: list[RankPlan]
    max_kv_tokens: int
    weights_fit: bool
    requested_tokens: int | None
    max_model_len: int | None
    kv_tokens: int | None
    fits: bool
    min_devices: int | None
    suggestions: list[str]
    assumptions: list[str]
    max_num_seqs: int = 1
    expert_placement: Any = None  # ExpertPlacement under --offload-experts (tokenfab/planner/expert_placement.py)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (all sizes in bytes, pools in tokens)."""
        w = self.weights
        return {
            "model": self.model, "devices": self.devices, "device_memory_bytes": self.device_memory_bytes,
            "reserve_bytes": self.reserve_bytes, "kv_cache_dtype": self.kv_cache_dtype,
            "kv_dtype_bytes": self.kv_dtype_bytes, "offload_experts": self.offload_experts,
            "weights": {"source": w.source, "format": w.weight_format, "total_bytes": w.total_bytes,
                        "replicated_bytes_per_copy": w.replicated_bytes, "skipped_bytes": w.skipped_bytes,
                        "num_params": w.num_params},
            "ranks": [{"rank": r.rank, **{k: list(v) for k, v in r.ranges.items()},
                       "weight_bytes": r.weight_bytes, "weight_bytes_by_class": r.weight_bytes_by_class,
                       "offloaded_bytes": r.offloaded_bytes, "kv_bytes_per_token": r.kv_bytes_per_token,
                       "reserve_bytes": r.reserve_bytes, "free_bytes_for_kv": r.free_bytes_for_kv,
                       "max_kv_tokens": r.max_kv_tokens, "state_bytes": r.state_bytes} for r in self.ranks],
            "max_num_seqs": self.max_num_seqs,
            "expert_placement": None if self.expert_placement is None else self.expert_placement.to_dict(),
            "max_kv_tokens": self.max_kv_tokens, "weights_fit": self.weights_fit,
            "max_model_len": self.max_model_len, "kv_tokens": self.kv_tokens,
            "requested_tokens": self.requested_tokens, "fits": self.fits, "min_devices": self.min_devices,
            "suggestions": self.suggestions, "assumptions": self.assumptions,
        }


def state_bytes_per_rank(mc: ModelConfig, plan: ShardPlan, kv_dtype_bytes: int, max_num_seqs: int = 1) -> list[int]:
    """KDA state bytes each rank reserves for ``max_num_seqs`` requests (hybrid Kimi models; zeros otherwise):
    ``max_num_seqs x`` :func:`tokenfab.planner.kimi_tensors.kda_state_bytes_per_rank`."""
    if not getattr(mc, "kda_layers", None):
        return [0] * plan.world_size
    from tokenfab.planner.kimi_tensors import kda_state_bytes_per_rank
    return [b * max_num_seqs for b in kda_state_bytes_per_rank(mc, plan, kv_dtype_bytes)]


def _evaluate(mc: ModelConfig, inv: WeightInventory, n: int, mem: int, reserve: int, kv_b: int,
              offload: bool, seqs: int = 1) -> tuple[ShardPlan, list[dict], list[int], int, bool]:
    """(plan, per-rank class bytes, per-rank kv bytes/token, pool tokens, weights fit) for ``n`` devices; the KDA
    state of ``seqs`` requests is held besides the weights."""
    plan = ShardPlan.for_model(mc, n)
    per = inv.per_rank(plan)
    kv = kv_bytes_per_token_per_rank(mc, plan, kv_b)
    excl = ("experts",) if offload else ()
    state = state_bytes_per_rank(mc, plan, kv_b, seqs)
    ws = [sum(v for k, v in d.items() if k not in excl) + st for d, st in zip(per, state)]
    weights_fit = all(mem - reserve - w >= 0 for w in ws)
    pool = kv_pool_tokens(mc, n, mem, ws, kv_b, reserve) if weights_fit else 0
    return plan, per, kv, pool, weights_fit


def _fits(pool: int, weights_fit: bool, requested: int | None) -> bool:
    return weights_fit and pool >= max(requested or 1, 1)


def min_devices_that_fit(mc: ModelConfig, inv: WeightInventory, mem: int, reserve: int, kv_b: int,
                         requested: int | None, offload: bool = False, max_devices: int = 4096,
                         seqs: int = 1) -> int | None:
    """Fewest devices of ``mem`` bytes on which the weights fit and the pool holds ``requested`` tokens.

    Starts at the lower bound ceil(sharded bytes / (mem - reserve - replicated bytes)) and walks up one device at a
    time (in steps of n/64 above 256 devices, so the answer is approximate there); None when nothing up to
    ``max_devices`` fits (e.g. MLA's per-rank KV alone exceeds a device).
    """
    rep = inv.replicated_bytes()
    budget = mem - reserve - rep
    if budget <= 0:
        return None
    sharded = inv.total_bytes - rep - (sum(inv.expert_bytes) if offload else 0)
    n = max(1, math.ceil(sharded / budget))
    while n <= max_devices:
        _, _, _, pool, wf = _evaluate(mc, inv, n, mem, reserve, kv_b, offload, seqs)
        if _fits(pool, wf, requested):
            return n
        n += 1 if n < 256 else max(1, n // 64)
    return None


def _gb(x: int | float) -> str:
    return f"{x / 2**30:,.1f} GiB"


def plan_memory(model: str | dict | ModelConfig, devices: int, device_memory_bytes: int, *,
                max_model_len: int | None = None, kv_tokens: int | None = None, kv_cache_dtype: str = "auto",
                weight_dtype: str | int = "auto", activation_reserve: str | int = "10%",
                offload_experts: bool = False, max_num_seqs: int = 1, host_experts=None,
                num_device_experts: int | None = None, expert_popularity: str | None = None) -> MemoryPlan:
    """Plan memory for ``model`` on ``devices`` devices of ``device_memory_bytes`` each.

    ``offload_experts`` (implied by ``host_experts``, ``num_device_experts`` or ``expert_popularity``): split each
    MoE layer's routed experts between the devices and host memory (:mod:`tokenfab.planner.expert_placement`): by
    default each rank's device is filled first, after its dense weights, the KV of the requested tokens, the KDA
    state and the reserve, and the rest go to the host; ``host_experts`` ("50%" or a count per layer) or
    ``num_device_experts`` set the split instead; ``expert_popularity`` (a routed-token count file) keeps the most
    used experts on the devices. The split is ``MemoryPlan.expert_placement``.

    Requested tokens T = max(max_model_len, kv_tokens) (either may be None). Fits when every rank holds its
    weights + reserve and the pool >= T (>= 1 token when nothing is requested). When it does not fit the suggestions
    name the fewest devices that fit, whether offloading routed experts to host memory fits (and the bytes it
    moves per rank), whether an fp8 KV cache fits, and the largest pool that fits now. Hybrid (KDA) models hold
    the recurrent state of ``max_num_seqs`` requests on every rank besides the weights.

    Raises:
        PlanError: ``devices < 1``, ``max_num_seqs < 1`` or bad sizes (named by flag).
    """
    if devices < 1:
        raise PlanError(f"--devices: must be >= 1, got {devices}")
    if max_num_seqs < 1:
        raise PlanError(f"--max-num-seqs: must be >= 1, got {max_num_seqs}")
    if device_memory_bytes <= 0:
        raise PlanError(f"--device-memory: must be > 0, got {device_memory_bytes}")
    mc, _ = resolve_model(model)
    offload_experts = bool(offload_experts or host_experts is not None or num_device_experts is not None
                           or expert_popularity is not None)
    reserve = parse_reserve(activation_reserve, device_memory_bytes)
    kv_b = kv_dtype_bytes(kv_cache_dtype, mc)
    est = estimate_weight_bytes(model if not isinstance(model, dict) else mc, devices, weight_dtype)
    inv = est.inventory
    mem = device_memory_bytes
    requested = None if max_model_len is None and kv_tokens is None else max(max_model_len or 0, kv_tokens or 0)
    seqs = max_num_seqs
    plan, per, kv, pool, weights_fit = _evaluate(mc, inv, devices, mem, reserve, kv_b, offload_experts, seqs)
    state = state_bytes_per_rank(mc, plan, kv_b, seqs)
    placement = None
    if offload_experts and mc.is_moe and mc.moe_layers:  # which experts stay on the devices, which go to the host
        placement = _expert_split(mc, inv, plan, per, kv, mem, reserve, requested, state, host_experts,
                                  num_device_experts, expert_popularity)
        ws = [sum(per[r].values()) - placement.host_bytes(plan.experts[r]) + state[r] for r in range(devices)]
        weights_fit = all(mem - reserve - w >= 0 for w in ws)
        pool = kv_pool_tokens(mc, devices, mem, ws, kv_b, reserve) if weights_fit else 0
    ranks = []
    for r in range(devices):
        off = (per[r]["experts"] if placement is None else placement.host_bytes(plan.experts[r])) \
            if offload_experts else 0
        w = sum(per[r].values()) - off
        free = mem - reserve - w - state[r]
        ranks.append(RankPlan(r, {k: v for k, v in plan.describe()[r].items() if k != "rank"}, w, per[r], off,
                              kv[r], reserve, free, (max(free, 0) // kv[r]) if kv[r] else None, state[r]))
    fits = _fits(pool, weights_fit, requested)
    min_dev = min_devices_that_fit(mc, inv, mem, reserve, kv_b, requested, offload_experts, seqs=seqs)
    need = requested or 1
    sugg: list[str] = []
    if not fits:
        if min_dev is not None:
            sugg.append(f"use {min_dev} devices of {mem_label(mem)} (fewest that fit {need:,} KV tokens)")
        else:
            sugg.append(f"no device count up to 4096 of {mem_label(mem)} fits {need:,} KV tokens "
                        f"({'per-rank MLA latent KV does not shrink with more devices' if mc.is_mla else ''})"
                        .replace(" ()", ""))
        if not offload_experts and mc.is_moe:
            _, per_o, _, pool_o, wf_o = _evaluate(mc, inv, devices, mem, reserve, kv_b, True, seqs)
            moved = max(d["experts"] for d in per_o)
            total_moved = sum(d["experts"] for d in per_o)
            verdict = "fits" if _fits(pool_o, wf_o, requested) else "still does not fit"
            sugg.append(f"--offload-experts on {devices} devices {verdict} (pool {pool_o:,} tokens): moves up to "
                        f"{_gb(moved)} of routed experts per rank to host memory ({_gb(total_moved)} in all)")
        if kv_b > 1:
            _, _, _, pool_f, wf_f = _evaluate(mc, inv, devices, mem, reserve, 1, offload_experts, seqs)
            if _fits(pool_f, wf_f, requested):
                sugg.append(f"--kv-cache-dtype fp8 fits on {devices} devices (pool {pool_f:,} tokens)")
        if weights_fit and pool > 0:
            sugg.append(f"the largest KV pool that fits on {devices} devices is {pool:,} tokens")
        elif not weights_fit:
            worst = max(rp.weight_bytes for rp in ranks)
            sugg.append(f"weights alone need {_gb(worst)} + reserve {_gb(reserve)} per rank, over {_gb(mem)}")
    assumptions = [
        f"tensor parallel = expert parallel = {devices}; uneven splits (larger ranges first)",
        "routed experts whole per rank; heads, intermediate, shared-expert intermediate and vocab split",
        "norms, router" + (", MLA q_a_proj / kv_a_proj_with_mqa" if mc.is_mla else "") + " replicated on every rank",
    ]
    if not mc.is_mla and mc.num_key_value_heads % devices and devices < mc.num_key_value_heads:
        assumptions.append("query heads stay with their KV head: KV heads split unevenly, so ranks with more KV "
                           "heads bound the pool")
    elif not mc.is_mla and devices > mc.num_key_value_heads:
        assumptions.append("more ranks than KV heads: each KV head replicated on the ranks sharing its group")
    if mc.is_mla:
        assumptions.append("MLA latent KV (kv_lora_rank + qk_rope_head_dim) held in full on every rank "
                           "(tensor-parallel attention, no data-parallel attention)")
    if placement is not None:
        assumptions.append(f"--offload-experts: {placement.summary()}; chosen by {placement.source}"
                           + ("" if host_experts is not None or num_device_experts is not None else
                              f" after the dense weights, the KV of {requested or 0:,} tokens and the reserve"))
    if offload_experts:
        host = max(rp.offloaded_bytes for rp in ranks)
        assumptions.append(f"--offload-experts: up to {_gb(host)} of routed experts per rank in host memory "
                           f"({_gb(sum(rp.offloaded_bytes for rp in ranks))} in all; host memory is not checked)")
    if est.skipped_bytes:
        assumptions.append(f"{_gb(est.skipped_bytes)} of MTP-layer weights not loaded")
    if getattr(mc, "kda_layers", None):  # hybrid Kimi models: per-request KDA state besides the per-token KV
        from tokenfab.planner.kimi_tensors import kda_state_note
        assumptions.append(kda_state_note(mc, plan, kv_b, seqs))
    model_info = {"architecture": mc.architecture, "model_type": mc.model_type,
                  "num_hidden_layers": mc.num_hidden_layers, "num_attention_heads": mc.num_attention_heads,
                  "num_key_value_heads": mc.num_key_value_heads, "num_experts": mc.num_experts,
                  "vocab_size": mc.vocab_size, "max_position_embeddings": mc.max_position_embeddings}
    if getattr(mc, "kda_layers", None):
        model_info.update(num_kda_layers=len(mc.kda_layers), num_mla_layers=len(mc.mla_layers),
                          kda_state_bytes_per_request=mc.kda_state_bytes_per_request(kv_b))
    return MemoryPlan(model_info, devices, mem, reserve, kv_cache_dtype, kv_b, est, offload_experts, ranks, pool,
                      weights_fit, requested, max_model_len, kv_tokens, fits, min_dev, sugg, assumptions, seqs,
                      expert_placement=placement)


def _expert_split(mc, inv, plan, per, kv, mem, reserve, requested, state, host_experts, num_device_experts,
                  popularity_path):
    """The planner's :class:`~tokenfab.planner.expert_placement.ExpertPlacement`: from the counts when given, else
    filling each rank's free bytes (device memory - reserve - non-expert weights - KDA state - requested tokens x
    KV bytes per token) with its experts. One expert of one layer = the largest expert's bytes over all layers / L
    (rounded up). Raises PlanError naming the flag."""
    from tokenfab.planner.expert_placement import (PlacementError, load_popularity, placement_from_counts,
                                                   placement_from_memory)
    layers = sorted(mc.moe_layers)
    eb = -(-max(inv.expert_bytes) // len(layers))
    try:
        pop = load_popularity(popularity_path, mc.num_experts) if popularity_path else None
        if host_experts is not None or num_device_experts is not None:
            return placement_from_counts(layers, mc.num_experts, plan.experts, host_experts=host_experts,
                                         num_device_experts=num_device_experts, popularity=pop, expert_bytes=eb)
        free = [mem - reserve - (sum(per[r].values()) - per[r]["experts"]) - state[r] - (requested or 0) * kv[r]
                for r in range(plan.world_size)]
        return placement_from_memory(layers, mc.num_experts, plan.experts, eb, free, pop)
    except PlacementError as e:
        raise PlanError(str(e)) from None


def mem_label(x: int) -> str:
    """A device memory size in bytes as "141.0 GB = 131.3 GiB"."""
    return f"{x / 1e9:,.1f} GB = {x / 2**30:,.1f} GiB"


def plan_device_sweep(model: str | dict | ModelConfig, device_counts: list[int], device_memory_bytes: int,
                      **kwargs) -> list[MemoryPlan]:
    """:func:`plan_memory` for each device count in ``device_counts`` (same keyword arguments), e.g. "what fits
    on 4..8 devices of 141 GB". Raises what :func:`plan_memory` raises."""
    return [plan_memory(model, n, device_memory_bytes, **kwargs) for n in device_counts]
