"""GSM8K (grade-school math word problems), n-shot, scored the way lm-eval's ``gsm8k`` task scores it.

Data: the published JSONL layout, one object per line with ``question`` and ``answer`` (the worked solution ending
in ``#### N``). Few-shot examples are the first ``num_fewshot`` rows of the train file (lm-eval's ``first_n``
sampler over the train split); without a train file they are the first rows of the test file, which are then not
scored (the result says so).

Prompt (lm-eval ``gsm8k.yaml``): each shot ``"Question: {q}\\nAnswer: {a}"`` joined by ``"\\n\\n"``, then
``"Question: {q}\\nAnswer:"``; greedy, stop at ``"Question:"``, ``"</s>"``, ``"<|im_end|>"``. In chat mode the same
text is the one user message.

Answer extraction (lm-eval's two filters):

* strict-match: the first ``#### N`` (regex ``#### (\\-?[0-9\\.\\,]+)``);
* flexible-extract: the last number (regex ``(-?[$0-9.,]{2,})|(-?[0-9]+)``, last match).

Both are compared with exact_match after lm-eval's ``regexes_to_ignore`` (``,``, ``$``, everything up to
``#### ``, a trailing ``.``) on prediction and reference, case-insensitive. No match gives ``[invalid]``.
"""
from __future__ import annotations

import re

from tokenfab.eval.tasks.data import find_split, read_rows, require_fields

NAME = "gsm8k"
DEFAULT_FEWSHOT = 5
STOP = ["Question:", "</s>", "<|im_end|>"]
STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE_RE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
IGNORE_RES = [re.compile(","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$")]
INVALID = "[invalid]"


def regex_extract(text: str, pattern: re.Pattern, group_select: int = 0) -> str:
    """lm-eval's RegexFilter: ``findall``, take match ``group_select``, its first non-empty group, stripped;
    ``[invalid]`` when nothing matches."""
    found = pattern.findall(text)
    if not found:
        return INVALID
    m = found[group_select]
    if isinstance(m, tuple):
        m = next((g for g in m if g), INVALID)
    return m.strip()


def normalize(s: str) -> str:
    """lm-eval's exact_match preparation for GSM8K: regexes_to_ignore removed, lower-cased."""
    for r in IGNORE_RES:
        s = r.sub("", s)
    return s.strip().lower()


def reference_answer(answer: str) -> str:
    """The number after ``####`` of a GSM8K solution, normalized ("1,234" -> "1234")."""
    return normalize(answer)


def score(completion: str, answer: str) -> dict:
    """Both filters on one completion: {"strict": str, "flexible": str, "strict_match": bool,
    "flexible_extract": bool, "target": str}."""
    target = reference_answer(answer)
    strict = regex_extract(completion, STRICT_RE, 0)
    flexible = regex_extract(completion, FLEXIBLE_RE, -1)
    return {"target": target, "strict": strict, "flexible": flexible,
            "strict_match": normalize(strict) == target, "flexible_extract": normalize(flexible) == target}


def load(path: str | None, fewshot_path: str | None, data_dir: str | None) -> tuple[list[dict], list[dict] | None,
                                                                                          str]:
    """(test rows, train rows or None, test path). Raises ValueError naming the flag for a missing file/field."""
    from tokenfab.eval import usage_error
    path = path or find_split(data_dir, NAME, "test")
    if path is None:
        raise usage_error("gsm8k: give --gsm8k-file FILE.jsonl (question/answer rows, the dataset's test split) or "
                          "--data-dir DIR holding gsm8k/test.jsonl; nothing is downloaded.")
    rows = read_rows(path, "--gsm8k-file")
    require_fields(rows, ("question", "answer"), path, "--gsm8k-file")
    fewshot_path = fewshot_path or find_split(data_dir, NAME, "train")
    shots = None
    if fewshot_path:
        shots = read_rows(fewshot_path, "--gsm8k-fewshot-file")
        require_fields(shots, ("question", "answer"), fewshot_path, "--gsm8k-fewshot-file")
    return rows, shots, path


def build_prompt(shots: list[dict], question: str) -> str:
    """The n-shot prompt text (lm-eval's layout)."""
    parts = [f"Question: {s['question']}\nAnswer: {s['answer']}" for s in shots]
    parts.append(f"Question: {question}\nAnswer:")
    return "\n\n".join(parts)


def make_requests(rows: list[dict], shots: list[dict], mode: str, max_tokens: int) -> list[dict]:
    """Generation requests (see :mod:`tokenfab.eval.tasks.client`) for ``rows``."""
    out = []
    for r in rows:
        text = build_prompt(shots, r["question"])
        req = {"messages": [{"role": "user", "content": text}]} if mode == "chat" else {"prompt": text}
        out.append({**req, "max_tokens": max_tokens, "stop": STOP})
    return out


def evaluate(client, rows: list[dict], shots: list[dict] | None, *, num_fewshot: int | None, limit: int | None,
             mode: str, max_tokens: int, progress=None) -> dict:
    """Run GSM8K; returns {"metrics": {"strict_match", "flexible_extract"}, "n", "settings", "records"}."""
    k = DEFAULT_FEWSHOT if num_fewshot is None else num_fewshot
    note = None
    if shots is None:
        shots, rows = rows[:k], rows[k:]
        note = f"few-shot examples: the first {k} rows of the test file (not scored); pass --gsm8k-fewshot-file"
    shots = shots[:k]
    if limit is not None:
        rows = rows[:limit]
    reqs = make_requests(rows, shots, mode, max_tokens)
    outs = client.generate(reqs, progress)
    records = []
    for i, (r, out) in enumerate(zip(rows, outs)):
        records.append({"index": i, "question": r["question"], "completion": out, **score(out, r["answer"])})
    n = len(records)
    metrics = {m: (sum(x[m] for x in records) / n if n else None) for m in ("strict_match", "flexible_extract")}
    return {"metrics": metrics, "primary": "flexible_extract", "n": n,
            "settings": {"num_fewshot": len(shots), "mode": mode, "max_tokens": max_tokens, "note": note},
            "records": records}
