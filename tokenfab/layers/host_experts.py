"""Host-offloaded routed experts: part of a MoE layer's experts live in host memory and run on the host's CPUs,
overlapped with the device computing its own experts (behind :class:`~tokenfab.layers.moe.RoutedExperts`'s
expert-compute seam, ``RoutedExperts.host``).

One MoE layer call with a split (:meth:`HostExpertSplit.forward`):

1. (token, slot) pairs sorted by expert (one stable argsort, as the no-offload path), so each expert's rows are
   contiguous; pairs of host experts and of device experts are told apart by expert id.
2. Host side: the rows of host pairs are gathered and copied to host memory (pinned on CUDA), then a worker thread
   with its own intra-op thread budget computes every host expert over its rows, batched per expert with
   tokenfab's CPU expert kernels (bf16: the packed VNNI GEMVs / brgemm, all host experts' gate_up projections in one
   parallel region and all down projections in another, ``cpu_vnni.vnni_linear_group``; other dtypes: one GEMM
   per expert).
3. Meanwhile the calling thread computes the device experts over their rows (on the model's device).
4. The host rows are copied back and both sides' expert outputs are put back in the sorted-pair order; the weighted
   sum is then exactly the no-offload path's: ``out.index_add_(0, token_of, (h * w_sorted[:, None]).to(dtype))``
   (float32 ``out`` for experts that sum in float32, Kimi K3's latent MoE).

The experts' activation is the module's ``act`` (SiLU-GLU; SiTU-GLU for Kimi K3's ``SituRoutedExperts``). Experts
whose module runs its own unpacked GEMMs (SiTU) keep their host copies unpacked too, so both sides match it.

Because each expert sees the same rows in the same order and the per-token sum runs over the same pairs in the same
order, the result is bit-identical to no offload whenever an expert's GEMM gives the same bits on either side (CPU
"device" and CPU host in float32 and in bf16 here; tests/test_host_experts.py). On a GPU the device side's GEMMs
are the GPU's, so there the host experts' rows differ from a GPU-only run by GEMM rounding, not by summation order.

Where there is no accelerator (this project's CI), the "device" side is the CPU too: the same split, copies, overlap
and accounting run, on the calling thread's OpenMP team against the worker's.

Accounting (:class:`HostExpertStats`, per process; ``/metrics`` and ``tokenfab bench serve`` read rank 0's): seconds
of device-expert compute, host-expert compute (on the worker), copies (gather, device -> host, host -> device,
scatter), and the calling thread's wait for the host after its own experts were done; routed pairs per side; bytes
copied each way; forward passes that ran a split.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from tokenfab.kernels.cpu.ops import support as cpu_support
from tokenfab.kernels.cpu.ops import vnni_linear as cpu_vnni
from tokenfab.layers.activation import silu_and_mul
from tokenfab.layers.linear import can_pack, pack_weight, packed_linear


class HostExpertStats:
    """Cumulative accounting of the host/device expert split in this process (all layers, all steps).

    Fields (floats in seconds, ints in pairs / bytes / passes): ``device_s``, ``host_s``, ``copy_s``, ``wait_s``,
    ``device_pairs``, ``host_pairs``, ``bytes_to_host``, ``bytes_to_device``, ``passes`` (model forward passes
    that ran at least one split layer), ``layer_calls``.
    """

    FIELDS = ("device_s", "host_s", "copy_s", "wait_s", "device_pairs", "host_pairs", "bytes_to_host",
              "bytes_to_device", "passes", "layer_calls")

    def __init__(self):
        self._lock = threading.Lock()
        for f in self.FIELDS:
            setattr(self, f, 0.0 if f.endswith("_s") else 0)

    def add(self, **kw) -> None:
        """Add to fields by name."""
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> dict:
        """{field: value} now."""
        with self._lock:
            return {f: getattr(self, f) for f in self.FIELDS}


class HostExpertWorker:
    """The host side's worker thread: one job at a time (MoE layers run one after the other), with its own
    intra-op thread count (``torch.set_num_threads`` is per calling thread under OpenMP, so the worker's team and
    the calling thread's are sized independently)."""

    def __init__(self, threads: int):
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"host_expert_threads must be an integer >= 1, got {threads!r}")
        self.threads = threads
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenfab-host-experts",
                                        initializer=torch.set_num_threads, initargs=(threads,))

    def submit(self, fn, *args):
        return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


