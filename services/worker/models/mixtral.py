"""Mixtral: the Llama block with a sparse mixture of experts in place of the MLP.

Each layer's `block_sparse_moe` (loaded as our `mlp`) has a router `gate` [E, H] and E SiLU
experts w1 (gate), w3 (up), w2 (down), computed together by layers/fused_moe.FusedMoE.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from kvserve.services.worker.layers.fused_moe import FusedMoE
from kvserve.services.worker.layers.linear import ReplicatedLinear
from kvserve.services.worker.models.llama import LlamaForCausalLM

# ".experts.3.w1." -> expert 3, w1
_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.(w[123])\.weight$")


class MixtralMoE(nn.Module):
    """Router + experts: each token goes to its top-k experts, their outputs summed by the
    renormalized router weights.

    Args:
        config: the HF config (num_local_experts, num_experts_per_tok, intermediate_size).
    """

    def __init__(self, config: Any):
        super().__init__()
        num_experts = config.num_local_experts
        self.gate = ReplicatedLinear(config.hidden_size, num_experts)
        self.experts = FusedMoE(
            num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            renormalize=True,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral 8x7B / 8x22B (and its sliding window, when the config sets one)."""

    @staticmethod
    def make_mlp(config: Any, layer_idx: int) -> nn.Module:
        return MixtralMoE(config)

    def map_checkpoint_name(self, name: str) -> tuple[str, object]:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        match = _EXPERT_NAME.search(name)
        if match is None:
            return super().map_checkpoint_name(name)
        expert_id, which = int(match.group(1)), match.group(2)
        param = "w2_weight" if which == "w2" else "w13_weight"
        return f"{name[: match.start()]}.experts.{param}", (expert_id, which)
