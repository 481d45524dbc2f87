"""What ``tokenfab plan`` is given, as written on its command line: sizes (``288GiB``, ``141GB``), token counts
(``128K``, ``1Mi``), device-count lists (``4-8``) and the activation reserve (``10%`` or a size); and
:class:`PlanError`, the planner's error for an input it cannot use (:mod:`tokenfab.planner.memory_planner` raises it
too)."""
from __future__ import annotations

import re


class PlanError(ValueError):
    """Bad planner input (a size, a flag, a model path); the message names the flag or field."""

    user_error = True


_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_POW = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str | int, flag: str = "size") -> int:
    """Bytes from a size string: ``288GiB`` (2^30), ``141GB`` / ``80G`` (10^9), ``512MiB``, ``1.5TB``, ``1024``.

    Binary units need the ``i`` (KiB, MiB, GiB, TiB); K/M/G/T alone or with ``B`` are decimal.

    Raises:
        PlanError: the text is not a size; the message names ``flag``.
    """
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise PlanError(f"{flag}: cannot read '{text}' as a size; use e.g. 288GiB, 141GB or 80G "
                        "(GB/G = 10^9 bytes, GiB = 2^30 bytes)")
    num, unit, binary, _ = m.groups()
    base = 1024 if binary else 1000
    if binary and not unit:
        raise PlanError(f"{flag}: cannot read '{text}' as a size; use e.g. 288GiB, 141GB or 80G")
    return int(float(num) * base ** _POW[unit.lower()])


def parse_count(text: str | int | None, flag: str) -> int | None:
    """Token count from ``131072``, ``128K`` (10^3), ``1M`` (10^6), ``128Ki`` (2^10), ``1Mi`` (2^20).

    Raises:
        PlanError: not a count; the message names ``flag``.
    """
    if text is None or isinstance(text, int):
        return text
    m = re.match(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([kmg]?)(i?)\s*$", str(text), re.IGNORECASE)
    if not m or (m.group(3) and not m.group(2)):
        raise PlanError(f"{flag}: cannot read '{text}' as a token count; use e.g. 131072, 128K, 1M or 1Mi")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** _POW[m.group(2).lower()])


def parse_device_counts(text: str, flag: str = "--sweep-devices") -> list[int]:
    """Device counts from ``4-8`` (inclusive range), ``4,6,8`` or a mix (``4-6,8``); each >= 1.

    Raises:
        PlanError: anything else; the message names ``flag``.
    """
    counts: list[int] = []
    for part in str(text).split(","):
        m = re.match(r"^\s*([0-9]+)\s*(?:-\s*([0-9]+))?\s*$", part)
        if not m or int(m.group(1)) < 1 or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise PlanError(f"{flag}: cannot read '{text}' as device counts; use e.g. 4-8 or 4,6,8 (counts >= 1)")
        a, b = int(m.group(1)), int(m.group(2) or m.group(1))
        counts.extend(range(a, b + 1))
    return sorted(set(counts))


def parse_reserve(text: str | int | float, device_memory_bytes: int, flag: str = "--activation-reserve") -> int:
    """Reserve bytes from ``10%`` (of device memory) or a size such as ``8GiB``.

    Raises:
        PlanError: not a percentage in [0, 100) nor a size; the message names ``flag``.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    s = str(text).strip()
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            raise PlanError(f"{flag}: cannot read '{text}' as a percentage; use e.g. 10% or 8GiB") from None
        if not 0 <= pct < 100:
            raise PlanError(f"{flag}: {text} is outside [0%, 100%)")
        return int(device_memory_bytes * pct / 100)
    return parse_size(s, flag)
