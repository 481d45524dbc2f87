"""Decode step time against its memory-bandwidth floor, and engine overhead (step wall time minus model forward).

    .venv/bin/python benchmarks/decode_floor.py [--model DIR] [--context 512] [--batch 1,4,16] [--steps 30]
        [--load-format dummy] [--also-eager | --enforce-eager] [--also-sync] [--profile-steps N] [--device cuda]

For each batch size B: B sequences with ``--context`` prompt tokens are prefilled, then ``--steps`` decode steps are
timed. Reported per step: wall time of ``LLMEngine.step()``, time inside the model forward (+ logits; on a GPU the
device time between CUDA events around it, since its launches return before the device finishes), their difference
(engine overhead: scheduling, tensor building, sampling, output processing not hidden behind the device), and the
floor.
Where a CPU step runs forward, LM head and the draw in one C++ call (``CpuDecodeStack.run_sample``), that call is
the forward here: it includes the draw (~30 us at batch 1, ``cpu_sampling.sample_plain``), not the sampler's
Python, which runs before it and counts as overhead.

    floor = (bytes of weights a decode step must read + KV (and recurrent-state) bytes read) / copy bandwidth

Bytes read per step: every non-expert weight except the token-embedding table (a step reads one row of it per
sequence, unless the LM head shares it; counted as such since commit e11ac63 (2026-11-30), before which the whole
table was counted), plus the routed experts the batch's tokens hit: E x (1 - (1 - k/E)^B) distinct experts per MoE
layer (:func:`experts_hit`; exactly top_k for one token, all experts once B * top_k far exceeds E; the expectation
under uniform routing, which random weights give; a trained router's real choice can hit fewer), plus the KV cache
rows attended and, for KDA layers, each sequence's recurrent state. Copy bandwidth = 2 x bytes / time of
``dst.copy_(src)`` on a 512 MiB tensor (read + write traffic; both buffers in 2 MiB pages when the engine put its
weights there, the larger of that and 4 KiB pages at the start), measured in the same run: best of 5 at the start,
and one copy before every 5th timed step. This VM's bandwidth swings by up to 25% between back-to-back runs (e.g.
31.7 and 39.9 GB/s), so each floor uses the median of the copies taken between the steps it is compared with; the
table also gives the ratio at the start-of-run copy (best of 5; JSON keys ``floor_best_ms`` /
``ratio_to_best_floor``), which can be higher or lower. Before 2026-12-05 only batch 1 had a floor.

``--load-format dummy``: a config-only folder (benchmarks/gpu_shapes.py) with seeded random weights made on the
device, no weight file read. ``--also-eager``: after each batch's steps with decode CUDA graphs, as many eager steps
of the same sequences, graphs switched off in the same engine (``mode`` "eager" rows; the graph rows are "graphs",
which on CPU under ``TOKENFAB_DECODE_GRAPHS=eager`` are the padded buffers without capture). ``--also-sync``: where
the engine schedules asynchronously (GPU engines by default, engine/async_scheduling.py), also as many steps of the
first mode with each step scheduled after the previous step's ids arrived (``mode`` "<mode>-sync": what async
scheduling hides is the difference in ``step_ms`` and ``overhead_ms``); every row says ``async_scheduling``. ``--profile-steps N``:
after batch 1, N eager steps of one sequence under torch.profiler (benchmarks/decode_profile.py: device time, the
top kernels, launches per layer), in the JSON's ``profile``. When the engine with CUDA graphs cannot be built
(capture fails), an eager engine is measured instead and ``graphs_error`` says why.

Writes <--out, default benchmarks/results>/<date>[-<label>]-decode-floor.{json,md}; the JSON after every row too
(``complete`` false until the end, so a run stopped by a timeout leaves what it measured).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.results_file import unused_stem  # noqa: E402


def copy_bandwidth(nbytes: int = 512 << 20, reps: int = 5, device: str = "cpu", hugepages: bool = False) -> float:
    """Read+write bytes per second of a large tensor copy on ``device`` (best of ``reps``; GPU HBM on cuda).
    ``hugepages``: both buffers in 2 MiB pages, as the engine's weights are (tokenfab/engine/hugepages.py)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if hugepages:
        from tokenfab.engine.hugepages import move_to_hugepages
        move_to_hugepages([src, dst])
    src.fill_(1)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    dst.copy_(src)
    sync()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def weight_bytes(model) -> tuple[int, int, int]:
    """(non-expert weight bytes, bytes of one routed expert, number of routed experts per MoE layer summed)."""
    from tokenfab.layers.moe import RoutedExperts
    expert_params, stack_buffers = set(), set()
    per_expert = 0
    n_layers_experts = 0
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            if m.w13 is not None:
                for p in (m.w13, m.w2):
                    expert_params.add(id(p))
                per_expert = (m.w13[0].numel() + m.w2[0].numel()) * m.w13.element_size()  # gate, up, down
            elif m.q13 is not None:  # kept packed: the stacks' own bytes (codes and scales) per expert
                per_expert = (m.q13.nbytes + m.q2.nbytes) // m.q13.num_experts
                stack_buffers.update(id(b) for b in (*m.q13.buffers(), *m.q2.buffers()))
            else:  # repacked per expert for the CPU GEMMs (RoutedExperts.fuse): bf16 gate, up, down
                per_expert = 3 * m.intermediate * getattr(m, "hidden", model.cfg.hidden_size) * 2
            n_layers_experts += 1
    embed = getattr(model.model.embed_tokens, "weight", None)  # None: kept packed (PackedEmbedding, GGUF)
    packed_embed = getattr(model.model.embed_tokens, "qweight", None)
    if embed is not None and not model.cfg.tie_word_embeddings:  # untied: one embedding row per sequence
        expert_params.add(id(embed))
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in expert_params)
    if embed is not None and not model.cfg.tie_word_embeddings:
        dense += embed.shape[1] * embed.element_size()
    if packed_embed is not None and not model.cfg.tie_word_embeddings:  # its tiles are buffers, counted below
        dense -= packed_embed.nbytes - packed_embed.nbytes // packed_embed.out_features
    from tokenfab.layers.linear import Linear
    for m in model.modules():  # packed weights (tokenfab VNNI blocks or oneDNN) are no longer parameters
        if isinstance(m, Linear) and m._packed is not None:
            dense += m.in_features * m.out_features * 2
    if getattr(model, "_lm_head_packed", None) is not None:
        dense += model.cfg.vocab_size * model.cfg.hidden_size * 2
    dense += sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                 if "cos" not in n and "sin" not in n and id(b) not in stack_buffers)
    return dense, per_expert, n_layers_experts


