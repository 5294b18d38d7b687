"""Mixture-of-experts feed-forward: top-k routing and all experts in two grouped GEMMs.

No Python loop over experts: the (token, expert) rows are sorted by expert, then one grouped
GEMM per projection (`torch._grouped_mm`, the group ends as offsets) reads each chosen
expert's weights once for all its rows, and the outputs go back to token order, summed by
the routing weights.

The alternative, each row gathering its expert's weights for a batched mat-vec, was 3-30x
slower at every size on this CPU, decode included (the gather copies top_k expert matrices
per token); a Python loop over experts was 2-10 % slower than the grouped GEMM. See
`bench/moe_paths.py` and bench/RESULTS.md.

Tensor parallelism splits every expert's intermediate dim: each rank holds the same rows of
w1/w3 and the same columns of w2 for all experts, and the partial outputs are all-reduced,
as in a row-parallel MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve import kernels
from kvserve.services.worker.layers.linear import divide, set_weight_loader
from kvserve.services.worker.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_reduce,
)


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (float32), keep the top_k, optionally rescale them to sum to 1.

    router_logits: [T, E]. Returns (weights [T, top_k] float32, expert ids [T, top_k] int64).
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    weights_on_input: bool = False,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), the experts SiLU-gated MLPs; with
    weights_on_input, sum_k expert_{ids[t, k]}(weights[t, k] * x[t]) (Llama 4: the router's
    score scales what the expert reads, in x's dtype).

    x: [T, H]; w13: [E, 2I, H] ([gate ; up] rows); w2: [E, H, I]; weights, expert_ids:
    [T, top_k]. Returns [T, H] in x's dtype. `_grouped_mm` needs rows of 16-byte multiples:
    H and I / tp multiples of 8 (every released MoE's are).
    """
    num_tokens, top_k = expert_ids.shape
    num_experts = w13.shape[0]
    flat_ids = expert_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # rows of expert 0 first, then 1, ...
    # Rows per expert by scatter_add, not bincount: bincount reads its input's max on the
    # host, a sync a CUDA graph capture cannot hold (services/worker/cuda_graphs.py).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    group_ends = counts.cumsum(0).to(torch.int32)
    rows = x.index_select(0, order // top_k)  # [T*k, H], sorted by expert
    if weights_on_input:
        rows = rows * weights.reshape(-1).to(x.dtype).index_select(0, order).unsqueeze(-1)
    gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=group_ends)
    act = kernels.silu_and_mul(gate_up)
    sorted_out = torch._grouped_mm(act, w2.transpose(1, 2), offs=group_ends)  # [T*k, H]
    out = torch.empty_like(sorted_out).index_copy_(0, order, sorted_out)
    out = out.view(num_tokens, top_k, x.shape[1])
    if weights_on_input:
        return out.sum(dim=1)
    return (out * weights.to(out.dtype).unsqueeze(-1)).sum(dim=1)


class FusedMoE(nn.Module):
    """The experts of one MoE block (SiLU-gated MLPs), with top-k routing.

    Args:
        num_experts: experts in the block (E).
        top_k: experts each token is sent to.
        hidden_size: H.
        intermediate_size: each expert's full MLP width (I), split across TP ranks.
        renormalize: rescale the top_k routing weights to sum to 1 (Mixtral: yes).

    Parameters, loaded per expert from w1 (gate), w3 (up) and w2 (down) checkpoint tensors
    (`weight_loader(param, tensor, (expert_id, "w1" | "w2" | "w3"))`):
        w13_weight: [E, 2 * I / tp, H], each expert's [gate ; up] rows of this rank.
        w2_weight: [E, H, I / tp].
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool = True,
    ):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.top_k = top_k
        self.renormalize = renormalize
        self.intermediate_per_rank = divide(intermediate_size, self.tp_size)
        inter = self.intermediate_per_rank
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, inter), requires_grad=False
        )
        set_weight_loader(self.w13_weight, self.weight_loader)
        set_weight_loader(self.w2_weight, self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: tuple[int, str]
    ) -> None:
        expert_id, name = shard_id
        inter = self.intermediate_per_rank
        hidden = self.w2_weight.shape[1]
        full_shape = (
            (hidden, inter * self.tp_size) if name == "w2" else (inter * self.tp_size, hidden)
        )
        if tuple(loaded_weight.shape) != full_shape:
            raise ValueError(
                f"expert {expert_id} {name}: checkpoint shape {tuple(loaded_weight.shape)} "
                f"!= {full_shape}"
            )
        if name == "w2":  # [H, I]: this rank's columns
            dst, src = param.data[expert_id], loaded_weight.narrow(1, self.tp_rank * inter, inter)
        else:  # [I, H]: this rank's rows, into the gate half (w1) or the up half (w3)
            offset = 0 if name == "w1" else inter
            dst = param.data[expert_id].narrow(0, offset, inter)
            src = loaded_weight.narrow(0, self.tp_rank * inter, inter)
        dst.copy_(src)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden_states: [T, H]; router_logits: [T, E]. Returns [T, H]."""
        weights, expert_ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = fused_experts(hidden_states, self.w13_weight, self.w2_weight, weights, expert_ids)
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out
