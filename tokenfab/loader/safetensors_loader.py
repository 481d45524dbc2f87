"""Read checkpoint tensors from safetensors files (single file or sharded with model.safetensors.index.json).

Every file's header is read and checked before any tensor is (:func:`read_header`): a truncated or unreadable file,
or a shard that the index names but the folder lacks, is a :class:`~tokenfab.errors.WeightLoadError` naming the file
and the tensors it holds, not a safetensors or torch stack trace.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Callable, Iterator

from tokenfab.errors import WeightLoadError

_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header (bytes)


def _names(names: list[str], k: int = 5) -> str:
    return ", ".join(names[:k]) + (f" ... ({len(names)} in all)" if len(names) > k else "")


def read_header(path: str) -> dict:
    """The JSON header of a safetensors file (tensor name -> {"dtype", "shape", "data_offsets"}; ``__metadata__``
    dropped), checked against the file's size.

    Format (safetensors spec): 8 bytes little-endian u64 N, N bytes of JSON, then the data; each tensor's
    ``data_offsets`` [begin, end) count bytes from the end of the header.

    Raises:
        WeightLoadError: naming ``path``: the file is shorter than its header says (truncated: the message names
            the tensors whose bytes are missing), or the header cannot be read.
    """
    name = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightLoadError(f"{path}: not a safetensors file ({size} bytes, shorter than the 8-byte header "
                                  "length); the file is truncated or empty: download or copy it again.")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise WeightLoadError(f"{path}: truncated or not a safetensors file: its header claims {n} bytes but "
                                  f"the file has {size}; download or copy {name} again.")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except ValueError as e:
        raise WeightLoadError(f"{path}: unreadable safetensors header ({e}); download or copy {name} again.") from None
    header.pop("__metadata__", None)
    data = size - 8 - n
    short = []
    for tname, info in header.items():
        try:
            end = int(info["data_offsets"][1])
        except (TypeError, KeyError, IndexError, ValueError):
            raise WeightLoadError(f"{path}: tensor {tname} has no valid data_offsets in the header; download or copy "
                                  f"{name} again.") from None
        if end > data:
            short.append((tname, end))
    if short:
        short.sort(key=lambda x: x[1])
        need = max(end for _, end in short)
        raise WeightLoadError(f"{path}: truncated: {len(short)} tensor(s) lie past its end ({_names([t for t, _ in short])}; "
                              f"the file has {data} data bytes, its header needs {need}); download or copy {name} "
                              "again.")
    return header


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of a checkpoint folder, in index order; each file's header is checked
    (:func:`read_header`).

    Raises:
        WeightLoadError: no safetensors weights, a shard named by the index is absent (the message names it and
            the tensors the index places in it), or a file is truncated / unreadable.
    """
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightLoadError(f"{index}: unreadable index (needs a JSON object with a weight_map of tensor name "
                                  f"-> file; {type(e).__name__}: {e}).") from None
        missing = [f for f in files if not os.path.isfile(os.path.join(model_dir, f))]
        if missing:
            held = [t for t, f in weight_map.items() if f == missing[0]]
            raise WeightLoadError(f"{model_dir}: shard {missing[0]} is missing (model.safetensors.index.json places "
                                  f"{_names(held)} in it)"
                                  + (f"; also missing: {', '.join(missing[1:])}" if len(missing) > 1 else "")
                                  + "; download or copy the missing shard(s).")
        paths = [os.path.join(model_dir, f) for f in files]
    else:
        names = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
        if not names:
            raise WeightLoadError(f"{model_dir}: no *.safetensors weights found (only safetensors checkpoints are "
                                  "supported; convert .bin files with transformers' save_pretrained).")
        paths = [os.path.join(model_dir, f) for f in names]
    for p in paths:
        read_header(p)
    return paths


class CheckpointWeights:
    """The tensors of a checkpoint folder as an iterable of ``(name, tensor)`` (stored dtype), with
    :meth:`file_of` naming the file each came from (for load errors).

    Args:
        model_dir: the checkpoint folder.
        progress: show a tqdm bar counting tensors.
        want: ``want(name)`` False skips a tensor before it is read (tensor-parallel ranks read only theirs).

    Raises (when iterated):
        WeightLoadError: a file is truncated / unreadable, or a tensor cannot be read (naming file and tensor).
    """

    def __init__(self, model_dir: str, progress: bool = True, want: Callable[[str], bool] | None = None):
        self.model_dir, self.progress, self.want = model_dir, progress, want
        self._file: dict[str, str] = {}

    def file_of(self, name: str) -> str | None:
        """The file name (no folder) that held tensor ``name``, once it was read; else None."""
        return self._file.get(name)

    def __iter__(self) -> Iterator[tuple[str, "torch.Tensor"]]:
        from safetensors import safe_open
        from tqdm import tqdm

        files = checkpoint_files(self.model_dir)
        handles = []
        for f in files:
            try:
                handles.append((f, safe_open(f, framework="pt")))
            except Exception as e:  # safetensors' own checks beyond read_header's (dtype names, overlaps ...)
                raise WeightLoadError(f"{f}: cannot open as safetensors ({type(e).__name__}: {e}); download or copy "
                                      f"{os.path.basename(f)} again.") from None
        total = sum(len(h.keys()) for _, h in handles)
        bar = tqdm(total=total, desc="Loading weights", unit="tensor", disable=not self.progress, leave=False)
        for f, h in handles:
            base = os.path.basename(f)
            for name in h.keys():
                bar.update(1)
                if self.want is not None and not self.want(name):
                    continue
                try:
                    t = h.get_tensor(name)
                except Exception as e:
                    raise WeightLoadError(f"{f}: cannot read tensor {name} ({type(e).__name__}: {e}).") from None
                self._file[name] = base
                yield name, t
        bar.close()


def iterate_weights(model_dir: str, progress: bool = True,
                    want: Callable[[str], bool] | None = None) -> CheckpointWeights:
    """(name, tensor) for every tensor in the checkpoint, in its stored dtype (the model's ``copy_`` casts to
    each parameter's dtype, so router weights kept in float32 stay exact): a :class:`CheckpointWeights`.

    ``want(name)`` may filter tensors before they are read (tensor parallel ranks read only their slices).
    A tqdm progress bar counts tensors.
    """
    return CheckpointWeights(model_dir, progress, want)
