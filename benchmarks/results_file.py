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


def write_lines(path: str, lines: list[str]) -> None:
    """Write ``lines`` to ``path``, one a line (Markdown tables and notes), replacing the file."""
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_markdown(folder: str, name: str, lines: list[str]) -> str:
    """Write ``lines`` (one Markdown line each) to ``<folder>/<name>`` (``name`` ending in .md; with a time suffix
    when that file exists, :func:`unused_stem`), creating the folder; print and return the path."""
    os.makedirs(folder, exist_ok=True)
    path = unused_stem(os.path.join(folder, name[:-3]), (".md",)) + ".md"
    write_lines(path, lines)
    print(f"wrote {path}")
    return path


def write_results(folder: str, stem: str, payload: dict, lines: list[str]) -> str:
    """Write ``payload`` to ``<folder>/<stem>.json`` and ``lines`` (Markdown, one per line) to ``<stem>.md`` (both
    with one time suffix when either exists, :func:`unused_stem`), creating the folder; print the table and the path,
    return the path without extension."""
    import json
    os.makedirs(folder, exist_ok=True)
    base = unused_stem(os.path.join(folder, stem))
    with open(base + ".json", "w") as f:
        json.dump(payload, f, indent=1)
    write_lines(base + ".md", lines)
    print("\n".join(lines))
    print(f"wrote {base}.md")
    return base
