"""gpt-oss's mixture of experts: a biased router, softmax over the top-k logits, and experts
with biases and a clamped SwiGLU.

    logits = x R^T + r                       router, [T, E]
    top-k of logits, softmax over those k    the routing weights (no renormalization step)
    expert e: h = x W13_e^T + b13_e          [gate ; up], I each
              a = (clamp(up, -L, L) + 1) * g * sigmoid(alpha g),  g = clamp(gate, max=L)
              y = a W2_e^T + b2_e
    out = sum_k weight_k * y_{e_k}

The checkpoint's `gate_up_proj` is [E, H, 2I] with gate and up interleaved along its last dim
(column 2j is gate j, 2j + 1 up j), `down_proj` [E, I, H]: transposed against a linear's
[out, in]. They load as [E, 2I, H] rows in [gate ; up] order and [E, H, I], the layout of
layers/fused_moe.py, whose sorted-rows grouped GEMM this reuses. Tensor parallelism splits
every expert's intermediate dim the same way (this rank's gate and up rows, its down
columns); the down bias is added on rank 0 only, before the all-reduce.

MXFP4 experts (the published checkpoints: `gate_up_proj_blocks` [E, 2I, H/32, 16] and
`gate_up_proj_scales` [E, 2I, H/32], `down_proj_blocks` [E, H, I/32, 16] and
`down_proj_scales` [E, H, I/32], already [out, in] per expert) are held as stored under
`--quantization mxfp4` (the default for such a checkpoint): w13_weight / w2_weight are then
uint8 rows of 17-byte blocks (kernels/quant.py `mxfp4_from_checkpoint`), and each expert a
`QuantizedTensor` multiplied by `quant_linear` (C on CPU, Triton on GPU, torch fallback),
one expert at a time over its sorted rows. `--quantization none` expands them to float at
load instead (the float path above): the equality reference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvserve.kernels.quant import QuantizedTensor, mxfp4_from_checkpoint, quant_linear
from kvserve.services.worker.layers.linear import (
    ReplicatedLinear,
    current_quantization,
    divide,
    set_weight_loader,
)
from kvserve.services.worker.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_reduce,
)


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), with
    g = clamp(gate, max=limit): gpt-oss's activation, in HF's order of operations."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def select_top_logits(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss routing: the top_k logits, softmaxed among themselves (float32).

    router_logits: [T, E]. Returns (weights [T, top_k] float32, expert ids [T, top_k] int64).
    """
    top_logits, expert_ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(top_logits, dim=-1, dtype=torch.float32), expert_ids


