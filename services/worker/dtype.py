"""The dtype a model runs in: --dtype, or with auto the checkpoint's (vLLM's two casts)."""

from __future__ import annotations

import torch


def checkpoint_dtype(model_dir: str) -> str | None:
    """The dtype config.json names (`dtype`, or `torch_dtype` before transformers 5)."""
    import json
    import os

    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        config = json.load(f)
    return config.get("dtype") or config.get("torch_dtype")


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(
    dtype: str, device: torch.device, checkpoint_dtype: str | None = None
) -> torch.dtype:
    """--dtype as a torch dtype (vLLM's aliases already spelled out: ModelConfig.dtype_name).

    auto takes the checkpoint's dtype (config.json's `dtype` / `torch_dtype`), float32 when it
    names none. Two casts, as vLLM makes: a float32 checkpoint runs in bfloat16 on a GPU,
    and a float16 one in bfloat16 on a CPU (whose float16 GEMMs are slow or emulated).
    """
    if dtype != "auto":
        return _DTYPES[dtype]
    resolved = _DTYPES.get(str(checkpoint_dtype).removeprefix("torch."), torch.float32)
    if device.type == "cuda" and resolved == torch.float32:
        return torch.bfloat16
    if device.type == "cpu" and resolved == torch.float16:
        return torch.bfloat16
    return resolved
