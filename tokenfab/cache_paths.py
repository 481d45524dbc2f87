"""Where tokenfab keeps what it generates (the embedded default model, GGUF conversions): one cache folder, whose
folders are written whole or not at all (:func:`write_folder`)."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable


def cache_dir() -> str:
    """Folder holding generated models: ``$TOKENFAB_CACHE`` or ``~/.cache/tokenfab``."""
    return os.environ.get("TOKENFAB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tokenfab")


def write_folder(final: str, write: Callable[[str], None], marker: str) -> None:
    """Write cache folder ``final`` whole or not at all: ``write(tmp)`` fills a new temporary folder beside it,
    which is then renamed to ``final``. When the rename fails because another process put its own folder there
    first (``final/marker`` exists), that folder is kept.

    Raises:
        whatever ``write`` raises, and OSError when the folder cannot be made or renamed; the temporary folder is
        removed first.
    """
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(final))
    try:
        write(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first: keep its folder
            if not os.path.isfile(os.path.join(final, marker)):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
