"""gpt-oss (OpenAI's open-weight gpt-oss-20b / 120b): the Llama block with four changes.

- attention sinks: a learned logit per query head joins every softmax's denominator
  (`attention_sinks`; the checkpoint's `self_attn.sinks` loads into `self_attn.attn.sinks`);
- sliding-window and full layers alternating by `config.layer_types` (Llama's
  `sliding_window` hook already reads them), biases on q/k/v and o;
- YaRN RoPE (`rope_type: yarn` in layers/rotary_embedding.py);
- a mixture of experts with a biased router, softmax over the top-k logits, and experts with
  biases and a clamped SwiGLU (layers/gpt_oss_moe.py).

The published checkpoints hold the experts as MXFP4 blocks (`*_blocks` + `*_scales`); a
float checkpoint (what save_pretrained writes) holds `gate_up_proj`, `down_proj` and biases.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from kvserve.kernels.quant import QuantizedTensor
from kvserve.services.worker.layers.gpt_oss_moe import GptOssExperts, GptOssMoE
from kvserve.services.worker.models.llama import LlamaForCausalLM

# checkpoint expert tensor -> (our parameter under `.experts.`, shard id)
_EXPERT_PARAMS: dict[str, tuple[str, object]] = {
    "gate_up_proj": ("w13_weight", None),
    "gate_up_proj_bias": ("w13_bias", None),
    "down_proj": ("w2_weight", None),
    "down_proj_bias": ("w2_bias", None),
    # MXFP4 (the published checkpoints): nibbles and exponents, joined at load
    "gate_up_proj_blocks": ("w13_weight", "blocks"),
    "gate_up_proj_scales": ("w13_weight", "scales"),
    "down_proj_blocks": ("w2_weight", "blocks"),
    "down_proj_scales": ("w2_weight", "scales"),
}


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss-20b, gpt-oss-120b."""

    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", True))
        return bias, bias

    @staticmethod
    def attention_sinks(config: Any) -> bool:
        return True

    @staticmethod
    def make_mlp(config: Any, layer_idx: int) -> nn.Module:
        return GptOssMoE(config)

    def map_checkpoint_name(self, name: str) -> tuple[str, object]:
        if name.endswith(".self_attn.sinks"):
            return name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), None
        prefix, sep, tensor = name.rpartition(".experts.")
        if sep and tensor in _EXPERT_PARAMS:
            param, shard_id = _EXPERT_PARAMS[tensor]
            return f"{prefix}.experts.{param}", shard_id
        return super().map_checkpoint_name(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        super().load_weights(weights)
        for module in self.modules():
            if isinstance(module, GptOssExperts):
                module.check_loaded()
