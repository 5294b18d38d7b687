"""Qwen3-MoE: Qwen3's attention (q/k norm) with a mixture of experts in most layers.

A layer is sparse unless `mlp_only_layers` lists it or it falls off the
`decoder_sparse_step` grid; its `mlp` has a router `gate` and experts named like a dense MLP
(gate_proj, up_proj, down_proj), computed together by layers/fused_moe.FusedMoE.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from kvserve.services.worker.layers.fused_moe import FusedMoE
from kvserve.services.worker.layers.linear import ReplicatedLinear
from kvserve.services.worker.models.llama import LlamaMLP
from kvserve.services.worker.models.qwen3 import Qwen3ForCausalLM

_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_MOE_SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class Qwen3MoeSparseBlock(nn.Module):
    """Router + experts; top-k weights renormalized when config.norm_topk_prob."""

    def __init__(self, config: Any):
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)
        self.experts = FusedMoE(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            renormalize=bool(config.norm_topk_prob),
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-30B-A3B, Qwen3-235B-A22B."""

    @staticmethod
    def make_mlp(config: Any, layer_idx: int) -> nn.Module:
        sparse = layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and (
            (layer_idx + 1) % config.decoder_sparse_step == 0
        )
        return Qwen3MoeSparseBlock(config) if sparse else LlamaMLP(config)

    def map_checkpoint_name(self, name: str) -> tuple[str, object]:
        match = _EXPERT_NAME.search(name)
        if match is None:
            return super().map_checkpoint_name(name)
        expert_id, which = int(match.group(1)), _FUSED_MOE_SHARD[match.group(2)]
        param = "w2_weight" if which == "w2" else "w13_weight"
        return f"{name[: match.start()]}.experts.{param}", (expert_id, which)
