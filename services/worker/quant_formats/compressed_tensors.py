"""compressed-tensors (llm-compressor's output): which scheme a checkpoint's
quantization_config holds, and so which module reads its tensors.

`scheme_of` is the one dispatch point: each scheme kvserve reads has a branch returning its
name; anything else is refused naming what the config says.
"""

from __future__ import annotations

from typing import Any

W4A16 = "w4a16"  # pack-quantized int4 (or fewer-bit) weights, float activations: int4.py


def _weights_args(qconfig: dict[str, Any]) -> list[dict[str, Any]]:
    groups = qconfig.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    return list(groups.values())


def scheme_of(qconfig: dict[str, Any]) -> str:
    """The scheme every config group of a compressed-tensors quantization_config uses."""
    fmt = qconfig.get("format")
    groups = _weights_args(qconfig)
    schemes = {_group_scheme(group, fmt) for group in groups}
    if len(schemes) != 1:
        raise ValueError(f"compressed-tensors config groups of mixed schemes {sorted(schemes)}")
    return schemes.pop()


def _group_scheme(group: dict[str, Any], fmt: str | None) -> str:
    fmt = group.get("format") or fmt
    weights = group.get("weights") or {}
    if fmt == "pack-quantized":
        return W4A16
    raise ValueError(
        f"compressed-tensors format {fmt!r} (weights {weights.get('type')!r} "
        f"{weights.get('num_bits')}-bit) is not supported; kvserve reads pack-quantized "
        "(W4A16), int-quantized (W8A8, W8A16) and float-quantized (FP8)"
    )
