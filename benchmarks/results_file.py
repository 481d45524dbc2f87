"""Writing a benchmark's Markdown result where the scripts in benchmarks/ put them."""
from __future__ import annotations

import os


def write_markdown(folder: str, name: str, lines: list[str]) -> str:
    """Write ``lines`` (one Markdown line each) to ``<folder>/<name>``, creating the folder; print and return the
    path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")
    return path
