"""Which routed experts of each MoE layer stay on the device and which live in host memory (host-offloaded experts).

A placement is, per MoE layer, the set of expert ids (global ids, ``0 <= e < E``) whose weights are kept in host
memory and computed by the host's CPUs (:mod:`tokenfab.layers.host_experts`); every other expert stays on the
device of the rank that owns it. Expert ownership is unchanged: rank ``r`` owns ``ShardPlan.experts[r]`` and
offloads only experts of its own range, to its own host memory.

How many experts go to the host, first that applies:

* ``--num-device-experts N``: N experts of each MoE layer stay on the devices (all ranks together), E - N go to
  the host;
* ``--host-experts 50%`` / ``--host-experts 96``: that share (rounded to the nearest expert) or count of each
  layer's experts go to the host;
* memory fill (the planner's default under ``--offload-experts``): each rank keeps as many of its experts on the
  device as its free bytes hold after the dense weights, the KV pool and the activation reserve
  (:func:`placement_from_memory`); layers get ``slots // L`` device experts each and the first ``slots % L``
  layers one more.

A host count over all ranks is split across ranks in proportion to the experts each owns (largest remainder, lower
ranks first on ties), so every rank offloads the same share of its range. Which experts: with
``--expert-popularity FILE`` (routed-token counts per layer per expert, written by a calibration run, see
:mod:`tokenfab.engine.expert_popularity`) the least used experts of a rank's range go to the host (ties: the higher
id); without it the highest ids of the range do.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field


class PlacementError(ValueError):
    """A bad placement flag or popularity file; the message names the flag and the fix."""

    user_error = True


@dataclass(frozen=True)
class ExpertPlacement:
    """Host-resident routed experts per MoE layer.

    Attributes:
        num_experts: routed experts per MoE layer (E).
        host: MoE layer index (decoder layer index) -> sorted tuple of global expert ids kept in host memory.
        expert_bytes: bytes of one routed expert of one layer (0 when unknown), for :meth:`host_bytes`.
    """

    num_experts: int
    host: dict[int, tuple[int, ...]]
    expert_bytes: int = 0
    source: str = field(default="", compare=False)  # how it was chosen, for messages

    def host_ids(self, layer: int) -> tuple[int, ...]:
        """Host expert ids of MoE layer ``layer`` (empty for layers not in the placement)."""
        return self.host.get(layer, ())

    def num_host(self) -> int:
        """Host experts over all layers."""
        return sum(len(v) for v in self.host.values())

    def host_bytes(self, expert_range: tuple[int, int] | None = None) -> int:
        """Bytes of host-resident experts (all layers), optionally only those in ``expert_range`` [start, end)."""
        s, e = expert_range or (0, self.num_experts)
        return self.expert_bytes * sum(1 for ids in self.host.values() for j in ids if s <= j < e)

    def summary(self) -> str:
        """One line: host experts per layer (min-max), total, bytes."""
        counts = [len(v) for v in self.host.values()] or [0]
        per = f"{min(counts)}" if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"
        return (f"{per} of {self.num_experts} experts per MoE layer on the host ({self.num_host()} over "
                f"{len(self.host)} layers, {self.host_bytes() / 2**30:,.2f} GiB)")

    def to_dict(self) -> dict:
        """JSON-ready: {"num_experts", "expert_bytes", "host_bytes", "host": {layer: [ids]}}."""
        return {"num_experts": self.num_experts, "expert_bytes": self.expert_bytes,
                "host_bytes": self.host_bytes(), "source": self.source,
                "host": {str(k): list(v) for k, v in sorted(self.host.items())}}


# ----------------------------------------------------------------------------------------------------- flags
def parse_host_experts(value, flag: str = "--host-experts") -> tuple[str, float]:
    """``"50%"`` -> ("fraction", 0.5); ``"96"`` / 96 -> ("count", 96). Fractions in [0%, 100%], counts >= 0.

    Raises:
        PlacementError: anything else, naming ``flag``.
    """
    if isinstance(value, bool):
        raise PlacementError(f"{flag}: expected a share such as 50% or a count of experts per MoE layer, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise PlacementError(f"{flag}: a count of host experts must be >= 0, got {value}")
        return "count", float(value)
    if isinstance(value, float):
        raise PlacementError(f"{flag}: give a share as a percentage (e.g. '50%') or a whole count, got {value!r}")
    s = str(value).strip()
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            raise PlacementError(f"{flag}: cannot read '{value}' as a percentage; use e.g. 50% or a count such "
                                 "as 96") from None
        if not (0 <= pct <= 100) or math.isnan(pct):
            raise PlacementError(f"{flag}: {value} is outside [0%, 100%]")
        return "fraction", pct / 100
    if s.isdigit():
        return "count", float(int(s))
    raise PlacementError(f"{flag}: cannot read '{value}' as a share or a count; use e.g. 50% or 96 (experts per "
                         "MoE layer kept in host memory)")


def load_popularity(path: str, num_experts: int | None = None, flag: str = "--expert-popularity") -> dict[int, list]:
    """Routed-token counts from a popularity file: ``{"layers": {"3": [c_0, ..., c_{E-1}], ...}}`` (the format
    :mod:`tokenfab.engine.expert_popularity` writes) -> {layer: counts}.

    Raises:
        PlacementError: unreadable file, wrong layout, negative counts, or a row length other than ``num_experts``.
    """
    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as e:
        raise PlacementError(f"{flag}: cannot read '{path}': {e.strerror or e}") from None
    except ValueError as e:
        raise PlacementError(f"{flag}: '{path}' is not JSON ({e})") from None
    layers = raw.get("layers") if isinstance(raw, dict) else None
    if not isinstance(layers, dict) or not layers:
        raise PlacementError(f"{flag}: '{path}' needs {{\"layers\": {{\"<layer>\": [count per expert, ...]}}}} "
                             "(written by LLM(record_expert_popularity=FILE) or tokenfab serve "
                             "--record-expert-popularity FILE)")
    out = {}
    for k, v in layers.items():
        if not str(k).isdigit() or not isinstance(v, list) or not all(
                isinstance(c, (int, float)) and not isinstance(c, bool) and c >= 0 for c in v):
            raise PlacementError(f"{flag}: '{path}' layer '{k}': expected a layer index and a list of counts >= 0")
        if num_experts is not None and len(v) != num_experts:
            raise PlacementError(f"{flag}: '{path}' layer {k} has {len(v)} counts but the model has {num_experts} "
                                 "routed experts per layer (a file from another model?)")
        out[int(k)] = list(v)
    return out


# ------------------------------------------------------------------------------------------------ choosing
def split_across_ranks(total: int, ranges: list[tuple[int, int]]) -> list[int]:
    """``total`` host experts split over ranks in proportion to the experts each owns: floor shares, then the
    largest remainders (lower rank first on ties). Each share is capped by the rank's expert count."""
    sizes = [e - s for s, e in ranges]
    E = sum(sizes)
    if E == 0:
        return [0] * len(sizes)
    exact = [total * n / E for n in sizes]
    share = [math.floor(x) for x in exact]
    order = sorted(range(len(sizes)), key=lambda r: (-(exact[r] - share[r]), r))
    for r in order[: total - sum(share)]:
        share[r] += 1
    return [min(a, n) for a, n in zip(share, sizes)]


