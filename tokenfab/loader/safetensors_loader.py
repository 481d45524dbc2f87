"""Read checkpoint tensors from safetensors files (single file or sharded with model.safetensors.index.json)."""
from __future__ import annotations

import json
import os
from typing import Callable, Iterator

from tokenfab.errors import WeightLoadError


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of a checkpoint folder, in index order.

    Raises:
        WeightLoadError: no safetensors weights, or a shard named by the index is absent.
    """
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(model_dir, f))]
        if missing:
            raise WeightLoadError(f"{model_dir}: shards named in model.safetensors.index.json are missing: {missing}")
        return [os.path.join(model_dir, f) for f in files]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise WeightLoadError(f"{model_dir}: no *.safetensors weights found (only safetensors checkpoints are "
                              "supported; convert .bin files with transformers' save_pretrained).")
    return [os.path.join(model_dir, f) for f in files]


def iterate_weights(model_dir: str, progress: bool = True,
                    want: Callable[[str], bool] | None = None) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Yield (name, tensor) for every tensor in the checkpoint, in its stored dtype (the model's ``copy_`` casts to
    each parameter's dtype, so router weights kept in float32 stay exact).

    ``want(name)`` may filter tensors before they are read (tensor parallel ranks read only their slices).
    A tqdm progress bar counts tensors.
    """
    from safetensors import safe_open
    from tqdm import tqdm

    files = checkpoint_files(model_dir)
    handles = [safe_open(f, framework="pt") for f in files]
    total = sum(len(h.keys()) for h in handles)
    bar = tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress, leave=False)
    for h in handles:
        for name in h.keys():
            bar.update(1)
            if want is not None and not want(name):
                continue
            yield name, h.get_tensor(name)
    bar.close()
