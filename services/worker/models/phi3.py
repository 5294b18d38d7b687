"""Phi-3: the Llama block with q/k/v and gate/up already fused in the checkpoint.

`self_attn.qkv_proj` and `mlp.gate_up_proj` load through the fused layers' own loaders (each
rank takes its heads' rows of q, k and v); RoPE may be `longrope` (rotary_embedding.py) and
`sliding_window`, when set, applies to every layer.
"""

from __future__ import annotations

from kvserve.services.worker.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-3.5 mini and medium (no partial rotary: Phi-4-mini is not covered)."""
