"""Llama 4 text (Scout, Maverick): the Llama block with chunked local attention, NoPE layers
and a mixture of experts with a shared expert.

What differs from llama.py, all through LlamaForCausalLM's hooks:
- `no_rope_layers[i]` (1: RoPE, 0: NoPE) picks the layers with RoPE. Those attend only within
  their chunk of `attention_chunk_size` positions (HF's layer type chunked_attention; the
  cache keeps every block, the other chunks are masked) and L2-normalize q and k per head
  (`use_qk_norm`: an RMS norm without weight). The NoPE layers attend to everything, without
  positions, and with `attn_temperature_tuning` scale each query by
  1 + attn_scale * log(1 + floor((position + 1) / floor_scale)).
- HF rotates (even, odd) pairs of a head (a complex multiply); our kernels rotate halves. The
  q_proj and k_proj rows of each RoPE head are permuted on load, pairs to halves: the scores
  q . k are the same sums, the L2 norm a sum of squares, v and o_proj untouched.
  HF normalizes q and k after RoPE, we before: a rotation keeps the norm, so it commutes.
- Layers in `moe_layers` (every `interleave_moe_layer_step`-th) have Llama4MoE; the others a
  dense MLP of width `intermediate_size_mlp`.

Checkpoints: Llama4ForCausalLM's names (model.layers.*.feed_forward.*), or the multimodal
Llama4ForConditionalGeneration's, served text-only: its language_model.* weights, the vision
tower and projector skipped (the api refuses image content for this model).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from kvserve import kernels
from kvserve.kernels.quant import QuantizedTensor
from kvserve.services.worker.layers.fused_moe import FusedMoE, fused_experts
from kvserve.services.worker.layers.linear import ReplicatedLinear
from kvserve.services.worker.models.llama import LlamaForCausalLM, LlamaMLP
from kvserve.services.worker.parallel_state import tensor_model_parallel_all_reduce

logger = logging.getLogger(__name__)

_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_MOE_SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_QK_PROJ = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qk])_proj\.(weight|bias)$")
_STACKED_EXPERTS = re.compile(r"\.feed_forward\.experts\.(gate_up_proj|down_proj)$")
Weights = Iterable[tuple[str, torch.Tensor | QuantizedTensor]]


def uses_rope(config: Any, layer_idx: int) -> bool:
    """Whether the layer has RoPE (and chunked attention, and the q/k L2 norm)."""
    return bool(config.no_rope_layers[layer_idx])


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    moe_layers = getattr(config, "moe_layers", None)
    if moe_layers is None:
        step = config.interleave_moe_layer_step
        moe_layers = range(step - 1, config.num_hidden_layers, step)
    return layer_idx in moe_layers


class WeightlessRMSNorm(nn.Module):
    """y = x / rms(x): Llama 4's L2 norm of q and k heads (no parameter to load)."""

    ones: torch.Tensor

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.register_buffer("ones", torch.ones(hidden_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.ones, self.eps)


class Llama4MoE(nn.Module):
    """Router + experts + a shared expert.

    Each token goes to its top_k experts by router logit, and each reads the token scaled by
    sigmoid(its logit) (the score weights the expert's input, not its output); the shared
    expert (a dense MLP of the experts' width) reads every token; the outputs are summed.

    Args:
        config: the HF text config (num_local_experts, num_experts_per_tok,
            intermediate_size).
    """

    def __init__(self, config: Any):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = ReplicatedLinear(config.hidden_size, config.num_local_experts)
        self.experts = FusedMoE(
            config.num_local_experts,
            self.top_k,
            config.hidden_size,
            config.intermediate_size,
            renormalize=False,
        )
        self.shared_expert = LlamaMLP(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = self.router(hidden_states)
        top_logits, expert_ids = torch.topk(router_logits, self.top_k, dim=-1)
        scores = torch.sigmoid(top_logits.float())
        experts = self.experts
        routed = fused_experts(
            hidden_states,
            experts.w13_weight,
            experts.w2_weight,
            scores,
            expert_ids,
            weights_on_input=True,
        )
        if experts.tp_size > 1:
            routed = tensor_model_parallel_all_reduce(routed)
        return self.shared_expert(hidden_states) + routed


def _temperature(floor_scale: float, attn_scale: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def scale(positions: torch.Tensor) -> torch.Tensor:
        steps = torch.floor((positions.float() + 1.0) / floor_scale)
        return torch.log1p(steps) * attn_scale + 1.0

    return scale


def _pairs_to_halves(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of each head from (x0, x1), (x2, x3), ... to x0, x2, ..., x1, x3, ...: HF's
    interleaved RoPE pairs as the rotate-half layout (dim 0 is heads x head_dim)."""
    head_dim = weight.shape[0] // num_heads
    shaped = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return shaped.transpose(1, 2).reshape(weight.shape)


class Llama4ForCausalLM(LlamaForCausalLM):
    """Llama 4 text: Scout (16 experts, MoE on every layer) and Maverick (128, every other).

    Args:
        config: a Llama4TextConfig.
    """

    def __init__(self, config: Any):
        if not getattr(config, "no_rope_layers", None):
            raise ValueError("a Llama 4 text config needs no_rope_layers (one 0/1 per layer)")
        super().__init__(config)

    @staticmethod
    def rope_parameters(config: Any, layer_idx: int) -> dict | None:
        if not uses_rope(config, layer_idx):
            return None
        return LlamaForCausalLM.rope_parameters(config, layer_idx)

    @staticmethod
    def attention_chunk_size(config: Any, layer_idx: int) -> int | None:
        chunk_size = getattr(config, "attention_chunk_size", None)
        return int(chunk_size) if chunk_size and uses_rope(config, layer_idx) else None

    @classmethod
    def make_qk_norm(cls, config: Any, layer_idx: int, head_dim: int) -> nn.Module | None:
        if config.use_qk_norm and uses_rope(config, layer_idx):
            return WeightlessRMSNorm(head_dim, config.rms_norm_eps)
        return None

    @staticmethod
    def query_scale(config: Any, layer_idx: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if not config.attn_temperature_tuning or uses_rope(config, layer_idx):
            return None
        return _temperature(float(config.floor_scale), float(config.attn_scale))

    @staticmethod
    def make_mlp(config: Any, layer_idx: int) -> nn.Module:
        if is_moe_layer(config, layer_idx):
            return Llama4MoE(config)
        return LlamaMLP(config, intermediate_size=config.intermediate_size_mlp)

    # -- loading ----------------------------------------------------------------------------

    def map_checkpoint_name(self, name: str) -> tuple[str, object]:
        name = name.replace(".feed_forward.", ".mlp.")
        match = _EXPERT_NAME.search(name)
        if match is None:
            return super().map_checkpoint_name(name)
        expert_id, which = int(match.group(1)), _FUSED_MOE_SHARD[match.group(2)]
        param = "w2_weight" if which == "w2" else "w13_weight"
        return f"{name[: match.start()]}.experts.{param}", (expert_id, which)

    def _text_weights(self, weights: Weights) -> Weights:
        """The checkpoint's tensors under Llama4ForCausalLM's names (a hook for the
        multimodal layout)."""
        return weights

    def _as_loaded(self, weights: Weights) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """Stacked experts split per expert in nn.Linear's [out, in] layout, and the RoPE
        layers' q/k rows from pairs to halves."""
        config = self.config
        for name, tensor in self._text_weights(weights):
            stacked = _STACKED_EXPERTS.search(name)
            qk = _QK_PROJ.match(name)
            if stacked is not None:
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"{name}: quantized stacked experts are not supported")
                prefix = name[: stacked.start()] + ".feed_forward.experts"
                for expert_id, expert in enumerate(tensor.unbind(0)):
                    if stacked.group(1) == "down_proj":  # [I, H]
                        yield f"{prefix}.{expert_id}.down_proj.weight", expert.t()
                        continue
                    gate, up = expert.t().chunk(2, dim=0)  # [H, 2I] -> [I, H] each
                    yield f"{prefix}.{expert_id}.gate_proj.weight", gate
                    yield f"{prefix}.{expert_id}.up_proj.weight", up
            elif qk is not None and uses_rope(config, int(qk.group(1))):
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"{name}: quantized q/k projections are not supported")
                is_q = qk.group(2) == "q"
                num_heads = config.num_attention_heads if is_q else config.num_key_value_heads
                yield name, _pairs_to_halves(tensor, num_heads)
            else:
                yield name, tensor

    def load_weights(self, weights: Weights) -> None:
        super().load_weights(self._as_loaded(weights))


class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    """The multimodal Llama 4 checkpoint served text-only: its language model's weights
    (language_model.*), the vision tower and projector skipped.

    Args:
        config: the Llama4Config (its text_config is used) or a Llama4TextConfig.
    """

    def __init__(self, config: Any):
        text_config = getattr(config, "text_config", None) or config
        super().__init__(text_config)
        logger.info(
            "Llama4ForConditionalGeneration served text-only: the vision tower is not loaded"
        )

    def _text_weights(self, weights: Weights) -> Weights:
        for name, tensor in weights:
            if name.startswith("language_model."):
                yield name.removeprefix("language_model."), tensor
            elif not name.startswith(("vision_model.", "multi_modal_projector.")):
                raise ValueError(f"checkpoint tensor {name!r} is not a Llama 4 tensor")