class ExpertWeights:
    """The weights of one side's experts, in ascending global id order: stacked ``w13`` [n, 2I, H] / ``w2``
    [n, H, I], or per-expert packed copies ``p13`` / ``p2`` (:func:`~tokenfab.layers.linear.pack_weight`)."""

    def __init__(self, w13: torch.Tensor | None, w2: torch.Tensor | None):
        self.w13, self.w2 = w13, w2
        self.p13: list[torch.Tensor] | None = None
        self.p2: list[torch.Tensor] | None = None

    @classmethod
    def of_module(cls, module) -> "ExpertWeights":
        """The (device) experts a split RoutedExperts keeps: its w13 / w2, or its packed copies after fuse()."""
        w = cls(module.w13, module.w2)
        w.p13, w.p2 = module._p13, module._p2
        return w

    def pack(self) -> None:
        """Pack for the CPU kernels when they apply (CPU bf16), as ``RoutedExperts.fuse`` does."""
        if self.w13 is not None and self.w13.shape[0] and can_pack(self.w13[0]):
            self.p13 = [pack_weight(w) for w in self.w13]
            self.p2 = [pack_weight(w) for w in self.w2]
            self.w13 = self.w2 = None

    def nbytes(self) -> int:
        ts = (self.p13 or []) + (self.p2 or []) + [t for t in (self.w13, self.w2) if t is not None]
        return sum(t.numel() * t.element_size() for t in ts if not t.is_mkldnn)


def expert_rows(xs: torch.Tensor, counts: list[int], wts: ExpertWeights, intermediate: int,
                act=silu_and_mul) -> torch.Tensor:
    """Gated-MLP expert outputs (``act``: SiLU-GLU by default, e.g. SiTU-GLU for Kimi K3) for rows sorted by
    expert.

    Args:
        xs: [P, H] rows, the ``counts[i]`` rows of expert i (in ``wts`` order) contiguous and in that order.
        counts: rows per expert of ``wts`` (zeros allowed).
        wts: the experts' weights. intermediate: I.

    Returns [P, H] in xs's dtype: row p = expert(xs[p]), with the same GEMMs and roundings as
    ``RoutedExperts.forward``'s per-expert paths (packed bf16: the VNNI GEMV / brgemm, bit-identical to the fused
    dispatch; otherwise ``silu_and_mul(x @ w13^T) @ w2^T`` per expert, which equals ``torch._grouped_mm``'s rows).
    """
    P, H = xs.shape
    if P == 0:
        return xs.new_empty(0, H)
    live = [(i, n) for i, n in enumerate(counts) if n]
    bounds, b = [], 0
    for _, n in live:
        bounds.append((b, b + n))
        b += n
    if wts.p13 is not None:
        if cpu_support.available_for(xs) and not any(wts.p13[i].is_mkldnn for i, _ in live):
            # all experts' gate_up GEMMs in one parallel region, then all down GEMMs in one more
            gu = cpu_vnni.vnni_linear_group([xs[s:e] for s, e in bounds], [wts.p13[i] for i, _ in live],
                                            [2 * intermediate] * len(live))
            mid = [act(g) for g in gu]
            return torch.cat(cpu_vnni.vnni_linear_group(mid, [wts.p2[i] for i, _ in live], [H] * len(live)))
        h = xs.new_empty(P, H)
        for (i, _), (s, e) in zip(live, bounds):
            h[s:e] = packed_linear(act(packed_linear(xs[s:e], wts.p13[i], None, 2 * intermediate)),
                                   wts.p2[i], None, H)
        return h
    h = xs.new_empty(P, H)
    for (i, _), (s, e) in zip(live, bounds):
        h[s:e] = act(xs[s:e] @ wts.w13[i].t()) @ wts.w2[i].t()
    return h


