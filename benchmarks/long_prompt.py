"""Long prompts on small random-weight models: exactness past the YaRN original window, wall time, and peak memory
against the planner's estimate, up to 131,072 tokens.

Models (written with tokenfab.testing.tiny_checkpoints): a 2-layer Llama (2 heads, 1 KV head, head_dim 16) and a
2-layer DeepSeek-V3 (MLA, 2 heads, MoE), both with YaRN rope scaling (original window 4,096, factor 32,
max_position_embeddings 131,072). Each tokenfab run is its own process (float32, chunked prefill with
max_num_batched_tokens = --chunk, a pool of exactly one max_model_len sequence), and records:

* RSS before the engine, after it is built (weights + KV pool), and its peak while the prompt is served (VmHWM
  after resetting it through /proc/self/clear_refs), against ``plan_memory``'s weights + KV bytes;
* the prompt logprobs of every position (prompt_logprobs=0) and the greedy next token.

References, each in its own process, on the same files:

* ``hf-eager``: transformers' own eager attention (float32), for lengths up to --eager-max-len (its [H, n, n]
  score tensor is what limits it here);
* ``hf-chunked``: the same transformers model code (rope/YaRN, MLA, MoE, norms) with an attention function
  registered through transformers' AttentionInterface that computes eager attention (matmul, scaling, causal mask,
  float32 softmax, matmul) in query chunks of 1,024 over the keys each chunk can see: no n x n tensor, so it runs
  at every length, 131,072 included. It shares no code with tokenfab's attention.

Exactness is max |tokenfab - reference| over the prompt logprobs at positions past the original window (all of
them, and --sample random ones listed in the JSON). ``--variants`` adds tokenfab with the key-block path turned off
(``old``: the pre-existing prefill paths at every length) to compare peak memory growth.

    .venv/bin/python benchmarks/long_prompt.py --lengths 16384,32768,65536,131072 --families llama,deepseek_v3
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
ORIGINAL_WINDOW = 4096
MAX_POS = ORIGINAL_WINDOW * 32
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0, "original_max_position_embeddings": ORIGINAL_WINDOW}
MODELS = {
    "llama": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=MAX_POS,
                  rope_parameters=YARN),
    "deepseek_v3": dict(num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=MAX_POS,
                        rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1)),
}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS (VmHWM) to the current RSS
        f.write("5")


def checkpoint(root: str, family: str) -> str:
    """The benchmark's checkpoint of ``family`` under ``root`` (written once)."""
    from tokenfab.testing.tiny_checkpoints import make_tiny_checkpoint
    from tokenfab.testing.tokenizer_builder import build_tokenizer
    tok = os.path.join(root, "tokenizer")
    if not os.path.isdir(tok):
        build_tokenizer(tok, vocab_size=512)
    return make_tiny_checkpoint(os.path.join(root, f"{family}-yarn"), family, vocab_size=512, tokenizer_dir=tok,
                                **MODELS[family])


def prompt(n: int, seed: int) -> list[int]:
    import numpy as np
    return np.random.default_rng(seed).integers(3, 512, n).tolist()


