"""Reading JSONL (one JSON value a line), the layout of benchmark datasets and evaluation data files."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def iter_jsonl(lines: Iterable[str],
               bad_line: Callable[[int, json.JSONDecodeError], BaseException]) -> Iterator[tuple[int, Any]]:
    """Yield (line number from 1, parsed value) for each non-blank line of ``lines`` (e.g. an open text file).

    Raises:
        ``bad_line(lineno, error)``, the caller's exception naming its file or flag, for a line that is not JSON
        (raised ``from None``).
    """
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise bad_line(lineno, e) from None
        yield lineno, value
