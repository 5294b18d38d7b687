"""The KV cache's dtype (--kv-cache-dtype) and each attention layer's fp8 K and V scales.

An fp8 cache holds K / k_scale and V / v_scale in 8 bits (kernels/cache.py): one scale per
tensor, per layer. A checkpoint calibrated for an fp8 KV cache carries them under vLLM's names
(its `maybe_remap_kv_scale_name`), all read here:

    <attention prefix>.k_scale, .v_scale                  llm-compressor / compressed-tensors
    <attention prefix>.k_proj.k_scale, .v_proj.v_scale    NVIDIA ModelOpt
    <attention prefix>.kv_scale                           older: one scale for K and V

(the attention prefix is the checkpoint's `...layers.N.self_attn`). `take_kv_scales` lifts them
out of the checkpoint's tensor stream before the model's own loader sees it, and
`apply_kv_scales` sets them on the layers (`Attention.k_scale` / `.v_scale`, floats). A float
cache ignores them.

Without them the scales are 1.0, as vLLM's are: the cache then holds K and V rounded to fp8
as they are. e4m3 keeps 3 bits of mantissa over 2^-9 .. 448 and e5m2 2 bits over 2^-16 ..
57344, relative precision that does not depend on a scale while values stay in range (the K
and V of the models served here stay within tens; the write path clamps past the range).
A scale computed at start-up (the memory-profile pass's K/V maxima) was not chosen: it
would depend on the profile's dummy tokens, and engines that share blocks (the KV store, P/D)
must agree on their scales, which a fixed 1.0 or the checkpoint's guarantee (the store keys
blocks by the model's weights and the KV dtype: KvFingerprint).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from kvserve.kernels.cache import is_fp8
from kvserve.services.worker.layers.attention import Attention
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)

# --kv-cache-dtype's 8-bit values (vLLM's names); `auto` is the model's dtype.
FP8_KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# Checkpoint name suffix -> which scales it sets ("k", "v" or both).
_SCALE_SUFFIXES = {
    ".k_proj.k_scale": "k",
    ".v_proj.v_scale": "v",
    ".k_scale": "k",
    ".v_scale": "v",
    ".kv_scale": "kv",
}


def resolve_kv_cache_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for --kv-cache-dtype: `auto` is the model's."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype not in FP8_KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {cache_dtype!r} is not one of {['auto', *FP8_KV_CACHE_DTYPES]}"
        )
    return FP8_KV_CACHE_DTYPES[cache_dtype]


def check_layers_take(kv_dtype: torch.dtype, layers: Sequence[Attention]) -> None:
    """Refuse an fp8 cache for layers whose cache is not K and V planes: multi-head latent
    attention's latent cache is read by its own absorbed path, which is not converted."""
    if not is_fp8(kv_dtype):
        return
    for layer in layers:
        spec = layer.kv_cache_spec()
        if spec.num_planes != 2:
            raise ValueError(
                f"--kv-cache-dtype {str(kv_dtype).removeprefix('torch.')}: the latent KV "
                f"cache of {type(layer).__name__} (multi-head latent attention) is not "
                "stored in fp8; use --kv-cache-dtype auto"
            )


def _split(name: str) -> tuple[str, str] | None:
    for suffix, which in _SCALE_SUFFIXES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], which
    return None


def take_kv_scales(
    weights: Iterable[tuple[str, torch.Tensor]], found: dict[str, tuple[str, float]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors less its KV-cache scales, which go into `found` as
    {name: (attention prefix, scale)} (a one-element tensor each: per-tensor scales)."""
    for name, tensor in weights:
        split = _split(name)
        if split is None:
            yield name, tensor
            continue
        if tensor.numel() != 1:
            raise ValueError(
                f"KV-cache scale {name} has {tensor.numel()} elements; only per-tensor "
                "scales (one element) are supported"
            )
        found[name] = (split[0], float(tensor.float().reshape(())))


def apply_kv_scales(model: nn.Module, found: dict[str, tuple[str, float]]) -> int:
    """Set `found`'s scales (take_kv_scales) on the attention layers they name; returns how
    many layers got one. A layer is matched by its parent module's name (the checkpoint's
    `...self_attn`) or its own. Names no layer of this rank holds are skipped (other
    pipeline stages' layers, a vision tower's)."""
    layers: dict[str, Attention] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, Attention):
            layers[module_name] = module
            layers.setdefault(module_name.rpartition(".")[0], module)
    set_layers = set()
    for name, (prefix, scale) in found.items():
        layer = layers.get(prefix)
        if layer is None:
            continue
        if not scale > 0 or scale == float("inf"):
            raise ValueError(f"KV-cache scale {name} is {scale}: it must be positive and finite")
        which = _SCALE_SUFFIXES[name[len(prefix) :]]
        if "k" in which:
            layer.k_scale = scale
        if "v" in which:
            layer.v_scale = scale
        set_layers.add(id(layer))
    if found:
        logger.info(
            "KV-cache scales from the checkpoint: %d tensors, %d attention layers",
            len(found),
            len(set_layers),
        )
    return len(set_layers)
