"""Rotary position embedding with a precomputed cos/sin table.

cos_sin_cache[p] = [cos(p * inv_freq) | sin(p * inv_freq)], shape [max_position, head_size],
float32 whatever the model dtype (the kernel rotates in float32).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvserve import kernels


def rope_parameters_from_config(config: Any) -> dict:
    """The RoPE settings of a HF config as one dict with `rope_type` and `rope_theta`.

    Reads transformers >= 5 `rope_parameters` or the older `rope_theta` + `rope_scaling`.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    if params["rope_type"] == "yarn":
        original = getattr(config, "original_max_position_embeddings", None)
        params.setdefault("original_max_position_embeddings", original)
        if not params.get("factor"):
            params["factor"] = config.max_position_embeddings / original
    if params["rope_type"] in ("longrope", "su"):
        original = getattr(config, "original_max_position_embeddings", None)
        params.setdefault("original_max_position_embeddings", original)
        params.setdefault("max_position_embeddings", config.max_position_embeddings)
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 scaling: keep high frequencies, divide low ones by `factor`, blend between."""
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope_tables(inv_freq: torch.Tensor, params: dict, max_position: int) -> torch.Tensor:
    """Phi-3's longrope: inv_freq divided per dim by short_factor for positions below
    original_max_position_embeddings and by long_factor from there on, cos and sin scaled
    by the attention factor sqrt(1 + ln(factor) / ln(original)).

    HF switches the whole sequence to the long factors once it is longer than the original
    context (re-rotating cached keys); here each position keeps its own, so the two agree
    up to that length.
    """
    original = params["original_max_position_embeddings"] or max_position
    factor = params.get("factor") or params["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    tables = []
    for key, start, end in (("short_factor", 0, original), ("long_factor", original, max_position)):
        if end <= start:
            continue
        scaled = inv_freq / torch.tensor(params[key], dtype=torch.float32)
        freqs = torch.outer(torch.arange(start, end, dtype=torch.float32), scaled)
        tables.append(torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor)
    return torch.cat(tables)


def _yarn_inv_freq(
    inv_freq: torch.Tensor, params: dict, head_size: int
) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss, DeepSeek): (inv_freq, attention factor), as transformers'
    `_compute_yarn_parameters`. High frequencies (more than beta_fast rotations over the
    original context) keep inv_freq, low ones (under beta_slow) are divided by `factor`, a
    linear ramp between; cos and sin are scaled by the attention factor (0.1 ln(factor) + 1,
    or mscale / mscale_all_dim's ratio)."""
    base, factor = params["rope_theta"], params["factor"]
    original = params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )

    def correction_dim(num_rotations: float) -> float:
        return head_size * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_size - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_size // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # the share of inv_freq kept as is
    inv_freq = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE over the whole head.

    Args:
        head_size: features per head (all of them rotate).
        max_position: positions the table covers.
        base: rope_theta.
        rope_parameters: the `rope_type` and its scaling keys; `default`, `linear`, `llama3`,
            `longrope` (Phi-3) and `yarn` are supported.
    """

    cos_sin_cache: torch.Tensor  # [max_position, D] cos | sin halves, a buffer

    def __init__(
        self, head_size: int, max_position: int, base: float, rope_parameters: dict | None = None
    ):
        super().__init__()
        rope_parameters = rope_parameters or {}
        rope_type = rope_parameters.get("rope_type", "default")
        if rope_type == "su":  # the old name of longrope
            rope_type = "longrope"
        if rope_type not in ("default", "linear", "llama3", "longrope", "yarn"):
            raise ValueError(
                f"rope_type {rope_type!r} is not supported "
                "(default, linear, llama3, longrope, yarn)"
            )
        if rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                "partial rotary embeddings are not supported: the kernel rotates the whole head"
            )
        self.head_size = head_size
        exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
        inv_freq = 1.0 / (base**exponents)
        attention_factor = 1.0
        if rope_type == "yarn":
            inv_freq, attention_factor = _yarn_inv_freq(inv_freq, rope_parameters, head_size)
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_parameters)
        elif rope_type == "linear":
            inv_freq = inv_freq / rope_parameters["factor"]
        if rope_type == "longrope":
            cos_sin_cache = _longrope_tables(inv_freq, rope_parameters, max_position)
        else:
            freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
            cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64; query: [T, Hq * D]; key: [T, Hkv * D]. Returns rotated q, k."""
        return kernels.rotary_embedding(positions, query, key, self.cos_sin_cache, self.head_size)


def get_rope(head_size: int, max_position: int, rope_parameters: dict) -> RotaryEmbedding:
    """Build the RoPE layer from `rope_parameters_from_config(config)`."""
    return RotaryEmbedding(head_size, max_position, rope_parameters["rope_theta"], rope_parameters)