def rss_bytes() -> int:
    """This process's resident set size (VmRSS of /proc/self/status), in bytes; 0 where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def resident_bytes(model, kv_caches) -> dict:
    """Bytes the loaded model holds: weights (parameters, buffers other than the RoPE tables, tokenfab's VNNI and
    GGUF packed copies; a tied table once), of them the compressed ones (PackedWeight), and the KV pool."""
    from tokenfab.layers.linear import Linear
    from tokenfab.quant.packed_weight import PackedWeight
    seen, weights = set(), 0
    tensors = list(model.parameters())
    tensors += [b for n, b in model.named_buffers() if "cos" not in n and "sin" not in n]
    tensors += [m._packed for m in model.modules() if isinstance(m, Linear) and m._packed is not None
                and not m._packed.is_mkldnn]
    if getattr(model, "_lm_head_packed", None) is not None and not model._lm_head_packed.is_mkldnn:
        tensors.append(model._lm_head_packed)
    for t in tensors:  # by tensor, not storage: the engine may place many weights in one 2 MiB-page arena
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            weights += t.numel() * t.element_size()
    packed = sum(m.nbytes for m in {id(m): m for m in model.modules() if isinstance(m, PackedWeight)}.values())
    flat = [c for entry in kv_caches for c in (entry if isinstance(entry, (list, tuple)) else [entry])]
    kv = sum(c.numel() * c.element_size() if isinstance(c, torch.Tensor)  # KDA state slots: their tensors
             else sum(t.numel() * t.element_size() for t in vars(c).values() if isinstance(t, torch.Tensor))
             for c in flat)
    return {"weight_bytes_resident": weights, "packed_weight_bytes": packed, "kv_pool_bytes": kv}


def _cell(v) -> str:
    """A table cell: two decimals, or an em dash where the floor applies to batch 1 only."""
    return "—" if v is None else f"{v:.2f}"


def experts_hit(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts ``tokens`` tokens hit in one MoE layer when each picks ``top_k`` of ``num_experts``
    uniformly (random weights route that way): E * (1 - (1 - k/E)^B). Exactly ``top_k`` for one token, all
    experts once B * k far exceeds E."""
    if num_experts <= 0 or top_k <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - min(top_k, num_experts) / num_experts) ** tokens)