class HostExpertSplit:
    """The split of one :class:`~tokenfab.layers.moe.RoutedExperts` into device and host experts.

    Built by :func:`install` before the model moves to its device: the module's ``w13`` / ``w2`` parameters are
    cut down to its device experts (so ``model.to(device)``, ``fuse()`` and the memory accounting see only those)
    and the host experts' weights are kept here, in host memory, as plain tensors (not parameters: ``.to()`` leaves
    them on the host).

    Args:
        module: the RoutedExperts (range [start, end) of global ids).
        host_ids: global ids of this layer's host experts; those outside the module's range are ignored.
        worker: the shared :class:`HostExpertWorker`. stats: the shared :class:`HostExpertStats`.
        first_layer: True for the model's first split layer (it counts the forward passes).
    """

    def __init__(self, module, host_ids, worker: HostExpertWorker, stats: HostExpertStats, first_layer: bool):
        s, e = module.start, module.end
        host = sorted({int(j) for j in host_ids if s <= int(j) < e})
        self.host_local = [j - s for j in host]
        hs = set(self.host_local)
        self.device_local = [i for i in range(e - s) if i not in hs]
        self.worker, self.stats, self.first_layer = worker, stats, first_layer
        self.act = module.act
        self.out_fp32 = bool(module.accumulate_fp32)  # Kimi K3's latent MoE sums the experts in float32
        # experts with their own math (SiTU) run unpacked on the module too: the host keeps the same GEMMs
        from tokenfab.layers.moe import RoutedExperts
        self.packable = type(module).forward is RoutedExperts.forward
        w13, w2 = module.w13.data, module.w2.data
        hl = torch.tensor(self.host_local, dtype=torch.long)
        dl = torch.tensor(self.device_local, dtype=torch.long)
        self.host = ExpertWeights(w13.index_select(0, hl).cpu(), w2.index_select(0, hl).cpu())
        module.w13 = torch.nn.Parameter(w13.index_select(0, dl), requires_grad=False)
        module.w2 = torch.nn.Parameter(w2.index_select(0, dl), requires_grad=False)
        mask = torch.zeros(e - s, dtype=torch.bool)
        mask[hl] = True
        self._host_mask = mask  # per local expert: True = host (moved to the model's device lazily)
        self._mask_dev: torch.Tensor | None = None

    def finalize(self) -> None:
        """After ``post_load``: pack the host experts for the CPU kernels (CPU bf16), as ``fuse()`` packs the
        device ones (experts with their own math stay unpacked on both sides)."""
        if self.packable:
            self.host.pack()

    def host_bytes(self) -> int:
        """Bytes of this layer's host-resident expert weights."""
        return self.host.nbytes()

    def _host_job(self, xs_host: torch.Tensor, counts: list[int], intermediate: int) -> tuple[torch.Tensor, float]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            h = expert_rows(xs_host, counts, self.host, intermediate, self.act)
        return h, time.perf_counter() - t0

    def forward(self, module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden]; weights, ids [T, k] -> [T, hidden]: the module's output (see the module docstring)."""
        t_start = time.perf_counter()
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=module.num_experts)[module.start:module.end]
        lo = int((flat < module.start).sum()) if module.start else 0
        counts_l = counts.tolist()
        P = sum(counts_l)
        out = torch.zeros_like(x, dtype=torch.float32 if self.out_fp32 else x.dtype)
        if self.first_layer:
            self.stats.add(passes=1)
        if P == 0:
            return out
        order = order[lo:lo + P]
        token_of = order // k
        w_sorted = weights.reshape(-1)[order]
        if self._mask_dev is None or self._mask_dev.device != x.device:
            self._mask_dev = self._host_mask.to(x.device)
        is_host = self._mask_dev.repeat_interleave(counts)  # [P]: pair of a host expert
        host_counts = [counts_l[i] for i in self.host_local]
        dev_counts = [counts_l[i] for i in self.device_local]
        n_host = sum(host_counts)
        I, H = module.intermediate, x.shape[1]
        fut, copy_s = None, 0.0
        if n_host:
            t0 = time.perf_counter()
            host_idx = is_host.nonzero().squeeze(1)
            xs_host = x.index_select(0, token_of.index_select(0, host_idx))  # gathered rows of host pairs
            if xs_host.device.type != "cpu":
                buf = torch.empty(xs_host.shape, dtype=xs_host.dtype, pin_memory=True)
                xs_host = buf.copy_(xs_host)  # device -> host (waits for the rows, not for later work)
            copy_s += time.perf_counter() - t0
            fut = self.worker.submit(self._host_job, xs_host, host_counts, I)
        t0 = time.perf_counter()
        if n_host < P:
            dev_idx = (~is_host).nonzero().squeeze(1) if n_host else None
            xs_dev = x.index_select(0, token_of if dev_idx is None else token_of.index_select(0, dev_idx))
            h_dev = expert_rows(xs_dev, dev_counts, ExpertWeights.of_module(module), I, self.act)
            if x.device.type == "cuda":
                torch.cuda.current_stream(x.device).synchronize()  # device time, not launch time
        device_s = time.perf_counter() - t0
        wait_s = host_s = 0.0
        if fut is None:
            h = h_dev
        else:
            t0 = time.perf_counter()
            h_host, host_s = fut.result()
            wait_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            if n_host == P:
                h = h_host.to(x.device)
            else:
                h = x.new_empty(P, H)
                h[dev_idx] = h_dev
                h[host_idx] = h_host.to(x.device, non_blocking=True)
            copy_s += time.perf_counter() - t0
        out.index_add_(0, token_of, (h.to(w_sorted.dtype) * w_sorted[:, None]).to(out.dtype))
        e = x.element_size()
        self.stats.add(device_s=device_s, host_s=host_s, copy_s=copy_s, wait_s=wait_s, device_pairs=P - n_host,
                       host_pairs=n_host, bytes_to_host=n_host * H * e, bytes_to_device=n_host * H * e,
                       layer_calls=1)
        return out


