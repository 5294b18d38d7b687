"""Reading a draft head's weights (Medusa, EAGLE): the first of a folder's weight files; and
the tensors of one part of a target checkpoint (MTP's layers)."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch


def read_tensors(path: str, names: tuple[str, ...], kind: str) -> dict[str, torch.Tensor]:
    """The tensors of the first of `names` (safetensors or a torch pickle of tensors only)
    found in the folder `path`; ValueError naming the `kind` of checkpoint otherwise."""
    for name in names:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(file)
        return torch.load(file, map_location="cpu", weights_only=True)
    raise ValueError(f"{kind} checkpoint {path}: none of {', '.join(names)} found")


def tensor_names_under(model_dir: str, prefix: str) -> dict[str, list[str]]:
    """{file: names} of the tensors of model_dir's *.safetensors whose names start with
    prefix, read from the files' headers only (a checkpoint of hundreds of GB lists fast)."""
    from safetensors import safe_open

    found: dict[str, list[str]] = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            names = [name for name in f.keys() if name.startswith(prefix)]
        if names:
            found[path] = names
    return found


def read_tensors_named(names_by_file: dict[str, list[str]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of those tensors only, one at a time (tensor_names_under's answer)."""
    from safetensors import safe_open

    for path, names in names_by_file.items():
        with safe_open(path, framework="pt") as f:
            for name in names:
                yield name, f.get_tensor(name)
