"""Qwen3: the Llama block with a per-head RMSNorm of q and k before RoPE, no qkv bias."""

from __future__ import annotations

from kvserve.services.worker.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense). `attention_bias` (False in every released config) covers q/k/v/o."""

    qk_norm = True
