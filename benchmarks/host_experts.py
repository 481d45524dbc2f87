"""Host-offloaded experts: the CPU side's measured cost, a stated model of the 4-device Kimi K3 step, and a short
served run of the default random DeepSeek-V3 with half its experts on the host.

    .venv/bin/python benchmarks/host_experts.py [--parts cpu,model,serve] [--rounds 3] [--out benchmarks/results]

Parts:

* ``cpu``: tokenfab's CPU expert kernels (``layers/host_experts.expert_rows``: the packed bf16 VNNI GEMV / brgemm,
  every expert's gate_up in one parallel region, then every down projection) on Kimi K3's routed-expert shape (latent
  3584 -> 2 x 3072 -> 3584, bf16 as tokenfab runs MXFP4 experts after dequantising them at load) for 1..16 tokens
  per expert, on 1 and 2 threads, interleaved ``--rounds`` times (best round's median). Reported: time per expert
  GEMV set, tokens/s per expert GEMV set, the bytes streamed per second per core, and the CPU cost per routed
  (token, expert) pair. Transfer sizes: a routed pair moves one latent row each way (3584 x 2 B).
* ``model``: the 4-device K3 step from the planner's split (4 x 288 GB, MXFP4 experts, device memory filled first)
  and the assumptions stated in the output (HBM, host DRAM and link bandwidths, batch, context), side by side with
  the same model on 6 devices (all experts on the devices), against the mission's measured 915 (4 devices) and
  5,661 (6 devices) total tok/s.
* ``serve``: ``tokenfab serve`` of the default random DeepSeek-V3 without offload and with ``--host-experts 50%``,
  alternating, each under the same short ``tokenfab bench serve`` run; the host-expert section of bench serve's
  result (from ``/metrics``) gives the time split.

Writes <out>/2026-12-01-host-experts.{md,json} (the command line included).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

K3 = dict(latent=3584, inter=3072, experts=896, top_k=16)


# ---------------------------------------------------------------------------------------------------- cpu
def part_cpu(rounds: int, n_experts: int = 4) -> dict:
    from tokenfab.layers.host_experts import ExpertWeights, expert_rows
    d, inter = K3["latent"], K3["inter"]
    torch.manual_seed(0)
    wts = ExpertWeights((torch.randn(n_experts, 2 * inter, d) * 0.02).bfloat16(),
                        (torch.randn(n_experts, d, inter) * 0.02).bfloat16())
    wts.pack()
    packed = wts.p13 is not None
    expert_bytes = 3 * d * inter * 2
    cases = [(t, n) for t in (1, 2) for n in (1, 2, 4, 8, 16)]
    times: dict[tuple, list[float]] = {c: [] for c in cases}
    cpu_times: dict[tuple, list[float]] = {c: [] for c in cases}  # process CPU seconds: robust to time slicing
    prev = torch.get_num_threads()
    for _ in range(rounds):
        for t, n in cases:
            torch.set_num_threads(t)
            xs = torch.randn(n * n_experts, d).bfloat16()
            counts = [n] * n_experts
            expert_rows(xs, counts, wts, inter)  # warm
            ts, cs = [], []
            for _ in range(5):
                t0, c0 = time.perf_counter(), time.process_time()
                expert_rows(xs, counts, wts, inter)
                ts.append(time.perf_counter() - t0)
                cs.append(time.process_time() - c0)
            times[(t, n)].append(statistics.median(ts))
            cpu_times[(t, n)].append(statistics.median(cs))
    torch.set_num_threads(prev)
    rows = []
    for (t, n), v in times.items():
        per_set = min(v) / n_experts
        cpu_set = min(cpu_times[(t, n)]) / n_experts  # core-seconds per expert set
        rows.append({"threads": t, "tokens_per_expert": n, "s_per_expert_set": per_set,
                     "tokens_per_s_per_expert_set": n / per_set,
                     "gb_per_s_per_core": expert_bytes / cpu_set / 1e9,
                     "us_per_routed_pair_per_core": cpu_set / n * 1e6, "core_s_per_expert_set": cpu_set,
                     "wall_gb_per_s": expert_bytes / per_set / 1e9, "rounds_s": v,
                     "rounds_cpu_s": cpu_times[(t, n)]})
    return {"packed_kernels": packed, "expert_shape": [d, inter], "expert_bytes_bf16": expert_bytes,
            "experts_per_call": n_experts, "rows": rows,
            "transfer_bytes_per_pair_each_way": d * 2}


# -------------------------------------------------------------------------------------------------- model
def k3_config() -> dict:
    """The published K3 text shape (tests/test_kimi_k3.py::test_plan_k3_shaped_config)."""
    full = [i for i in range(1, 94) if i % 4 == 0][:23] + [93]
    text = dict(vocab_size=163840, hidden_size=7168, intermediate_size=33792, moe_intermediate_size=3072,
                num_hidden_layers=93, num_attention_heads=96, kv_lora_rank=512, q_lora_rank=1536,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=896,
                num_experts_per_token=16, num_shared_experts=2, routed_scaling_factor=2.0, moe_renormalize=True,
                num_expert_group=1, topk_group=1, first_k_dense_replace=1, routed_expert_hidden_size=3584,
                latent_moe_use_norm=True, hidden_act="situ", activation_situ_beta=1.5,
                activation_situ_linear_beta=2.0, attn_res_block_size=12, mla_use_nope=True,
                mla_use_output_gate=True, model_max_length=1 << 20, rms_norm_eps=1e-5, model_type="kimi_linear",
                moe_router_activation_func="sigmoid", bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
                linear_attn_config={"kda_layers": [i for i in range(1, 94) if i not in full],
                                    "full_attn_layers": full, "num_heads": 96, "head_dim": 128,
                                    "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                                    "use_full_rank_gate": True})
    quant = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
             "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"]}},
             "ignore": ["re:.*shared_experts.*", "re:.*self_attn.*", "lm_head"]}
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text,
            "quantization_config": quant}


ASSUME = dict(device_memory=288e9, activation_reserve="3%", hbm_bytes_per_s=8.0e12, hbm_efficiency=0.6,
              host_dram_bytes_per_s=2 * 614e9, host_dram_efficiency=0.6, host_cores=2 * 96, pcie_bytes_per_s=55e9,
              c2c_bytes_per_s=450e9, link_latency_s=10e-6, context_tokens=2048)


def predict(mp, n_dev: int, batch: int, cpu_gbs_per_core: float, host_fmt_bytes: float, link_bps: float,
            a=ASSUME) -> dict:
    """Decode-step time of ``batch`` sequences on ``n_dev`` devices under plan ``mp`` (see the md for the model)."""
    E, k = K3["experts"], K3["top_k"]
    ep = mp.expert_placement
    L = 92  # MoE layers (first_k_dense_replace = 1 of 93)
    d = K3["latent"]
    active = 1 - (1 - k / E) ** batch  # chance an expert gets >= 1 of the batch's tokens
    host_layers = ep.num_host() if ep is not None else 0
    f_host = host_layers / (E * L)
    dev_expert_bytes = max(r.weight_bytes_by_class["experts"] - r.offloaded_bytes for r in mp.ranks)
    dense_bytes = max(r.weight_bytes - (r.weight_bytes_by_class["experts"] - r.offloaded_bytes) for r in mp.ranks)
    kv_read = batch * a["context_tokens"] * max(r.kv_bytes_per_token for r in mp.ranks)
    state_rw = 2 * batch * max(r.state_bytes for r in mp.ranks) / max(1, mp.max_num_seqs)  # KDA state read + write
    t_dev = (dense_bytes + active * dev_expert_bytes + kv_read + state_rw) / (a["hbm_bytes_per_s"] * a["hbm_efficiency"])
    host_bytes = active * host_layers * host_fmt_bytes  # every active host expert streams its weights once
    cpu_bps = min(a["host_cores"] * cpu_gbs_per_core * 1e9, a["host_dram_bytes_per_s"] * a["host_dram_efficiency"])
    t_host = host_bytes / cpu_bps
    host_pairs = f_host * batch * k * L
    t_link = 2 * host_pairs * d * 2 / (n_dev * link_bps) + (2 * L * a["link_latency_s"] if host_layers else 0)
    step = max(t_dev, t_host + t_link)
    return {"devices": n_dev, "batch": batch, "host_share_of_expert_layers": f_host, "t_device_s": t_dev,
            "t_host_s": t_host, "t_link_s": t_link, "step_s": step, "tok_per_s": batch / step,
            "host_bytes_per_step": host_bytes, "host_pairs_per_step": host_pairs}


def part_model(cpu: dict | None) -> dict:
    from tokenfab.planner import plan_memory
    a = ASSUME
    gbs = 6.0  # fallback per-core GEMV bandwidth when the cpu part did not run
    if cpu:
        best = max((r for r in cpu["rows"] if r["threads"] == 1), key=lambda r: r["gb_per_s_per_core"])
        gbs = best["gb_per_s_per_core"]
    cfg = k3_config()
    mx = 3 * K3["latent"] * K3["inter"] * (0.5 + 1 / 32)  # MXFP4: 4-bit values + one E8M0 scale per 32
    bf = 3 * K3["latent"] * K3["inter"] * 2
    rows, plans = [], {}
    for batch in (64, 256, 1024):
        # the KV pool holds the batch's contexts and the KDA state of its sequences; device memory filled first
        kw = dict(kv_tokens=batch * a["context_tokens"], max_num_seqs=batch, activation_reserve=a["activation_reserve"],
                  offload_experts=True)
        p4 = plan_memory(cfg, 4, int(a["device_memory"]), **kw)
        p6 = plan_memory(cfg, 6, int(a["device_memory"]), **kw)
        plans[batch] = {"4": p4.expert_placement.summary(), "4_fits": p4.fits, "6": p6.expert_placement.summary(),
                        "6_fits": p6.fits}
        for fmt, b in (("bf16 (tokenfab today: MXFP4 dequantised at load)", bf), ("mxfp4 kept packed", mx)):
            for link, bps in (("PCIe Gen5 x16", a["pcie_bytes_per_s"]), ("NVLink-C2C", a["c2c_bytes_per_s"])):
                rows.append(dict(predict(p4, 4, batch, gbs, b, bps), host_format=fmt, link=link))
        rows.append(dict(predict(p6, 6, batch, gbs, mx, a["pcie_bytes_per_s"]), host_format="mxfp4 kept packed",
                         link="PCIe Gen5 x16"))
    return {"assumptions": dict(a, cpu_gb_per_s_per_core=gbs), "plans": plans, "rows": rows,
            "mission_measured_tok_per_s": {"4": 915, "6": 5661}}


# -------------------------------------------------------------------------------------------------- serve
def part_serve(rounds: int, port: int = 8741) -> dict:
    from tokenfab.default_model import ensure_default_model
    model = ensure_default_model(quiet=True)
    exe = os.path.join(os.path.dirname(sys.executable), "tokenfab")
    runs = []
    for rnd in range(rounds):
        for label, extra in (("no offload", []), ("--host-experts 50%", ["--host-experts", "50%"])):
            srv = subprocess.Popen([exe, "serve", model, "--port", str(port), "--max-model-len", "1024", *extra],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                import urllib.request
                for _ in range(300):
                    try:
                        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                        break
                    except Exception:  # noqa: BLE001 (not up yet)
                        time.sleep(1)
                out = f"/tmp/host-experts-bench-{os.getpid()}.json"
                subprocess.run([exe, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--dataset-name",
                                "random", "--num-prompts", "16", "--random-input-len", "128", "--random-output-len",
                                "32", "--max-concurrency", "8", "--ignore-eos", "--save-result", "--result-filename",
                                out, "--power", "none"], check=True, stdout=subprocess.DEVNULL)
                with open(out) as f:
                    res = json.load(f)
            finally:
                srv.terminate()
                srv.wait(60)
            keep = {k: v for k, v in res.items() if k.startswith("host_experts_") or k in (
                "total_token_throughput", "output_throughput", "mean_tpot_ms", "mean_ttft_ms", "duration")}
            runs.append(dict(keep, label=label, round=rnd))
            print(label, rnd, keep, flush=True)
    return {"model": model, "bench": "--dataset-name random --num-prompts 16 --random-input-len 128 "
                                     "--random-output-len 32 --max-concurrency 8 --ignore-eos", "runs": runs}


# -------------------------------------------------------------------------------------------------- steps
def part_steps(rounds: int, batch: int = 8, steps: int = 12) -> dict:
    """Decode-step time of the default random DeepSeek-V3 (offline engine, bf16, ``batch`` sequences): the fused
    C++ decode stack without offload, the module path without offload (stack switched off), and the split with 0%
    and 50% of the experts on the host (the split takes the module path), interleaved ``rounds`` times; best
    round's median step."""
    from tokenfab import LLM, SamplingParams
    from tokenfab.default_model import ensure_default_model
    model = ensure_default_model(quiet=True)
    variants = [("stack, no offload", None, True), ("module path, no offload", None, False),
                ("split, 0% host", "0%", False), ("split, 50% host", "50%", False)]
    llms = {}
    for label, he, _ in variants:
        kw = {} if he is None else {"host_experts": he}
        llms[label] = LLM(model, progress=False, max_model_len=512, max_num_seqs=batch, **kw)
    med: dict[str, list[float]] = {v[0]: [] for v in variants}
    prompts = [{"prompt_token_ids": [10 + i + j for j in range(64)]} for i in range(batch)]
    for _ in range(rounds):
        for label, he, stack in variants:
            eng = llms[label].llm_engine
            keep = eng.runner.cpu_decode_stack
            if not stack:
                eng.runner.cpu_decode_stack = None
            sp = SamplingParams(temperature=0.0, max_tokens=steps + 2, min_tokens=steps + 2, ignore_eos=True)
            for i, p in enumerate(prompts):
                eng.add_request(f"r{len(med[label])}-{i}", None, p["prompt_token_ids"], sp)
            eng.step()  # the batch's prefill (512 tokens, one step under the 8192-token budget)
            ts = []
            while eng.has_unfinished_requests():
                t0 = time.perf_counter()
                eng.step()
                ts.append(time.perf_counter() - t0)
            eng.runner.cpu_decode_stack = keep
            med[label].append(statistics.median(ts))
    best = {k: min(v) for k, v in med.items()}
    base = best["stack, no offload"]
    return {"batch": batch, "rounds_s": med, "best_s": best, "ratio_to_stack": {k: v / base for k, v in best.items()}}


