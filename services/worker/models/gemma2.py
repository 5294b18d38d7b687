"""Gemma 2: Llama-shaped, with soft caps, sandwich norms, alternating windows and GeGLU.

What differs from llama.py, all through LlamaForCausalLM's hooks:
- RMSNorm scales by (1 + weight) (GemmaRMSNorm), and the attention and MLP outputs are
  normed too before their residual adds (sandwich_norms);
- embeddings are multiplied by sqrt(hidden_size);
- the softmax scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- attention scores are soft-capped (attn_logit_softcapping), and so are the final logits
  (final_logit_softcapping, in LlamaForCausalLM.compute_logits);
- `layer_types` alternates sliding-window and global layers;
- the MLP activation is gelu (tanh approximation), from `hidden_activation`.
"""

from __future__ import annotations

from typing import Any

from kvserve.services.worker.layers.layernorm import GemmaRMSNorm
from kvserve.services.worker.models.llama import LlamaForCausalLM


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 (2B, 9B, 27B); the embeddings are tied to the LM head."""

    norm_class = GemmaRMSNorm
    sandwich_norms = True

    @staticmethod
    def attention_scale(config: Any) -> float:
        return config.query_pre_attn_scalar**-0.5

    @staticmethod
    def embedding_scale(config: Any) -> float | None:
        return config.hidden_size**0.5