def step_bytes(model, mc, dtype_bytes: int, batch: int, kv_tokens: int, kv_dtype_bytes: int | None = None) -> dict:
    """Bytes one decode step of ``batch`` sequences with ``kv_tokens`` tokens of context each must read: every
    non-expert weight once (:func:`weight_bytes`), the routed experts its tokens hit (expected distinct experts per
    MoE layer, :func:`experts_hit`), the KV rows attended (``kv_dtype_bytes`` a value: the pool's; default
    ``dtype_bytes``) and (hybrid KDA models) each sequence's recurrent state."""
    dense, per_expert, n_moe = weight_bytes(model)
    n_exp = getattr(mc, "num_experts", 0) or 0
    hit = experts_hit(n_exp, mc.num_experts_per_tok, batch) if n_moe else 0.0
    experts = int(per_expert * hit * n_moe)
    kv = mc.kv_cache_bytes_per_token(kv_dtype_bytes or dtype_bytes) * kv_tokens * batch
    state_fn = getattr(mc, "kda_state_bytes_per_request", None)
    state = int(state_fn(dtype_bytes)) * batch if callable(state_fn) else 0
    return {"bytes_read": dense + experts + kv + state, "weight_bytes_dense": dense, "weight_bytes_experts": experts,
            "experts_hit_per_layer": hit, "kv_bytes": kv, "state_bytes": state}


def pool_dtype_bytes(kv_caches: list) -> int | None:
    """The element size of the first KV pool tensor (None for a model with no paged tensors)."""
    for c in kv_caches:
        for t in (c if isinstance(c, (list, tuple)) else (c,)):
            if isinstance(t, torch.Tensor):
                return t.element_size()
    return None