def default_host_threads(device: torch.device) -> int:
    """The host side's intra-op threads when not given: every core next to an accelerator (the device side only
    launches kernels); half of this process's threads when the "device" is the CPU too (the two sides share it)."""
    if device.type != "cpu":
        return max(1, os.cpu_count() or 1)
    return max(1, torch.get_num_threads() // 2)


def moe_expert_modules(model) -> dict[int, object]:
    """{decoder layer index: its RoutedExperts} for every MoE layer of a tokenfab CausalLM."""
    from tokenfab.layers.moe import RoutedExperts
    out = {}
    for i, layer in enumerate(model.model.layers):
        mlp = getattr(layer, "mlp", None)
        experts = getattr(mlp, "experts", None) if mlp is not None else None
        if isinstance(experts, RoutedExperts):
            out[i] = experts
    return out


def install(model, placement, threads: int | None = None, device: torch.device | None = None) -> HostExpertStats:
    """Split every MoE layer of ``model`` (weights loaded, still on the host, before ``.to(device)``) by
    ``placement`` (:class:`~tokenfab.planner.expert_placement.ExpertPlacement`); returns the shared stats, also
    kept as ``model.host_expert_stats``. Call :func:`finalize` after ``post_load``.

    Raises:
        UnsupportedError: experts with their own forward but no ``act`` of their own (math the split cannot
            reproduce), or routed experts kept packed (tokenfab.quant.packed_experts).
    """
    from tokenfab.errors import UnsupportedError
    from tokenfab.layers.moe import RoutedExperts
    mods = moe_expert_modules(model)
    for i, m in mods.items():
        if type(m).forward is not RoutedExperts.forward and type(m).act is RoutedExperts.act:
            raise UnsupportedError(f"host experts: layer {i}'s {type(m).__name__} (its own expert math) has no host "
                                   "path yet; leave host_experts / --host-experts unset for this model.")
        if getattr(m, "q13", None) is not None:
            raise UnsupportedError(f"host experts: layer {i}'s routed experts are kept packed "
                                   f"({m.q13.format_name}, from the checkpoint's quantization_config) and the "
                                   "host/device split moves bf16 expert stacks only; leave host_experts / "
                                   "--host-experts and num_device_experts unset for this checkpoint.")
    worker = HostExpertWorker(threads or default_host_threads(device or torch.device("cpu")))
    stats = HostExpertStats()
    first = min(mods) if mods else None
    for i, m in mods.items():
        m.host = HostExpertSplit(m, placement.host_ids(i), worker, stats, i == first)
    model.host_expert_stats = stats
    model.host_expert_worker = worker
    return stats


def finalize(model) -> None:
    """After ``post_load``: pack the host experts of every split layer for the CPU kernels."""
    for m in moe_expert_modules(model).values():
        if getattr(m, "host", None) is not None:
            m.host.finalize()


def host_expert_bytes(model) -> int:
    """Bytes of host-resident expert weights over all split layers of ``model``."""
    return sum(m.host.host_bytes() for m in moe_expert_modules(model).values() if getattr(m, "host", None))
