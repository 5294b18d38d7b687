"""DeepSeek-V2 / V3: the Llama block with multi-head latent attention (MLA) and DeepSeek's MoE.

Attention (per layer, H heads; names as in the checkpoint):

    q     = q_proj(x)                                  (q_lora_rank None: V2-Lite)
          | q_b_proj(q_a_layernorm(q_a_proj(x)))       (q_lora_rank set: V2, V3)
          -> per head [q_nope (Dn) ; q_pe (R)]
    [c ; k_pe] = kv_a_proj_with_mqa(x);  c = kv_a_layernorm(c)   (latent L, shared rope key R)
    kv_b_proj: c -> per head [k_nope (Dn) ; v (Dv)]

The paged cache keeps only [c ; rotated k_pe] per token; attention runs over it with q_nope
absorbed into kv_b_proj's key rows and the output taken through its value rows, or, for a
step of long fresh prompts, over the latent expanded to per-head K and V
(layers/mla_attention.py). RoPE covers only the R rope features, on DeepSeek's interleaved
pairs (V3's `rope_interleave`), YaRN-scaled where the config says (its mscale_all_dim folded
into the softmax scale, as HF does).

Feed-forward: dense SiLU MLPs in the first `first_k_dense_replace` layers, then routed experts
(layers/fused_moe.fused_experts) plus `n_shared_experts` always-on experts (one wide MLP).
Routing: V2 softmax top-k, optionally within the `topk_group` best of `n_group` groups
(group_limited_greedy); V3 sigmoid scores plus `e_score_correction_bias` for the choice only,
groups ranked by their two best, weights renormalized when norm_topk_prob; both scaled by
`routed_scaling_factor`. transformers 5.25's modeling_deepseek_v2/v3 are the reference.

V3's multi-token-prediction layers (`num_nextn_predict_layers`, checkpoint layers past
num_hidden_layers) are not this model's: `--speculative-config '{"method": "deepseek_mtp"}'`
runs the first as the drafter (spec_decode/mtp.py).
"""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

import torch
from torch import nn

from kvserve.services.worker.layers.attention import AttentionMetadata
from kvserve.services.worker.layers.fused_moe import FusedMoE, fused_experts
from kvserve.services.worker.layers.layernorm import RMSNorm
from kvserve.services.worker.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    divide,
    quantization_scope,
)
from kvserve.services.worker.layers.mla_attention import MLAAttention
from kvserve.services.worker.layers.rotary_embedding import rope_parameters_from_config
from kvserve.services.worker.models.llama import LlamaForCausalLM, LlamaMLP
from kvserve.services.worker.parallel_state import get_tp_size, tensor_model_parallel_all_reduce