# ---------------------------------------------------------------------------------------------------- main
def render(res: dict, cmd: str) -> list[str]:
    L = ["# Host-offloaded experts: CPU cost, 4-device K3 model, served time split", "",
         f"Command: `{cmd}`", f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
         "(shared with other jobs: absolute times are noisy; the cpu rows are best-of-rounds)", ""]
    cpu = res.get("cpu")
    if cpu:
        L += ["## CPU expert kernels on K3's routed-expert shape (bf16, latent 3584, intermediate 3072)", "",
              f"One expert GEMV set = gate_up [6144 x 3584] + down [3584 x 3072] = {cpu['expert_bytes_bf16'] / 1e6:.1f}"
              f" MB of bf16 weights; packed VNNI kernels: {cpu['packed_kernels']}; {cpu['experts_per_call']} "
              f"experts per call. Transfer per routed pair: {cpu['transfer_bytes_per_pair_each_way']:,} B each way.",
              "", "Wall times share the cores with other jobs (load well above 2 during the run), so the per-core "
              "figures use the process's CPU time (core-seconds actually spent), best of the rounds.", "",
              "| threads | tokens / expert | wall ms / expert set | tokens/s / expert set (wall) | core-ms / expert set "
              "| GB/s per core | core-us per routed pair |", "|---|---|---|---|---|---|---|"]
        for r in cpu["rows"]:
            L.append(f"| {r['threads']} | {r['tokens_per_expert']} | {1e3 * r['s_per_expert_set']:.2f} | "
                     f"{r['tokens_per_s_per_expert_set']:,.0f} | {1e3 * r['core_s_per_expert_set']:.2f} | "
                     f"{r['gb_per_s_per_core']:.1f} | {r['us_per_routed_pair_per_core']:,.0f} |")
        L.append("")
    m = res.get("model")
    if m:
        a = m["assumptions"]
        L += ["## Model: K3 decode step on 4 devices with host experts vs 6 devices", "",
              f"Planner splits (288 GB devices, MXFP4 experts, reserve {a['activation_reserve']}, a KV pool of B x "
              f"{a['context_tokens']:,} tokens and the KDA state of B requests, device memory filled first):", ""]
        for b, p in m["plans"].items():
            L.append(f"* B = {b}: 4 devices: {p['4']} (fits: {p['4_fits']}); 6 devices: {p['6']} (fits: {p['6_fits']})")
        L += ["",
              "Model (per decode step of B sequences, each MoE layer's host and device sides overlapped):",
              "",
              "* device: (dense weights + P_active x device experts + B x context x KV bytes/token + 2 x B x KDA "
              f"state) / (HBM {a['hbm_bytes_per_s'] / 1e12:.0f} TB/s x {a['hbm_efficiency']}); P_active = 1 - "
              "(1 - 16/896)^B, the chance an expert gets one of the batch's tokens;",
              f"* host: P_active x host expert-layers x bytes per expert / min(cores {a['host_cores']} x measured "
              f"{a['cpu_gb_per_s_per_core']:.1f} GB/s per core, DRAM {a['host_dram_bytes_per_s'] / 1e9:.0f} GB/s x "
              f"{a['host_dram_efficiency']}) (the GEMVs stream each active expert once; memory-bound at these "
              "token counts);",
              f"* link: 2 x host pairs x 3584 x 2 B / (devices x link bandwidth) + 2 x 92 layers x "
              f"{a['link_latency_s'] * 1e6:.0f} us;",
              "* step = max(device, host + link); tok/s = B / step. Context "
              f"{a['context_tokens']:,} tokens per sequence; one 2-socket host for the 4 devices.", "",
              "| devices | B | host format | link | host share | device ms | host ms | link ms | step ms | tok/s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for r in m["rows"]:
            L.append(f"| {r['devices']} | {r['batch']} | {r['host_format']} | {r['link']} | "
                     f"{100 * r['host_share_of_expert_layers']:.1f}% | {1e3 * r['t_device_s']:.1f} | "
                     f"{1e3 * r['t_host_s']:.1f} | {1e3 * r['t_link_s']:.2f} | {1e3 * r['step_s']:.1f} | "
                     f"{r['tok_per_s']:,.0f} |")
        L += ["", "Mission measured: 915 total tok/s on 4 devices, 5,661 on 6 (ratio 0.16).", ""]
    st = res.get("steps")
    if st:
        L += [f"## Decode step, default random DeepSeek-V3, batch {st['batch']} (offline engine, bf16)", "",
              "| variant | best-round median step ms | ratio to the fused stack | rounds ms |", "|---|---|---|---|"]
        for k, v in st["best_s"].items():
            L.append(f"| {k} | {1e3 * v:.2f} | {st['ratio_to_stack'][k]:.2f} | "
                     + ", ".join(f"{1e3 * x:.1f}" for x in st["rounds_s"][k]) + " |")
        L.append("")
    s = res.get("serve")
    if s:
        L += ["## Served: default random DeepSeek-V3, no offload vs --host-experts 50% (alternating)", "",
              f"`tokenfab serve {s['model']} --max-model-len 1024 [--host-experts 50%]`, then `tokenfab bench serve "
              f"{s['bench']}`.", "",
              "| run | round | total tok/s | mean TPOT ms | device ms/pass | host ms/pass | copy ms/pass | wait "
              "ms/pass | host pairs |", "|---|---|---|---|---|---|---|---|---|"]
        for r in s["runs"]:
            g = lambda k, f=".2f": format(r[k], f) if k in r else "-"  # noqa: E731
            L.append(f"| {r['label']} | {r['round']} | {g('total_token_throughput')} | {g('mean_tpot_ms')} | "
                     f"{g('host_experts_device_ms_per_pass', '.3f')} | {g('host_experts_host_ms_per_pass', '.3f')} | "
                     f"{g('host_experts_copy_ms_per_pass', '.3f')} | {g('host_experts_wait_ms_per_pass', '.3f')} | "
                     + (f"{100 * r['host_experts_host_pair_share']:.1f}%" if "host_experts_host_pair_share" in r
                        else "-") + " |")
        L.append("")
    return L


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="cpu,model,serve")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    parts = args.parts.split(",")
    res: dict = {}
    if "cpu" in parts:
        res["cpu"] = part_cpu(args.rounds)
    if "model" in parts:
        res["model"] = part_model(res.get("cpu"))
    if "steps" in parts:
        res["steps"] = part_steps(args.rounds)
    if "serve" in parts:
        res["serve"] = part_serve(max(1, args.rounds - 1))
    cmd = " ".join([".venv/bin/python", "benchmarks/host_experts.py", *sys.argv[1:]])
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "2026-12-01-host-experts")
    if os.path.isfile(stem + ".json"):  # a run of other parts: keep them, replace the parts run now
        with open(stem + ".json") as f:
            old = json.load(f)
        cmds = old.pop("commands", [old.pop("command", "")])
        res = {**old, **res, "commands": [c for c in cmds if c] + [cmd]}
    else:
        res["commands"] = [cmd]
    cmd = "`; `".join(res["commands"])
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(stem + ".md", "w") as f:
        f.write("\n".join(render(res, cmd)) + "\n")
    print("\n".join(render(res, cmd)))


if __name__ == "__main__":
    main()
