"""Writing a benchmark's results where the scripts in benchmarks/ put them, never over an earlier result."""
from __future__ import annotations

import datetime as dt
import os


def unused_stem(stem: str, exts: tuple[str, ...] = (".md", ".json")) -> str:
    """``stem`` (a path without extension), or ``stem-HHMMSS`` when a file ``stem + ext`` already exists for one of
    ``exts``: result names carry the date (and a label), so a second run on the same day would otherwise overwrite a
    committed result."""
    if any(os.path.exists(stem + e) for e in exts):
        return f"{stem}-{dt.datetime.now().strftime('%H%M%S')}"
    return stem


def write_markdown(folder: str, name: str, lines: list[str]) -> str:
    """Write ``lines`` (one Markdown line each) to ``<folder>/<name>`` (``name`` ending in .md; with a time suffix
    when that file exists, :func:`unused_stem`), creating the folder; print and return the path."""
    os.makedirs(folder, exist_ok=True)
    path = unused_stem(os.path.join(folder, name[:-3]), (".md",)) + ".md"
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")
    return path