def child_tokenfab(a) -> dict:
    """One tokenfab run: RSS around engine start and prompt, prompt logprobs saved to ``a.npy``."""
    import numpy as np
    import torch
    torch.set_num_threads(a.threads)
    from tokenfab import LLM, SamplingParams
    from tokenfab.layers import long_context_attention as lca
    from tokenfab.planner.memory_planner import plan_memory
    if a.variant == "old":
        lca.LONG_CONTEXT_TOKENS = 1 << 62
    p = prompt(a.n, a.seed)
    rss0 = _status_kib("VmRSS")
    max_len = min(a.n + 8, MAX_POS)  # a 131,072-token prompt fills the window: its one output token ends it
    llm = LLM(a.ckpt, dtype="float32", device="cpu", max_model_len=max_len, max_num_seqs=1,
              max_num_batched_tokens=a.chunk, progress=False)
    rss1 = _status_kib("VmRSS")
    _reset_peak()
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    wall = time.perf_counter() - t
    peak = _status_kib("VmHWM")
    lp = np.array([out.prompt_logprobs[i][p[i]].logprob for i in range(1, a.n)], dtype=np.float32)
    np.save(a.npy, lp)
    cfg = llm.llm_engine.config
    mp = plan_memory(a.ckpt, 1, 1 << 40, max_model_len=max_len, kv_cache_dtype="float32", activation_reserve=0)
    pool_tokens = cfg.num_kv_blocks * cfg.block_size
    return {"wall_s": wall, "tok_per_s": a.n / wall, "greedy": out.outputs[0].token_ids[0],
            "rss_before_engine_mib": rss0 / 1024, "rss_after_engine_mib": rss1 / 1024, "rss_peak_mib": peak / 1024,
            "engine_rss_mib": (rss1 - rss0) / 1024, "prompt_growth_mib": (peak - rss1) / 1024,
            "kv_pool_tokens": pool_tokens,
            "planner": {"weight_bytes": mp.ranks[0].weight_bytes, "kv_bytes_per_token": mp.ranks[0].kv_bytes_per_token,
                        "kv_bytes": mp.ranks[0].kv_bytes_per_token * pool_tokens,
                        "estimate_mib": (mp.ranks[0].weight_bytes + mp.ranks[0].kv_bytes_per_token * pool_tokens)
                        / 2**20}}


def sample_positions(n: int, seed: int, k: int) -> list[int]:
    """k random prompt positions past the original window (sorted; the same in every process), plus n - 1."""
    import numpy as np
    rng = np.random.default_rng(seed + n)
    idx = rng.choice(np.arange(ORIGINAL_WINDOW, n - 1), size=min(k, n - 1 - ORIGINAL_WINDOW), replace=False)
    return sorted(int(i) for i in idx) + [n - 1]


LAST_LAYER_ROWS: list[int] | None = None  # set by child_reference: the last layer computes only these query rows


