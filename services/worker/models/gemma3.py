"""Gemma 3 text (Gemma3ForCausalLM, model_type gemma3_text): Gemma 2 plus a per-head q/k
norm, and a RoPE of its own for the sliding-window layers.

`layer_types` marks five local (sliding-window) layers per global one. In transformers >= 5
`rope_parameters` holds one entry per layer type (the global one with the long-context
`linear` scaling); older configs give `rope_local_base_freq` for the local layers and
`rope_theta` + `rope_scaling` for the global ones. Soft caps are off in released configs.
"""

from __future__ import annotations

from typing import Any

from kvserve.services.worker.layers.rotary_embedding import rope_parameters_from_config
from kvserve.services.worker.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 1B and the text tower of the larger ones, loaded as a text-only model."""

    qk_norm = True

    @staticmethod
    def rope_parameters(config: Any, layer_idx: int) -> dict:
        layer_type = config.layer_types[layer_idx]
        by_type = getattr(config, "rope_parameters", None) or {}
        if layer_type in by_type:
            params = dict(by_type[layer_type])
            params.setdefault("rope_type", "default")
            return params
        if layer_type == "sliding_attention":
            return {"rope_type": "default", "rope_theta": config.rope_local_base_freq}
        return rope_parameters_from_config(config)
