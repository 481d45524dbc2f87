"""MMLU-Pro: 10-option multiple choice (letters A-J), lm-eval's ``mmlu_pro`` prompt and extraction.

Data: the published layout (TIGER-Lab/MMLU-Pro, JSONL or Parquet): ``question``, ``options`` (list of up to 10
strings), ``answer`` (the letter), ``category``; ``cot_content`` (the worked answer, starting ``"A: Let's think
step by step."``) in the validation split, which supplies the few-shot examples: the first ``num_fewshot``
validation rows of the question's category (lm-eval's ``first_n`` sampler per category).

Chain-of-thought format (``--mmlu-pro-format cot``, lm-eval's default): a per-category instruction ("The following
are multiple choice questions (with answers) about {category}. Think step by step and then finish your answer with
"the answer is (X)" where X is the correct letter choice."), the shots as ``Question:\\n... Options:\\nA. ...``
followed by their ``cot_content`` (``"A:"`` -> ``"Answer:"``), then the question ending in ``"Answer: Let's think
step by step."``; greedy, stop at ``"Question:"``, ``"Q:"``, ``"</s>"``, ``"<|im_end|>"``. Extraction: the first
match of ``answer is \\(?([ABCDEFGHIJ])\\)?`` (lm-eval's ``custom-extract``), else ``[invalid]``.

Direct format (``--mmlu-pro-format direct``): the same instruction and options, shots ending ``"Answer: The
answer is (X)."``, the question ending ``"Answer: The answer is ("``; the first letter A-J of the (2-token)
continuation is the choice.
"""
from __future__ import annotations

import re

from tokenfab.eval.tasks.data import find_split, read_rows, require_fields

NAME = "mmlu_pro"
LETTERS = "ABCDEFGHIJ"
DEFAULT_FEWSHOT = 5
STOP = ["Question:", "Q:", "</s>", "<|im_end|>"]
COT_RE = re.compile(r"answer is \(?([ABCDEFGHIJ])\)?")
DIRECT_RE = re.compile(r"^\s*\(?([ABCDEFGHIJ])")
FIELDS = ("question", "options", "answer", "category")
INVALID = "[invalid]"


def instruction(category: str) -> str:
    """lm-eval's per-category description (with its trailing newline)."""
    return (f"The following are multiple choice questions (with answers) about {category}. Think step by step and "
            "then finish your answer with \"the answer is (X)\" where X is the correct letter choice.\n")


def format_question(row: dict) -> str:
    """``Question:\\n{q}\\nOptions:\\nA. ...\\n`` (one line per option, lettered A-J)."""
    opts = "".join(f"{LETTERS[i]}. {o}\n" for i, o in enumerate(row["options"]))
    return f"Question:\n{row['question']}\nOptions:\n{opts}"


def format_shot(row: dict, fmt: str) -> str:
    """One solved example (lm-eval's ``fewshot_to_text``; direct: ``Answer: The answer is (X).``)."""
    if fmt == "direct":
        return format_question(row) + f"Answer: The answer is ({row['answer']}).\n\n"
    cot = str(row.get("cot_content") or "").replace("A: Let's think step by step.",
                                                     "Answer: Let's think step by step.")
    return format_question(row) + cot + "\n\n"


def build_prompt(row: dict, shots: list[dict], fmt: str) -> str:
    """Instruction + shots + the question, ending where the model's answer starts."""
    tail = "Answer: The answer is (" if fmt == "direct" else "Answer: Let's think step by step."
    return instruction(row["category"]) + "\n" + "".join(format_shot(s, fmt) for s in shots) + \
        format_question(row) + tail


def extract(completion: str, fmt: str) -> str:
    """The chosen letter, or ``[invalid]``."""
    m = (DIRECT_RE.search(completion) if fmt == "direct" else COT_RE.search(completion))
    return m.group(1) if m else INVALID


def _check_rows(rows: list[dict], path: str, flag: str) -> None:
    require_fields(rows, FIELDS, path, flag)
    from tokenfab.eval import usage_error
    for i, r in enumerate(rows):
        opts = r["options"]
        if not isinstance(opts, (list, tuple)) or not 2 <= len(opts) <= 10:
            raise usage_error(f"{flag}: row {i} of {path}: options must be a list of 2-10 strings.")
        if not (isinstance(r["answer"], str) and r["answer"] in LETTERS[:len(opts)]):
            raise usage_error(f"{flag}: row {i} of {path}: answer {r['answer']!r} is not one of the option letters "
                              f"{LETTERS[:len(opts)]}.")
        r["options"] = [str(o) for o in opts]


def load(path: str | None, fewshot_path: str | None, data_dir: str | None):
    """(test rows, validation rows or None, test path); ValueError naming the flag for missing files/fields."""
    from tokenfab.eval import usage_error
    path = path or find_split(data_dir, NAME, "test")
    if path is None:
        raise usage_error("mmlu_pro: give --mmlu-pro-file FILE (.jsonl or .parquet in MMLU-Pro's layout: question, "
                          "options, answer, category) or --data-dir DIR holding mmlu_pro/test.jsonl; nothing is "
                          "downloaded.")
    rows = read_rows(path, "--mmlu-pro-file")
    _check_rows(rows, path, "--mmlu-pro-file")
    fewshot_path = fewshot_path or find_split(data_dir, NAME, "validation")
    shots = None
    if fewshot_path:
        shots = read_rows(fewshot_path, "--mmlu-pro-fewshot-file")
        _check_rows(shots, fewshot_path, "--mmlu-pro-fewshot-file")
    return rows, shots, path


def evaluate(client, rows: list[dict], shots: list[dict] | None, *, num_fewshot: int | None, limit: int | None,
             mode: str, max_tokens: int, fmt: str = "cot", progress=None) -> dict:
    """Run MMLU-Pro; returns {"metrics": {"exact_match", per-category}, "n", "settings", "records"}."""
    k = DEFAULT_FEWSHOT if num_fewshot is None else num_fewshot
    if shots is None:
        k = 0
    if limit is not None:
        rows = rows[:limit]
    by_cat: dict[str, list[dict]] = {}
    for s in shots or []:
        by_cat.setdefault(s["category"], []).append(s)
    reqs = []
    for r in rows:
        text = build_prompt(r, by_cat.get(r["category"], [])[:k], fmt)
        req = {"messages": [{"role": "user", "content": text}]} if mode == "chat" else {"prompt": text}
        reqs.append({**req, "max_tokens": 2 if fmt == "direct" else max_tokens, "stop": STOP})
    outs = client.generate(reqs, progress)
    records = []
    for i, (r, out) in enumerate(zip(rows, outs)):
        pred = extract(out, fmt)
        records.append({"index": i, "category": r["category"], "answer": r["answer"], "predicted": pred,
                        "correct": pred == r["answer"], "completion": out})
    n = len(records)
    metrics = {"exact_match": (sum(x["correct"] for x in records) / n) if n else None}
    cats = sorted({x["category"] for x in records})
    per_cat = {c: sum(x["correct"] for x in records if x["category"] == c) /
               sum(1 for x in records if x["category"] == c) for c in cats}
    return {"metrics": metrics, "primary": "exact_match", "n": n, "per_category": per_cat,
            "settings": {"num_fewshot": k, "format": fmt, "mode": mode, "max_tokens": max_tokens,
                         "note": None if shots else "0-shot: no validation file (--mmlu-pro-fewshot-file)"},
            "records": records}