def chunked_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention (transformers' eager_attention_forward math: q k^T * scaling, causal mask, float32 softmax,
    p v) in query chunks of 1,024 over the keys each chunk can see. query [B, H, Q, D], key/value [B, Hk, L, *]
    with the queries the last Q of the L positions; returns ([B, Q, H, Dv], None). In the model's last layer, when
    LAST_LAYER_ROWS is set, only those query rows are computed (the others are zeros: logits are read at those
    positions only, and nothing after the last layer mixes positions)."""
    import torch
    if attention_mask is not None:
        raise ValueError("chunked_eager_attention: expects the causal-skip case (no padding mask)")
    B, H, Q, _ = query.shape
    g = H // key.shape[1]
    k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    L = k.shape[2]
    off = L - Q
    out = query.new_zeros(B, H, Q, v.shape[-1])
    last = getattr(module, "layer_idx", None) == module.config.num_hidden_layers - 1
    if last and LAST_LAYER_ROWS is not None:
        rows = torch.tensor(LAST_LAYER_ROWS)
        for a in range(0, len(rows), 64):
            r = rows[a:a + 64]
            s = torch.matmul(query[:, :, r], k.transpose(2, 3)) * scaling
            s.masked_fill_(torch.arange(L).view(1, -1) > (off + r).view(-1, 1), float("-inf"))
            out[:, :, r] = torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(query.dtype), v)
        return out.transpose(1, 2).contiguous(), None
    for a in range(0, Q, 1024):
        b = min(Q, a + 1024)
        s = torch.matmul(query[:, :, a:b], k[:, :, : off + b].transpose(2, 3)) * scaling
        hidden = torch.arange(off + b).view(1, -1) > (off + torch.arange(a, b)).view(-1, 1)
        s.masked_fill_(hidden, float("-inf"))
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(query.dtype)
        out[:, :, a:b] = torch.matmul(p, v[:, :, : off + b])
    return out.transpose(1, 2).contiguous(), None


def child_reference(a) -> dict:
    """transformers (float32) on the same prompt: eager or the registered chunked eager attention."""
    import numpy as np
    import torch
    torch.set_num_threads(a.threads)
    from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
    from transformers.masking_utils import sdpa_mask
    global LAST_LAYER_ROWS
    impl = "eager"
    if a.variant == "hf-sampled":
        LAST_LAYER_ROWS = sample_positions(a.n, a.seed, a.sample)
    if a.variant in ("hf-chunked", "hf-sampled"):
        AttentionInterface.register("chunked_eager", chunked_eager_attention)
        AttentionMaskInterface.register("chunked_eager", sdpa_mask)  # causal skip: no mask tensor at all
        impl = "chunked_eager"
    kw = dict(dtype=torch.float32, attn_implementation=impl)
    try:
        model = AutoModelForCausalLM.from_pretrained(a.ckpt, experts_implementation="eager", **kw).eval()
    except (TypeError, ValueError):
        model = AutoModelForCausalLM.from_pretrained(a.ckpt, **kw).eval()
    p = prompt(a.n, a.seed)
    _reset_peak()
    rss1 = _status_kib("VmRSS")
    t = time.perf_counter()
    with torch.no_grad():
        logits = model(torch.tensor([p])).logits[0]
        lp = torch.log_softmax(logits.float(), dim=-1)
    wall = time.perf_counter() - t
    greedy = int(lp[-1].argmax())
    tgt = lp[torch.arange(a.n - 1), torch.tensor(p[1:])].numpy().astype(np.float32)
    if LAST_LAYER_ROWS is not None:  # only the sampled rows are real: the rest become NaN (never compared)
        keep = np.zeros(a.n - 1, dtype=bool)
        keep[[i for i in LAST_LAYER_ROWS if i < a.n - 1]] = True
        tgt[~keep] = np.nan
    np.save(a.npy, tgt)
    return {"wall_s": wall, "greedy": greedy, "rss_peak_mib": _status_kib("VmHWM") / 1024,
            "prompt_growth_mib": (_status_kib("VmHWM") - rss1) / 1024}


def run_child(kind: str, variant: str, family: str, n: int, a, ckpt: str, npy: str) -> dict:
    """Run one child process (or, with --reuse, read the result it saved next to ``npy``)."""
    if a.reuse and os.path.exists(npy + ".json"):
        with open(npy + ".json") as f:
            return json.load(f)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--variant", variant, "--family", family,
           "--n", str(n), "--ckpt", ckpt, "--npy", npy, "--chunk", str(a.chunk), "--seed", str(a.seed),
           "--threads", str(a.threads), "--sample", str(a.sample)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": r.stderr[-2000:]}
    res = json.loads(r.stdout.strip().splitlines()[-1])
    with open(npy + ".json", "w") as f:
        json.dump(res, f)
    return res


def compare(got, want, n: int, seed: int, sample: int) -> dict:
    """|got - want| over positions past the window (those the reference computed: NaN rows of a sampled
    reference are skipped) and at the sampled positions."""
    import numpy as np
    d = np.abs(got.astype(np.float64) - want.astype(np.float64))
    past = d[ORIGINAL_WINDOW:]  # logprob of token i+1 given tokens 0..i, for positions i >= the original window
    past = past[~np.isnan(past)]
    idx = np.array([i for i in sample_positions(n, seed, sample) if i < n - 1])
    return {"max_abs_all": float(np.nanmax(d)), "max_abs_past_window": float(past.max()),
            "mean_abs_past_window": float(past.mean()), "positions_past_window": int(len(past)),
            "sampled_positions": idx.tolist(), "sampled_max_abs": float(d[idx].max()),
            "sampled": [[int(i), float(got[i]), float(want[i])] for i in idx[:16]]}


def render(paths: list[str], out_stem: str) -> None:
    """Merge result JSONs of this script into ``out_stem``.json and a Markdown table ``out_stem``.md."""
    docs = [json.load(open(p)) for p in paths]
    runs = [r for d in docs for r in d["runs"]]
    meta = docs[0]["meta"]
    meta["commands"] = [d["meta"]["command"] for d in docs]
    with open(out_stem + ".json", "w") as f:
        json.dump({"meta": meta, "runs": runs}, f, indent=1)
    L = ["# Long prompts up to 131,072 tokens: exactness past the YaRN window, time, memory", "",
         f"torch {meta['torch']}, transformers {meta['transformers']}, {meta['machine']} (shared with other jobs: "
         "times are noise, ratios within one run less so). Models: 2-layer random-weight Llama (2 heads, 1 KV head, "
         "head_dim 16) and DeepSeek-V3 (MLA, 2 heads, MoE), YaRN original window 4,096, factor 32. float32; chunked "
         f"prefill with max_num_batched_tokens {meta['chunk']}; key-block path above {meta['long_context_tokens']:,} "
         "context tokens. Commands:", ""]
    L += [f"    {c}" for c in meta["commands"]] + [""]
    L += ["## Exactness (|Δ prompt logprob| at every position past the original window, and at the sampled ones)", "",
          "| model | tokens | tokenfab vs | positions compared | max Δ past window | mean Δ | max Δ at the sampled | greedy equal |",
          "|---|---:|---|---:|---:|---:|---:|:---:|"]
    for r in runs:
        for k, c in r["exactness"].items():
            if "positions_past_window" not in c:
                continue
            L.append(f"| {r['family']} | {r['n']:,} | {k} | {c['positions_past_window']:,} | "
                     f"{c['max_abs_past_window']:.2e} | {c['mean_abs_past_window']:.2e} | {c['sampled_max_abs']:.2e} | "
                     f"{'yes' if c['greedy_equal'] else 'no'} |")
    for r in runs:
        for key in ("hf-chunked vs hf-eager", "hf-sampled vs hf-eager"):
            c = r["exactness"].get(key)
            if c:
                L.append(f"\nReference check, {r['family']} {r['n']:,}: {key} (transformers with the chunked eager "
                         f"attention vs transformers' own eager), max |Δ| {c['max_abs_all']:.2e}.")
    L += ["", "## Time and memory (tokenfab; RSS in MiB)", "",
          "Planner = `plan_memory` weights + KV bytes/token x the pool (one max_model_len sequence, float32 KV). "
          "Engine RSS = RSS after building the engine - before (weights, KV pool, kernels library, buffers). "
          "Prompt growth = peak RSS while serving the prompt - RSS after the engine was built (activations).", "",
          "| model | tokens | path | wall s | tok/s | planner MiB | engine RSS | prompt growth | peak RSS |",
          "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        for v, t in r["tokenfab"].items():
            if "error" in t:
                L.append(f"| {r['family']} | {r['n']:,} | {v} | error | | | | | |")
                continue
            L.append(f"| {r['family']} | {r['n']:,} | {'key blocks' if v == 'new' else 'whole context'} | "
                     f"{t['wall_s']:.1f} | {t['tok_per_s']:.0f} | {t['planner']['estimate_mib']:.1f} | "
                     f"{t['engine_rss_mib']:.0f} | {t['prompt_growth_mib']:.0f} | {t['rss_peak_mib']:.0f} |")
    L += ["", "References (transformers float32): wall s / peak RSS MiB", ""]
    for r in runs:
        for k, rr in r["reference"].items():
            if "error" not in rr:
                L.append(f"- {r['family']} {r['n']:,} {k}: {rr['wall_s']:.1f} s, peak RSS {rr['rss_peak_mib']:.0f} MiB "
                         f"(growth {rr['prompt_growth_mib']:.0f})")
            else:
                L.append(f"- {r['family']} {r['n']:,} {k}: failed ({rr['error'][-200:]!r})")
    with open(out_stem + ".md", "w") as f:
        f.write("\n".join(L) + "\n")
    print(f"wrote {out_stem}.md")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="16384,32768,65536,131072")
    ap.add_argument("--families", default="llama,deepseek_v3")
    ap.add_argument("--variants", default="new", help="tokenfab variants: new (key-block path) and/or old")
    ap.add_argument("--old-max-len", type=int, default=32768, help="run the old variant only up to this length")
    ap.add_argument("--references", default="hf-eager,hf-chunked")
    ap.add_argument("--eager-max-len", type=int, default=16384)
    ap.add_argument("--chunked-lengths", default="16384,131072", help="lengths that get the hf-chunked reference")
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--sample", type=int, default=256, help="random positions past the window compared per run")
    ap.add_argument("--sampled-lengths", default="", help="lengths that get the hf-sampled reference (chunked eager "
                    "attention, the last layer only at the sampled positions: half the cost)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--root", default=os.path.expanduser("~/.cache/tokenfab/bench-long-prompt"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "2026-12-01-long-prompt"))
    ap.add_argument("--render", nargs="+", default=None, metavar="JSON",
                    help="only merge these result JSONs into --out .json/.md")
    ap.add_argument("--reuse", action="store_true", help="reuse child results saved by an earlier run")
    ap.add_argument("--child", default=None)
    ap.add_argument("--variant", default="new")
    ap.add_argument("--family", default="llama")
    ap.add_argument("--n", type=int, default=0)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--npy", default=None)
    a = ap.parse_args(argv)
    if a.render:
        render(a.render, a.out)
        return 0
    if a.child:
        res = child_tokenfab(a) if a.child == "tokenfab" else child_reference(a)
        print(json.dumps(res))
        return 0

    import numpy as np
    import torch
    import transformers

    import tokenfab
    lengths = [int(x) for x in a.lengths.split(",")]
    chunked = {int(x) for x in a.chunked_lengths.split(",") if x}
    sampled = {int(x) for x in a.sampled_lengths.split(",") if x}
    os.makedirs(a.root, exist_ok=True)
    runs = []
    for family in a.families.split(","):
        ckpt = checkpoint(a.root, family)
        for n in lengths:
            row = {"family": family, "n": n, "tokenfab": {}, "reference": {}, "exactness": {}}
            for variant in filter(None, a.variants.split(",")):
                if variant == "old" and n > a.old_max_len:
                    continue
                npy = os.path.join(a.root, f"{family}-{n}-{variant}.npy")
                print(f"[{family} n={n}] tokenfab {variant} ...", flush=True)
                row["tokenfab"][variant] = run_child("tokenfab", variant, family, n, a, ckpt, npy)
                print("   ", {k: v for k, v in row["tokenfab"][variant].items() if k != "planner"}, flush=True)
            for ref in filter(None, a.references.split(",")):
                if ((ref == "hf-eager" and n > a.eager_max_len) or (ref == "hf-chunked" and n not in chunked)
                        or (ref == "hf-sampled" and n not in sampled)):
                    continue
                npy = os.path.join(a.root, f"{family}-{n}-{ref}.npy")
                print(f"[{family} n={n}] reference {ref} ...", flush=True)
                row["reference"][ref] = run_child("reference", ref, family, n, a, ckpt, npy)
                print("   ", row["reference"][ref], flush=True)
            for variant, tf in row["tokenfab"].items():
                if "error" in tf:
                    continue
                got = np.load(os.path.join(a.root, f"{family}-{n}-{variant}.npy"))
                for ref, rr in row["reference"].items():
                    if "error" in rr:
                        continue
                    want = np.load(os.path.join(a.root, f"{family}-{n}-{ref}.npy"))
                    c = compare(got, want, n, a.seed, a.sample)
                    c["greedy_equal"] = tf["greedy"] == rr["greedy"]
                    row["exactness"][f"{variant} vs {ref}"] = c
            if "hf-eager" in row["reference"] and "hf-chunked" in row["reference"]:
                e = np.load(os.path.join(a.root, f"{family}-{n}-hf-eager.npy"))
                c = np.load(os.path.join(a.root, f"{family}-{n}-hf-chunked.npy"))
                row["exactness"]["hf-chunked vs hf-eager"] = {"max_abs_all": float(np.abs(e - c).max())}
            if "hf-eager" in row["reference"] and "hf-sampled" in row["reference"]:
                e = np.load(os.path.join(a.root, f"{family}-{n}-hf-eager.npy"))
                c = np.load(os.path.join(a.root, f"{family}-{n}-hf-sampled.npy"))
                row["exactness"]["hf-sampled vs hf-eager"] = {"max_abs_all": float(np.nanmax(np.abs(e - c)))}
            runs.append(row)
    meta = {"command": "python benchmarks/long_prompt.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenfab": getattr(tokenfab, "__version__", "?"),
            "chunk": a.chunk, "models": MODELS, "original_window": ORIGINAL_WINDOW,
            "long_context_tokens": __import__("tokenfab.layers.long_context_attention",
                                              fromlist=["x"]).LONG_CONTEXT_TOKENS}
    from results_file import unused_stem
    stem = unused_stem(a.out)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "runs": runs}, f, indent=1)
    print(f"wrote {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