def _write(stem: str, result: dict) -> None:
    """Write ``result`` to ``stem``.json now (also mid-run, ``complete`` False, so a step killed by a timeout
    leaves the rows it finished), through a temporary file renamed into place: a kill mid-write leaves the last
    whole file."""
    with open(stem + ".json.tmp", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(stem + ".json.tmp", stem + ".json")


def kv_blocks_for_batch(per_token: int, max_num_seqs: int, max_len: int, seqs: int, block_size: int) -> int | None:
    """KV blocks for ``seqs`` sequences of ``max_len`` tokens when the engine's default pool (the smaller of
    ``max_num_seqs`` x ``max_len`` tokens and DEFAULT_KV_CACHE_MEMORY bytes, ``per_token`` bytes a token) is
    smaller; None when the default holds them (or ``per_token`` is unknown, 0)."""
    from tokenfab.engine.engine_config import DEFAULT_KV_CACHE_MEMORY
    if per_token <= 0 or min(max_num_seqs * max_len, DEFAULT_KV_CACHE_MEMORY // per_token) >= seqs * max_len:
        return None
    return seqs * -(-max_len // block_size)


def make_llm(args):
    """The LLM for ``args`` and the error of a failed CUDA-graph engine (None when graphs were not wanted or
    captured): when the capture fails, an eager engine is built instead.

    The KV pool is the engine's default (the smaller of max_num_seqs x max_model_len tokens and 2 GiB) unless that
    cannot hold every sequence of the largest batch at full length: the 2 GiB cap holds ~18K
    tokens of the Llama-3.2-3B shape, 17 sequences of 1,024 tokens, so a batch of 64 would run 17 at a time. Then
    the pool is sized to hold them."""
    import traceback

    from tokenfab import LLM
    from tokenfab.default_model import ensure_default_model
    from tokenfab.engine.engine_config import EngineConfig, resolve_device, resolve_dtype, resolve_kv_cache_dtype
    model_dir = args.model or ensure_default_model()
    extra = (2 * args.steps if args.also_eager else 0) + (2 * args.steps if args.also_sync else 0)
    max_len = args.context + args.steps + extra + max(args.profile_steps, 0) + 24
    top = max(int(b) for b in args.batch.split(","))
    bs = EngineConfig.block_size
    kw = dict(max_model_len=max_len, max_num_seqs=max(64, top), block_size=bs, progress=False, device=args.device,
              load_format=args.load_format, seed=args.seed)
    try:
        from tokenfab.config import load_config
        dtype = resolve_dtype(args.dtype or "auto", resolve_device(args.device))
        kv_size = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype).itemsize
        per_token = load_config(model_dir).kv_cache_bytes_per_token(kv_size)
    except Exception:  # noqa: BLE001 - sized by the engine as before (it reports what it cannot read)
        per_token = 0
    blocks = kv_blocks_for_batch(per_token, kw["max_num_seqs"], max_len, top, bs)
    if blocks is not None:
        kw["num_kv_blocks"] = blocks
    if args.dtype:
        kw["dtype"] = args.dtype
    if args.tokenizer:
        kw["tokenizer"] = args.tokenizer
    kw["kv_cache_dtype"] = args.kv_cache_dtype
    try:
        return model_dir, LLM(model_dir, enforce_eager=args.enforce_eager, **kw), None
    except Exception as e:  # noqa: BLE001 - a failed CUDA-graph capture: measure eager, report the error
        in_capture = "cuda_graph_runner" in "".join(traceback.format_exception(type(e), e, e.__traceback__))
        if args.enforce_eager or not in_capture or not torch.cuda.is_available():
            raise
        import gc
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        err = f"{type(e).__name__}: {e}"[:500]
        print(f"decode_floor: engine with CUDA graphs failed ({err}); measuring eager only", flush=True)
        return model_dir, LLM(model_dir, enforce_eager=True, **kw), err


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default model)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (a GGUF file without one: "
                    "benchmarks/gpu_gguf.py writes it)")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per sequence (default: 512)")
    ap.add_argument("--batch", default="1,4,16", help="comma-separated batch sizes (default: 1,4,16)")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per batch size (default: 30)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--dtype", default=None, help="engine dtype (default: the engine's, bfloat16)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="KV pool dtype (EngineConfig.kv_cache_dtype; default auto: the engine dtype)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps (CUDA only)")
    ap.add_argument("--also-eager", action="store_true",
                    help="after each batch's steps with decode graphs, time as many eager steps on the same "
                         "sequences (graphs switched off in the same engine): both modes from one load")
    ap.add_argument("--also-sync", action="store_true",
                    help="where the engine schedules asynchronously, also time the first mode's steps with each "
                         "step scheduled after the previous one's ids arrived (same engine and sequences)")
    ap.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                    help="auto: the checkpoint's weights; dummy: seeded random weights at config.json's shapes, "
                         "no weight file read (a config-only folder, benchmarks/gpu_shapes.py)")
    ap.add_argument("--seed", type=int, default=0, help="engine seed (also the dummy weights') (default: 0)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after batch 1: this many eager steps of one sequence under torch.profiler, the top "
                         "kernels by device time and the launches per layer (benchmarks/decode_profile.py); 0: off")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"),
                    help="folder for the .json and .md results (default: benchmarks/results)")
    ap.add_argument("--label", default=None, help="label in the result file names: <date>-<label>-decode-floor.*")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from tokenfab import SamplingParams

    import transformers  # noqa: F401  (imported by loading anyway: its code is not the model's memory)
    rss_before = rss_bytes()  # interpreter, torch, transformers, tokenfab: before any weight is read
    t_load = time.perf_counter()
    model_dir, llm, graphs_error = make_llm(args)
    load_s = time.perf_counter() - t_load
    eng = llm.llm_engine
    runner = eng.runner
    import gc
    gc.collect()
    memory = {"rss_before_load": rss_before, "rss_after_load": rss_bytes(),
              **resident_bytes(runner.model, runner.kv_caches)}
    memory["rss_growth"] = memory["rss_after_load"] - rss_before
    print(json.dumps({"memory": memory, "load_s": load_s}), flush=True)
    fwd_time = [0.0]
    cuda = eng.device.type == "cuda"
    fwd_events: list = []  # CUDA: (start, end) events around each forward, read once the step has waited

    def timed(fn):
        """fn, adding its time to fwd_time[0]: wall time on the CPU; on a GPU the device time between events
        recorded before and after it (its launches return before the device is done; the step waits later, for
        the sampled ids), so forward_ms is the device's forward and overhead what the step adds beyond it."""
        def wrapper(*a, **k):
            t = time.perf_counter()
            start = None
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            try:
                return fn(*a, **k)
            finally:
                if cuda:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    fwd_events.append((start, end))
                else:
                    fwd_time[0] += time.perf_counter() - t
        return wrapper

    def settle_forward_time() -> None:
        """Add the device time of the forwards recorded since the last call (after a step: its events are done
        or about to be)."""
        for start, end in fwd_events:
            end.synchronize()
            fwd_time[0] += start.elapsed_time(end) / 1e3
        fwd_events.clear()

    runner.forward = timed(runner.forward)
    stack = runner.cpu_decode_stack  # CPU: decode steps may run forward + LM head + draw in one call (run_sample)
    if stack is not None:
        stack.run_sample = timed(stack.run_sample)
    huge = getattr(runner, "hugepage_bytes", 0) > 0  # weights in 2 MiB pages: so are the copy's buffers
    bw_4k = copy_bandwidth(device=str(eng.device))
    bw = max(bw_4k, copy_bandwidth(device=str(eng.device), hugepages=True)) if huge else bw_4k
    mc = eng.model_config
    graphs = runner.decode_graphs
    try:
        cpu = [l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")][0]
    except (OSError, IndexError):
        cpu = platform.processor()
    result = {"date": dt.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "label": args.label, "model": model_dir, "load_format": args.load_format,
              "model_type": mc.family if hasattr(mc, "family") else None,
              "num_layers": mc.num_hidden_layers, "dtype": str(eng.dtype), "kv_cache_dtype": args.kv_cache_dtype,
              "threads": torch.get_num_threads(),
              "cpu": cpu, "cores": os.cpu_count(), "copy_bandwidth_GBps": bw / 1e9,
              "copy_bandwidth_4k_pages_GBps": bw_4k / 1e9, "weights_in_huge_pages": huge, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(eng.device) if eng.device.type == "cuda" else None,
              "decode_graphs": graphs is not None and graphs.mode == "cuda",
              "decode_graph_buffers": graphs is not None, "graphs_error": graphs_error, "load_s": load_s,
              "memory": memory, "rows": [], "profile": None, "complete": False}
    os.makedirs(args.out, exist_ok=True)
    label = f"-{args.label}" if args.label else ""
    stem = unused_stem(os.path.join(args.out, f"{dt.date.today().isoformat()}{label}-decode-floor"))
    _write(stem, result)
    rows = result["rows"]
    modes = [("graphs" if graphs is not None else "eager", graphs)]
    if args.also_eager and graphs is not None:
        modes.append(("eager", None))
    if args.also_sync and eng.ahead is not None:  # the first mode again, scheduled in step
        modes.append((modes[0][0] + "-sync", graphs))
    ahead = eng.ahead is not None

    def timed_steps(B: int, mode: str, kv_start: int) -> tuple[dict, int]:
        """``args.steps`` timed decode steps of the running batch -> (one row, steps run in all).

        No step is followed by a wait of its own: with async scheduling a step returns while the device still
        computes it, and a wait here would empty the device's queue before the next step (the overlap being
        measured). The forwards' device times are read once the timed steps are done. The bandwidth copy every
        5th step does empty it; with async scheduling one untimed step after the copy refills it."""
        eng.step()  # first pure decode step of this mode (warm-up)
        ran = 1
        walls, fwds, bws, events = [], [], [], []
        for i in range(args.steps):
            if i % 5 == 0:  # copy bandwidth sampled between the steps it is compared with (one 512 MiB copy)
                bws.append(copy_bandwidth(reps=1, device=str(eng.device), hugepages=huge))
                if eng.ahead is not None:
                    eng.step()  # the copy waited for the step in flight: one step to have one in flight again
                    ran += 1
            fwd_time[0] = 0.0
            fwd_events.clear()
            t = time.perf_counter()
            eng.step()
            walls.append(time.perf_counter() - t)
            ran += 1
            fwds.append(fwd_time[0])  # CPU forwards: their wall time; GPU forwards: added below
            events.append(list(fwd_events))
        for j, ev in enumerate(events):  # GPU: device time between the events around each step's forward
            fwd_events[:] = ev
            fwd_time[0] = 0.0
            settle_forward_time()
            fwds[j] += fwd_time[0]
        running = len(eng.scheduler.running)  # < B: the pool or max_num_seqs held fewer (the row says so)
        if running != B:
            print(f"decode_floor: batch {B} ran {running} sequences per step", flush=True)
        wall, fwd = statistics.median(walls), statistics.median(fwds)
        bw_steps = statistics.median(bws)
        n = running if 0 < running <= B else B  # the sequences each timed step decoded
        row = {"batch": B, "running": running, "mode": mode, "context": args.context, "step_ms": wall * 1e3,
               "forward_ms": fwd * 1e3, "overhead_ms": (wall - fwd) * 1e3, "overhead_frac": (wall - fwd) / wall,
               "tokens_per_s": n / wall}
        read = step_bytes(runner.model, mc, eng.dtype.itemsize, n, kv_start + 1 + args.steps // 2,
                          pool_dtype_bytes(runner.kv_caches))
        row.update(read)
        nbytes = read["bytes_read"]
        row.update({"copy_bandwidth_during_steps_GBps": bw_steps / 1e9, "floor_ms": nbytes / bw_steps * 1e3,
                    "ratio_to_floor": wall / (nbytes / bw_steps), "floor_best_ms": nbytes / bw * 1e3,
                    "ratio_to_best_floor": wall / (nbytes / bw)})
        return row, ran

    for B in [int(b) for b in args.batch.split(",")]:
        per_mode = args.steps + 1 + (args.steps // 5 + 1 if ahead else 0)  # timed + warm-up (+ refills)
        sp = SamplingParams(max_tokens=len(modes) * per_mode + 3, ignore_eos=True)
        for i in range(B):
            eng.add_request(f"b{B}-{i}", None, [(7 * i + j) % 4000 + 5 for j in range(args.context)], sp)
        while any(s.num_computed_tokens < s.num_tokens - 1 for s in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()
        kv_start = args.context
        for mode, g in modes:
            runner.decode_graphs = g
            eng.set_async_scheduling(ahead and not mode.endswith("-sync"))
            try:
                row, ran = timed_steps(B, mode, kv_start)
                row["async_scheduling"] = eng.ahead is not None
            finally:
                runner.decode_graphs = graphs
                eng.set_async_scheduling(ahead)
            kv_start += ran
            rows.append(row)
            print(json.dumps(row), flush=True)
            _write(stem, result)
        while eng.has_unfinished_requests():
            eng.step()
        if B == 1 and args.profile_steps > 0:
            from benchmarks.decode_profile import profile_decode
            runner.decode_graphs = None  # eager: every kernel launched from the host, as the profile should see
            try:
                result["profile"] = profile_decode(eng, args.context, args.profile_steps)
                print(json.dumps({"profile": {k: v for k, v in result["profile"].items() if k != "top"}}),
                      flush=True)
            except Exception as e:  # noqa: BLE001 - e.g. no CUPTI: the profile is lost, the batch rows are not
                result["profile_error"] = f"{type(e).__name__}: {e}"[:500]
                print(f"decode_floor: profile failed ({result['profile_error']})", flush=True)
                eng.abort_request("profile-0")  # profile_decode's request, if it is still there
            finally:
                runner.decode_graphs = graphs
            _write(stem, result)
    result["complete"] = True
    _write(stem, result)
    lines = [f"# Decode step vs memory floor ({result['date']})", "", f"`{result['command']}`", "",
             (f"GPU: {result['gpu']} (decode CUDA graphs {'on' if result['decode_graphs'] else 'off'}), host " if
              result["gpu"] else "") +
             f"CPU: {cpu}, {os.cpu_count()} cores, {result['threads']} torch threads, torch {torch.__version__}, "
             f"dtype {result['dtype']}, KV cache {result.get('kv_cache_dtype', 'auto')}; "
             f"copy bandwidth {bw / 1e9:.1f} GB/s (read+write, best of 5 at the start"
             + (f", buffers in 2 MiB pages as the weights are; {bw_4k / 1e9:.1f} GB/s in 4 KiB pages" if huge else "")
             + "; each floor uses the median of the copies sampled every 5 steps between its steps)"
             + (f". Weights: {args.load_format} (seeded random, no weight file read)" if args.load_format == "dummy"
                else "") + (f". CUDA-graph engine failed: {graphs_error}" if graphs_error else ""), "",
             "| batch | mode | step ms | forward ms | engine overhead | tok/s | copy GB/s during steps | floor ms "
             "| step / floor | step / floor at the start copy |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bw_s = r.get("copy_bandwidth_during_steps_GBps")
        lines.append(f"| {r['batch']} | {r['mode']} | {r['step_ms']:.2f} | {r['forward_ms']:.2f} "
                     f"| {r['overhead_frac'] * 100:.1f}% | {r['tokens_per_s']:.1f} | {_cell(bw_s)} "
                     f"| {_cell(r.get('floor_ms'))} | {_cell(r.get('ratio_to_floor'))} "
                     f"| {_cell(r.get('ratio_to_best_floor'))} |")
    mib = 1 << 20
    r0 = rows[0] if rows and rows[0]["batch"] == 1 else None
    lines += ["", f"Bytes read per batch-1 step: {r0['bytes_read'] / mib:.1f} MiB (weights "
              f"{r0['weight_bytes_dense'] / mib:.1f} MiB, experts {r0['weight_bytes_experts'] / mib:.1f} MiB, KV "
              f"{r0['kv_bytes'] / mib:.1f} MiB, recurrent state {r0['state_bytes'] / mib:.1f} MiB); larger "
              "batches count the expected distinct experts their tokens hit (uniform routing)." if r0 else "", "",
              "Resident memory (process RSS, VmRSS): "
              f"{memory['rss_before_load'] / mib:.0f} MiB before loading (interpreter, torch, transformers, tokenfab), "
              f"{memory['rss_after_load'] / mib:.0f} MiB after: +{memory['rss_growth'] / mib:.0f} MiB for weights "
              f"{memory['weight_bytes_resident'] / mib:.1f} MiB (of them packed: "
              f"{memory['packed_weight_bytes'] / mib:.1f} MiB) + KV pool {memory['kv_pool_bytes'] / mib:.1f} MiB = "
              f"{(memory['weight_bytes_resident'] + memory['kv_pool_bytes']) / mib:.1f} MiB."]
    if result["profile"]:
        from benchmarks.decode_profile import profile_markdown
        lines += [""] + profile_markdown(result["profile"])
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