_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_MOE_SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: HF's default, not rms_norm_eps


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude factor 0.1 * mscale * ln(scale) + 1 (1 when unscaled)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, params: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim / 2], attention factor) of YaRN: frequencies blended between the
    original and the factor-interpolated ones over the [beta_fast, beta_slow] rotation ramp."""
    base = params["rope_theta"]
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = (
        correction_dim(params.get("beta_fast") or 32),
        correction_dim(params.get("beta_slow") or 1),
    )
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class DeepseekRotary(nn.Module):
    """RoPE of the R rope features, on interleaved pairs (x0, x1), (x2, x3), ... or on the
    two halves (V3 with rope_interleave false). The output lays the rotated pairs out as
    [first of each pair | second of each pair]: q and k alike, so their dot products are
    those of the pairwise rotation.

    Args:
        dim: R, the rotated features.
        max_position: positions the table covers.
        params: rope_parameters_from_config(config): rope_type default or yarn.
        interleave: pairs are adjacent features (DeepSeek's layout) rather than halves.
    """

    cos: torch.Tensor  # [max_position, R / 2] float32, attention factor folded in
    sin: torch.Tensor

    def __init__(self, dim: int, max_position: int, params: dict, interleave: bool):
        super().__init__()
        rope_type = params.get("rope_type", "default")
        if rope_type == "yarn":
            inv_freq, attention_factor = _yarn_inv_freq(dim, params, max_position)
        elif rope_type == "default":
            exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
            inv_freq, attention_factor = 1.0 / (params["rope_theta"] ** exponents), 1.0
        else:
            raise ValueError(f"DeepSeek rope_type {rope_type!r} is not supported (default, yarn)")
        self.interleave = interleave
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_factor, persistent=False)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, ..., R]; cos, sin: [T, ..., R / 2] broadcastable. Float32 math."""
        xf = x.float()
        if self.interleave:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
        else:
            x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    def forward(
        self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_pe: [T, H, R]; k_pe: [T, R]. Returns both rotated."""
        cos, sin = self.cos[positions], self.sin[positions]  # [T, R / 2]
        q = self.rotate(q_pe, cos.unsqueeze(1), sin.unsqueeze(1))
        return q, self.rotate(k_pe, cos, sin)


class DeepseekV2Attention(nn.Module):
    """Multi-head latent attention: the projections above, over a latent cache.

    Under TP the heads split (q_proj / q_b_proj and kv_b_proj by rows, o_proj by columns);
    q_a_proj and kv_a_proj_with_mqa are replicated, so every rank caches the same latent.
    """

    def __init__(self, config: Any, layer_idx: int):
        super().__init__()
        self.num_heads = divide(config.num_attention_heads, get_tp_size())
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        total_heads, hidden = config.num_attention_heads, config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * qk_head_dim)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_heads * qk_head_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden, config.kv_lora_rank + config.qk_rope_head_dim, bias
        )
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, _LATENT_NORM_EPS)
        with quantization_scope(None):  # read as W_UK / W_UV, never multiplied as a layer
            self.kv_b_proj = ColumnParallelLinear(
                config.kv_lora_rank, total_heads * (config.qk_nope_head_dim + config.v_head_dim)
            )
        self.o_proj = RowParallelLinear(total_heads * config.v_head_dim, hidden, bias)
        params = rope_parameters_from_config(config)
        self.rotary_emb = DeepseekRotary(
            config.qk_rope_head_dim,
            config.max_position_embeddings,
            params,
            bool(getattr(config, "rope_interleave", True)),
        )
        scale = qk_head_dim**-0.5
        if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
            scale *= yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
        self.attn = MLAAttention(
            self.num_heads,
            config.kv_lora_rank,
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
            scale,
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        attn_metadata: AttentionMetadata,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention block's output; with `residual`, residual + that output."""
        num_tokens = hidden_states.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(num_tokens, self.num_heads, -1)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
        w_kv = self.kv_b_proj.weight.view(self.num_heads, -1, self.kv_lora_rank)
        w_uk, w_uv = w_kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        out = self.attn.forward_mla(q_nope, q_pe, latent, k_pe, w_uk, w_uv, attn_metadata)
        return self.o_proj(out) if residual is None else self.o_proj(out, residual)

    def adds_residual(self, hidden_states: torch.Tensor) -> bool:
        """Whether forward(..., residual) adds the residual inside the output GEMM (not
        under LoRA, whose wrapper adds its delta to the projection's output)."""
        o_proj = self.o_proj
        return isinstance(o_proj, RowParallelLinear) and o_proj.adds_residual(hidden_states)


class DeepseekV2Router(nn.Module):
    """V2 routing: softmax scores, the top-k (within the best `topk_group` of `n_group`
    groups, ranked by their best expert, under group_limited_greedy), times
    routed_scaling_factor. Float32, as HF computes it (HF's V2 never renormalizes)."""

    def __init__(self, config: Any):
        super().__init__()
        num_experts = config.n_routed_experts
        self.weight = nn.Parameter(
            torch.empty(num_experts, config.hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.top_k = config.num_experts_per_tok
        self.num_groups = config.n_group or 1
        self.topk_group = config.topk_group or self.num_groups
        self.scaling = float(config.routed_scaling_factor)
        self.topk_method = self.check_topk_method(config)

    @staticmethod
    def check_topk_method(config: Any) -> str:
        method = getattr(config, "topk_method", None) or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(
                f"DeepSeek-V2 topk_method {method!r} is not supported "
                "(greedy, group_limited_greedy)"
            )
        return method

    def _group_mask(self, scores: torch.Tensor, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, E] bool: the experts of each token's topk_group best groups."""
        best = group_scores.topk(self.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return mask.repeat_interleave(scores.shape[-1] // self.num_groups, dim=-1)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (weights [T, top_k] float32, expert ids [T, top_k] int64)."""
        scores = (hidden_states.float() @ self.weight.t()).softmax(dim=-1)
        if self.topk_method == "group_limited_greedy":
            groups = scores.view(scores.shape[0], self.num_groups, -1).amax(dim=-1)
            scores = scores.masked_fill(~self._group_mask(scores, groups), 0.0)
        weights, expert_ids = scores.topk(self.top_k, dim=-1)
        return weights * self.scaling, expert_ids


class DeepseekV3Router(DeepseekV2Router):
    """V3 routing (noaux_tc): sigmoid scores; the choice ranks score + e_score_correction_bias
    within the best `topk_group` groups (ranked by the sum of their two best); the weights
    are the unbiased scores, renormalized when norm_topk_prob, times routed_scaling_factor."""

    def __init__(self, config: Any):
        super().__init__(config)
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(config.n_routed_experts, dtype=torch.float32), requires_grad=False
        )
        self.renormalize = bool(config.norm_topk_prob)

    @staticmethod
    def check_topk_method(config: Any) -> str:
        return "noaux_tc"  # what V3 checkpoints name, and the only routing HF's V3 has

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = (hidden_states.float() @ self.weight.t()).sigmoid()
        choice = scores + self.e_score_correction_bias
        groups = choice.view(choice.shape[0], self.num_groups, -1).topk(2, dim=-1).values.sum(-1)
        choice = choice.masked_fill(~self._group_mask(choice, groups), float("-inf"))
        expert_ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, expert_ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, expert_ids


class DeepseekMoE(nn.Module):
    """Routed experts (one grouped-GEMM pass) plus the shared experts, summed.

    Args:
        config: the HF config (n_routed_experts, num_experts_per_tok, moe_intermediate_size,
            n_shared_experts).
        router_class: DeepseekV2Router or DeepseekV3Router.
    """

    def __init__(self, config: Any, router_class: type[DeepseekV2Router]):
        super().__init__()
        self.gate = router_class(config)
        # FusedMoE holds and TP-splits the expert weights; routing is ours (no softmax top-k).
        self.experts = FusedMoE(
            config.n_routed_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
        )
        self.shared_experts = None
        if config.n_shared_experts:
            inter = config.moe_intermediate_size * config.n_shared_experts
            self.shared_experts = LlamaMLP(config, intermediate_size=inter)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(hidden_states)
        experts = self.experts
        out = fused_experts(
            hidden_states, experts.w13_weight, experts.w2_weight, weights, expert_ids
        )
        if experts.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 / V2-Lite / V2.5 (and, with V3's router, DeepSeek-V3 / R1)."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, object]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    router_class: ClassVar[type[DeepseekV2Router]] = DeepseekV2Router

    @classmethod
    def make_attention(cls, config: Any, layer_idx: int) -> nn.Module:
        return DeepseekV2Attention(config, layer_idx)

    @classmethod
    def make_mlp(cls, config: Any, layer_idx: int) -> nn.Module:
        if layer_idx < (config.first_k_dense_replace or 0):
            return LlamaMLP(config)
        return DeepseekMoE(config, cls.router_class)

    def _on_this_stage(self, name: str) -> bool:
        # Layers past num_hidden_layers are V3's multi-token-prediction layers: not the
        # target's; speculation's drafter reads them itself (spec_decode/mtp.py).
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= self.config.num_hidden_layers:
                return False
        return super()._on_this_stage(name)

    def map_checkpoint_name(self, name: str) -> tuple[str, object]:
        match = _EXPERT_NAME.search(name)
        if match is None:
            return super().map_checkpoint_name(name)
        expert_id, which = int(match.group(1)), _FUSED_MOE_SHARD[match.group(2)]
        param = "w2_weight" if which == "w2" else "w13_weight"
        return f"{name[: match.start()]}.experts.{param}", (expert_id, which)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1: V2's layers with sigmoid, bias-corrected group routing."""

    router_class: ClassVar[type[DeepseekV2Router]] = DeepseekV3Router