def choose_host_ids(expert_range: tuple[int, int], n_host: int, counts: list | None) -> tuple[int, ...]:
    """The ``n_host`` experts of ``expert_range`` that go to the host: the least used by ``counts`` (ties: the
    higher id), or the highest ids without counts. Returned sorted."""
    s, e = expert_range
    ids = list(range(s, e))
    if n_host <= 0:
        return ()
    if counts is None:
        return tuple(ids[len(ids) - n_host:])
    ranked = sorted(ids, key=lambda j: (counts[j], -j))  # least used first
    return tuple(sorted(ranked[:n_host]))


def placement_from_counts(moe_layers, num_experts: int, ranges: list[tuple[int, int]], *,
                          host_experts=None, num_device_experts: int | None = None,
                          popularity: dict[int, list] | None = None, expert_bytes: int = 0) -> ExpertPlacement:
    """The same number of host experts in every MoE layer, from ``--host-experts`` or ``--num-device-experts``.

    Args:
        moe_layers: decoder layer indices of the MoE layers.
        num_experts: E, routed experts per layer.
        ranges: ``ShardPlan.experts`` ([start, end) per rank; ``[(0, E)]`` on one device).
        host_experts: "50%", "96" or an int (see :func:`parse_host_experts`).
        num_device_experts: experts per layer kept on the devices (all ranks together).
        popularity: {layer: counts} (:func:`load_popularity`) or None.

    Raises:
        PlacementError: both or neither of host_experts / num_device_experts, or a count above E.
    """
    if (host_experts is None) == (num_device_experts is None):
        raise PlacementError("give one of --host-experts (e.g. 50%) or --num-device-experts N, not "
                             + ("both" if host_experts is not None else "neither"))
    if num_device_experts is not None:
        if isinstance(num_device_experts, bool) or not isinstance(num_device_experts, int) or not (
                0 <= num_device_experts <= num_experts):
            raise PlacementError(f"--num-device-experts: must be a whole number in [0, {num_experts}] (the model "
                                 f"has {num_experts} routed experts per MoE layer), got {num_device_experts!r}")
        n_host, how = num_experts - num_device_experts, f"--num-device-experts {num_device_experts}"
    else:
        kind, v = parse_host_experts(host_experts)
        n_host = int(round(v * num_experts)) if kind == "fraction" else int(v)
        if n_host > num_experts:
            raise PlacementError(f"--host-experts: {host_experts} is more than the {num_experts} routed experts per "
                                 "MoE layer")
        how = f"--host-experts {host_experts}"
    per_rank = split_across_ranks(n_host, ranges)
    host = {}
    for layer in moe_layers:
        counts = popularity.get(layer) if popularity else None
        host[layer] = tuple(j for r, rng in enumerate(ranges) for j in choose_host_ids(rng, per_rank[r], counts))
    src = how + (" by popularity" if popularity else "")
    return ExpertPlacement(num_experts, host, expert_bytes, src)


