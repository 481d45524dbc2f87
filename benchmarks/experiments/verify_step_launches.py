"""Device launches of a speculative verification step of a hybrid model on the GPU code path, counted on CPU.

The tiny Kimi K3 of tests/test_kimi_k3.py (4 layers: KDA + dense MLP, gated MLA + MoE, two KDA + MoE; MXFP4
experts) with a random DSpark drafter tapping layers 0 and 2, 3 drafts at every step, 4 sequences of 20-29 tokens, 8 tokens each, greedy. The GPU
code path runs on CPU (Triton's interpreter, the C++ CPU kernels off), and tokenfab/testing/kernel_count.py counts
what a GPU would launch (its rule: Triton launches and ATen ops that launch a kernel). Per verification step of
the target (``ModelRunner.forward`` plus ``ModelRunner.commit_state``; the drafter's own pass is not counted):

* modules: ``TOKENFAB_DECODE_GRAPHS=0``, every launch from the host;
* graphs: ``TOKENFAB_DECODE_GRAPHS=eager``, the padded buffers without capture: the launches inside the buffers'
  forward and commit are those CUDA captures (two replays a step), the rest stay launches from the host.

    PYTHONPATH=.:tests .venv/bin/python benchmarks/experiments/verify_step_launches.py
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", ".."), os.path.join(HERE, "..", "..", "tests")]
os.environ.update(TRITON_INTERPRET="1", TOKENFAB_TRITON="interpret-gpu-path", TOKENFAB_CPU_KERNELS="0",
                  TOKENFAB_CPU_LINEAR="torch")


def run(mode: str, target: str, drafter: str) -> dict:
    os.environ["TOKENFAB_DECODE_GRAPHS"] = mode
    from tokenfab import LLM, SamplingParams
    from tokenfab.kernels.cpu import build as cpu_build
    from tokenfab.testing.kernel_count import KernelCounter
    cpu_build.load = lambda: None  # a GPU machine has no C++ CPU kernels loaded
    from test_spec_dspark import ALWAYS
    llm = LLM(target, dtype="float32", device="cpu", max_model_len=96, max_num_seqs=8, progress=False,
              speculative_config=dict(ALWAYS, method="dspark", model=drafter, num_speculative_tokens=3))
    runner = llm.llm_engine.runner
    graphs = runner.decode_graphs
    steps = []  # per target forward: {"verify": bool, "host": launches from the host, "captured": in a capture}
    fwd, commit = runner.forward, runner.commit_state

    def counted(fn, key):
        def call(*a, **kw):
            kc = KernelCounter()
            with kc, kc.scope("x"):
                out = fn(*a, **kw)
            if steps:
                steps[-1][key] = steps[-1].get(key, 0) + kc.total("x")
            return out
        return call

    def forward(*a, **kw):
        hold = kw.get("hold")
        steps.append({"verify": hold is not None and bool(hold.any())})
        return counted(fwd, "host")(*a, **kw)

    runner.forward = forward
    runner.commit_state = counted(commit, "host")
    if graphs is not None:  # launches a capture holds, counted apart (they are inside the host's count too)
        graphs.forward = counted(graphs.forward, "captured")
        graphs._commit = counted(graphs._commit, "captured")
    prompts = [{"prompt_token_ids": list(range(5 + i, 25 + 3 * i))} for i in range(4)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    v = [s for s in steps if s["verify"]]
    host = [s["host"] - s.get("captured", 0) for s in v]
    return {"verify_steps": len(v), "host_median": statistics.median(host) if host else None,
            "captured_median": statistics.median([s.get("captured", 0) for s in v]) if v else None,
            "graph_verify_steps": 0 if graphs is None else graphs.verify_replays}


def main() -> None:
    from test_kimi_k3 import TEXT, k3_tensors, write_k3
    from tokenfab.testing.tiny_dspark import write_tiny_dspark
    from tokenfab.testing.tokenizer_builder import build_tokenizer
    from test_spec_dspark import K3_5MLA
    root = tempfile.mkdtemp()
    tok = build_tokenizer(os.path.join(root, "tok"), vocab_size=512)
    stored, _ = k3_tensors(TEXT, seed=5)
    target = write_k3(os.path.join(root, "k3"), tok, tensors=stored)
    drafter, _, _ = write_tiny_dspark(os.path.join(root, "d"), "specforge", K3_5MLA, block_size=4,
                                      target_layer_ids=(0, 2), target_num_layers=TEXT["num_hidden_layers"], seed=3)
    print("| path | verification steps | launches from the host per step (median) | launches in captures |")
    print("|---|---:|---:|---:|")
    for mode, name in (("0", "modules"), ("eager", "graph buffers")):
        r = run(mode, target, drafter)
        print(f"| {name} | {r['verify_steps']} (from the buffers: {r['graph_verify_steps']}) | "
              f"{r['host_median']} | {r['captured_median']} (2 replays) |" if mode == "eager" else
              f"| {name} | {r['verify_steps']} | {r['host_median']} | - |")


if __name__ == "__main__":
    main()