class GptOssExperts(nn.Module):
    """The E experts of one layer, float weights (see the module docstring for the math).

    Args:
        num_experts: E.
        hidden_size: H.
        intermediate_size: each expert's full width I, split across TP ranks.
        limit, alpha: the clamped SwiGLU's swiglu_limit and swiglu_alpha.

    Parameters (this rank's slice of I):
        w13_weight: [E, 2 I/tp, H], [gate ; up] rows; w13_bias: [E, 2 I/tp].
        w2_weight: [E, H, I/tp]; w2_bias: [E, H] (added on rank 0 only).
    Built inside `quantization_scope("mxfp4")`, the weights are held MXFP4 instead:
        w13_weight: uint8 [E, 2 I/tp, H/32 * 17]; w2_weight: uint8 [E, H, I/tp/32 * 17].
    """

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, limit: float, alpha: float
    ):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_per_rank = inter = divide(intermediate_size, self.tp_size)
        self.limit, self.alpha = limit, alpha
        self.quantized = current_quantization() == "mxfp4"
        # A checkpoint's MXFP4 blocks wait here for their scales (or the other way round).
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._held: list[tuple[QuantizedTensor, QuantizedTensor]] = []  # per expert (w13, w2)
        if self.quantized:
            if hidden_size % 32 or inter % 32:
                raise ValueError(
                    f"MXFP4 experts need hidden size ({hidden_size}) and each rank's "
                    f"intermediate size ({inter}) in multiples of 32: use a tensor-parallel "
                    f"size that splits {intermediate_size} into 32-blocks"
                )
            w13_shape: tuple[int, ...] = (num_experts, 2 * inter, hidden_size // 32 * 17)
            w2_shape: tuple[int, ...] = (num_experts, hidden_size, inter // 32 * 17)
            dtype = torch.uint8
        else:
            w13_shape, w2_shape = (
                (num_experts, 2 * inter, hidden_size),
                (num_experts, hidden_size, inter),
            )
            dtype = torch.get_default_dtype()
        self.w13_weight = nn.Parameter(torch.empty(w13_shape, dtype=dtype), requires_grad=False)
        self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * inter), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(w2_shape, dtype=dtype), requires_grad=False)
        self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        for param in (self.w13_weight, self.w13_bias, self.w2_weight, self.w2_bias):
            set_weight_loader(param, self.weight_loader)

    # -- loading ----------------------------------------------------------------------------

    def _rank_gate_up(self, rows: torch.Tensor) -> torch.Tensor:
        """[E, 2I, ...] interleaved (gate j at 2j, up j at 2j + 1) -> this rank's
        [E, 2 I/tp, ...] in [gate ; up] order."""
        inter, start = self.intermediate_per_rank, self.tp_rank * self.intermediate_per_rank
        gate, up = rows[:, 0::2], rows[:, 1::2]
        return torch.cat((gate[:, start : start + inter], up[:, start : start + inter]), dim=1)

    def _check_shape(self, what: str, loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"experts {what}: checkpoint shape {tuple(loaded.shape)} != {expected}"
            )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        """Checkpoint gate_up_proj [E, H, 2I], gate_up_proj_bias [E, 2I], down_proj
        [E, I, H], down_proj_bias [E, H] into this rank's parameters; or MXFP4 `*_blocks` /
        `*_scales` of gate_up_proj and down_proj (shard_id "blocks" / "scales"), loaded once
        both halves of a pair have come."""
        num_experts, hidden = self.num_experts, self.hidden_size
        inter, full = self.intermediate_per_rank, self.intermediate_per_rank * self.tp_size
        if shard_id in ("blocks", "scales"):
            self._load_mxfp4_half(param, loaded_weight, str(shard_id))
            return
        if self.quantized and (param is self.w13_weight or param is self.w2_weight):
            raise ValueError(
                "--quantization mxfp4 holds MXFP4 expert blocks, but this checkpoint's experts "
                "are float tensors (gate_up_proj / down_proj)"
            )
        if param is self.w13_weight:
            self._check_shape("gate_up_proj", loaded_weight, (num_experts, hidden, 2 * full))
            param.data.copy_(self._rank_gate_up(loaded_weight.transpose(1, 2)))
        elif param is self.w13_bias:
            self._check_shape("gate_up_proj_bias", loaded_weight, (num_experts, 2 * full))
            param.data.copy_(self._rank_gate_up(loaded_weight))
        elif param is self.w2_weight:
            self._check_shape("down_proj", loaded_weight, (num_experts, full, hidden))
            start = self.tp_rank * inter
            param.data.copy_(loaded_weight.transpose(1, 2)[:, :, start : start + inter])
        else:
            self._check_shape("down_proj_bias", loaded_weight, (num_experts, hidden))
            param.data.copy_(loaded_weight)

    def _load_mxfp4_half(self, param: nn.Parameter, loaded: torch.Tensor, half: str) -> None:
        key = "gate_up_proj" if param is self.w13_weight else "down_proj"
        pair = self._pending.setdefault(key, {})
        pair[half] = loaded
        if len(pair) < 2:
            return
        del self._pending[key]
        num_experts, hidden, inter = self.num_experts, self.hidden_size, self.intermediate_per_rank
        full = inter * self.tp_size
        # [E, N, K/32 * 17]: each expert's [out, in] rows, blocks along `in`.
        packed = mxfp4_from_checkpoint(pair["blocks"], pair["scales"])
        rows, k = (2 * full, hidden) if key == "gate_up_proj" else (hidden, full)
        self._check_shape(f"{key} MXFP4 (packed)", packed, (num_experts, rows, k // 32 * 17))
        if not self.quantized:  # expand to float: [E, N, K], then as the float tensors load
            weight = torch.stack([
                QuantizedTensor("MXFP4", (rows, k), packed[e].contiguous()).dequantize()
                for e in range(num_experts)
            ])  # fmt: skip
            self.weight_loader(param, weight.transpose(1, 2))
            return
        if key == "gate_up_proj":
            param.data.copy_(self._rank_gate_up(packed))
        else:
            if (self.tp_rank * inter) % 32:
                raise ValueError(
                    f"down_proj columns split at {self.tp_rank * inter}, not a 32-block"
                )
            start = self.tp_rank * inter // 32 * 17
            param.data.copy_(packed[:, :, start : start + inter // 32 * 17])

    def check_loaded(self) -> None:
        """Raises ValueError if a checkpoint gave MXFP4 blocks without their scales (or
        scales without blocks)."""
        for key, pair in self._pending.items():
            missing = {"blocks", "scales"} - set(pair)
            raise ValueError(f"experts {key}: the checkpoint lacks its MXFP4 {missing.pop()}")

    def held_experts(self) -> list[tuple[QuantizedTensor, QuantizedTensor]]:
        """Per expert, (w13, w2) as MXFP4 QuantizedTensors over the parameters' rows."""
        if not self._held:
            shape13 = (2 * self.intermediate_per_rank, self.hidden_size)
            shape2 = (self.hidden_size, self.intermediate_per_rank)
            self._held = [
                (
                    QuantizedTensor("MXFP4", shape13, self.w13_weight.data[e]),
                    QuantizedTensor("MXFP4", shape2, self.w2_weight.data[e]),
                )
                for e in range(self.num_experts)
            ]
        return self._held

    # -- forward ----------------------------------------------------------------------------

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]): x [T, H]; weights, expert_ids
        [T, top_k]. Returns [T, H] in x's dtype (this rank's partial sum under TP)."""
        num_tokens, top_k = expert_ids.shape
        flat_ids = expert_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # rows of expert 0 first, then 1, ...
        sorted_ids = flat_ids.index_select(0, order)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        group_ends = counts.cumsum(0).to(torch.int32)
        rows = x.index_select(0, order // top_k)  # [T*k, H], sorted by expert
        if self.quantized:
            sorted_out = self._experts_mxfp4(rows, counts)
        else:
            sorted_out = self._experts_float(rows, sorted_ids, group_ends)
        out = torch.empty_like(sorted_out).index_copy_(0, order, sorted_out)
        out = out.view(num_tokens, top_k, x.shape[1])
        return (out * weights.to(out.dtype).unsqueeze(-1)).sum(dim=1)

    def _experts_float(
        self, rows: torch.Tensor, sorted_ids: torch.Tensor, group_ends: torch.Tensor
    ) -> torch.Tensor:
        """Every expert over its rows in two grouped GEMMs (fused_moe.py's way)."""
        gate_up = torch._grouped_mm(rows, self.w13_weight.transpose(1, 2), offs=group_ends)
        gate_up = gate_up + self.w13_bias.index_select(0, sorted_ids)
        act = clamped_swiglu(gate_up, self.limit, self.alpha)
        sorted_out = torch._grouped_mm(act, self.w2_weight.transpose(1, 2), offs=group_ends)
        if self.tp_rank == 0:
            sorted_out = sorted_out + self.w2_bias.index_select(0, sorted_ids)
        return sorted_out

    def _experts_mxfp4(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each expert with rows, its held MXFP4 weights over them (quant_linear: the C
        kernel on CPU, Triton on GPU): a host read of the counts, a loop over the experts hit
        (top_k of them at batch 1)."""
        sorted_out = torch.empty_like(rows)
        start = 0
        held = self.held_experts()
        for expert, count in enumerate(counts.tolist()):
            if count == 0:
                continue
            w13, w2 = held[expert]
            end = start + count
            gate_up = quant_linear(rows[start:end], w13, self.w13_bias[expert])
            act = clamped_swiglu(gate_up, self.limit, self.alpha)
            bias = self.w2_bias[expert] if self.tp_rank == 0 else None
            sorted_out[start:end] = quant_linear(act, w2, bias)
            start = end
        return sorted_out


class GptOssMoE(nn.Module):
    """Router + experts of one gpt-oss layer (its `mlp`).

    Args:
        config: the HF GptOssConfig (num_local_experts, num_experts_per_tok,
            intermediate_size, swiglu_limit, swiglu_alpha).
    """

    def __init__(self, config: Any):
        super().__init__()
        num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.router = ReplicatedLinear(config.hidden_size, num_experts, bias=True)
        self.experts = GptOssExperts(
            num_experts,
            config.hidden_size,
            config.intermediate_size,
            float(config.swiglu_limit),
            float(config.swiglu_alpha),
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = select_top_logits(self.router(hidden_states), self.top_k)
        out = self.experts(hidden_states, weights, expert_ids)
        if self.experts.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out
