"""Reading a draft head's weights (Medusa, EAGLE): the first of a folder's weight files."""

from __future__ import annotations

import os

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
