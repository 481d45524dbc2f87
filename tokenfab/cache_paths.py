"""Where tokenfab keeps what it generates (the embedded default model, GGUF conversions): one cache folder."""
from __future__ import annotations

import os


def cache_dir() -> str:
    """Folder holding generated models: ``$TOKENFAB_CACHE`` or ``~/.cache/tokenfab``."""
    return os.environ.get("TOKENFAB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tokenfab")