def placement_from_memory(moe_layers, num_experts: int, ranges: list[tuple[int, int]], expert_bytes: int,
                          free_bytes: list[int], popularity: dict[int, list] | None = None) -> ExpertPlacement:
    """Fill each rank's device memory with its experts first, the rest to the host.

    Rank r keeps ``slots_r = max(0, free_bytes[r]) // expert_bytes`` expert-layers on its device (at most all it
    owns): ``slots_r // L`` device experts in every one of the L MoE layers and one more in the first
    ``slots_r % L`` layers (in layer order). ``free_bytes[r]``: device bytes left after the dense weights, the KV
    pool and the activation reserve.

    Raises:
        PlacementError: expert_bytes <= 0 or a free_bytes list of the wrong length.
    """
    layers = sorted(moe_layers)
    if expert_bytes <= 0:
        raise PlacementError("expert placement needs the bytes of one routed expert (> 0)")
    if len(free_bytes) != len(ranges):
        raise PlacementError(f"free_bytes has {len(free_bytes)} entries for {len(ranges)} ranks")
    L = len(layers)
    host: dict[int, tuple[int, ...]] = {layer: () for layer in layers}
    for r, (s, e) in enumerate(ranges):
        n = e - s
        slots = min(max(0, free_bytes[r]) // expert_bytes, n * L) if L else 0
        base, extra = divmod(slots, L) if L else (0, 0)
        for i, layer in enumerate(layers):
            dev = min(n, base + (1 if i < extra else 0))
            counts = popularity.get(layer) if popularity else None
            host[layer] = host[layer] + choose_host_ids((s, e), n - dev, counts)
    return ExpertPlacement(num_experts, host, expert_bytes,
                           "device memory filled first" + (" by popularity" if popularity else ""))


def placement_for_engine(config, model_config, world_size: int = 1) -> ExpertPlacement | None:
    """The placement an engine's settings ask for (``EngineConfig.host_experts`` / ``num_device_experts`` /
    ``expert_popularity``), over the expert ranges of ``world_size`` ranks; None when neither count is set.

    Raises:
        EngineConfigError: the model has no routed experts, or a count / popularity file that does not match it.
    """
    from tokenfab.errors import EngineConfigError
    from tokenfab.parallel.shard_plan import ShardPlan
    he, nd = getattr(config, "host_experts", None), getattr(config, "num_device_experts", None)
    if he is None and nd is None:
        return None
    mc = model_config
    layers = sorted(getattr(mc, "moe_layers", None) or [])
    if not getattr(mc, "is_moe", False) or not layers or not mc.num_experts:
        raise EngineConfigError(f"host_experts / num_device_experts: this model ({mc.model_type}) has no routed "
                                "experts; leave them unset")
    try:
        pop = None
        if getattr(config, "expert_popularity", None):
            pop = load_popularity(config.expert_popularity, mc.num_experts, "expert_popularity (--expert-popularity)")
        ranges = ShardPlan.for_model(mc, world_size).experts
        return placement_from_counts(layers, mc.num_experts, ranges, host_experts=he, num_device_experts=nd,
                                     popularity=pop)
    except PlacementError as e:
        raise EngineConfigError(str(e)) from None
