"""Reading task data from local files: JSONL (optionally gzipped) or Parquet, in the datasets' published layouts."""
from __future__ import annotations

import gzip
import json
import os

from tokenfab.eval import usage_error
from tokenfab.jsonl import iter_jsonl


def read_rows(path: str, flag: str) -> list[dict]:
    """Rows of a ``.jsonl`` / ``.jsonl.gz`` / ``.json`` (a list) / ``.parquet`` file as dicts.

    Raises:
        ValueError (user error, names ``flag``): missing file, unknown extension, or a line that is not JSON.
    """
    if not os.path.isfile(path):
        raise usage_error(f"{flag}: no file at {path}.")
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise usage_error(f"{flag}: reading {path} needs pyarrow (pip install pyarrow), or give a JSONL copy.") \
                from None
        return pq.read_table(path).to_pylist()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        if path.endswith(".json"):
            data = json.load(f)
            if not isinstance(data, list):
                raise usage_error(f"{flag}: {path} must hold a JSON list of rows (or use JSONL).")
            return data
        def bad_line(i, e):
            return usage_error(f"{flag}: {path} line {i} is not JSON ({e.msg}).")

        return [row for _, row in iter_jsonl(f, bad_line)]


def require_fields(rows: list[dict], fields: tuple[str, ...], path: str, flag: str) -> None:
    """ValueError naming the first row and field missing from ``rows`` (the published layout's field names)."""
    if not rows:
        raise usage_error(f"{flag}: {path} has no rows.")
    for i, r in enumerate(rows):
        missing = [f for f in fields if f not in r]
        if missing:
            raise usage_error(f"{flag}: row {i} of {path} lacks field(s) {missing}; the file must use the "
                              f"dataset's published layout ({', '.join(fields)}).")


def find_split(data_dir: str | None, task: str, split: str) -> str | None:
    """``DATA_DIR/<task>/<split>.(jsonl|jsonl.gz|parquet)`` or ``DATA_DIR/<task>_<split>.*`` if present."""
    if not data_dir:
        return None
    for stem in (os.path.join(data_dir, task, split), os.path.join(data_dir, f"{task}_{split}")):
        for ext in (".jsonl", ".jsonl.gz", ".parquet", ".json"):
            if os.path.isfile(stem + ext):
                return stem + ext
    return None
