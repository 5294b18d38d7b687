"""Linear layers that split their weight across tensor-parallel ranks.

Each parameter carries `weight_loader(param, loaded_weight, shard_id=None)`, which copies this
rank's slice of a full checkpoint tensor into it. Fused layers (QKV, gate|up) take one
checkpoint tensor per shard:

    QKVParallelLinear weight rows on one rank:  [ q (Hq/tp * D) | k (Hkv/tp * D) | v (Hkv/tp * D) ]
    MergedColumnParallelLinear rows:            [ shard 0 / tp  | shard 1 / tp | ... ]
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve import kernels
from kvserve.kernels.gemm import LinearWeights
from kvserve.services.worker.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_reduce,
)


def divide(numerator: int, denominator: int) -> int:
    """numerator / denominator, which must divide exactly (a TP split that fits)."""
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


def default_weight_loader(
    param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
) -> None:
    """Copy a whole (unsplit) checkpoint tensor into param."""
    assert shard_id is None, "an unsplit parameter has no shards"
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor shape {tuple(loaded_weight.shape)} does not match "
            f"parameter shape {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"checkpoint shard shape {tuple(src.shape)} does not match "
            f"parameter shard shape {tuple(dst.shape)}"
        )
    dst.copy_(src)


class LinearBase(nn.Module):
    """y = x W^T + b with W: [output_size, input_size] local to this rank.

    Args:
        input_size, output_size: this rank's (already split) sizes.
        bias: whether the layer has a bias of output_size.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        # The CPU GEMM plan and packed weight, set after loading (ModelRunner.prepare_gemm).
        self.gemm: LinearWeights | None = None

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias, self.gemm)


class ReplicatedLinear(LinearBase):
    """The same full weight on every rank."""

    def weight_loader(self, param, loaded_weight, shard_id=None):
        default_weight_loader(param, loaded_weight, shard_id)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice (no communication).

    Args:
        input_size: full input features.
        output_size: full output features, split into output_size / tp per rank.
        bias: whether the layer has a bias (split like the output).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, get_tp_size()), bias)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        assert shard_id is None, f"{type(self).__name__} has no shards"
        rows = param.shape[0]
        _copy_checked(param.data, loaded_weight.narrow(0, self.tp_rank * rows, rows))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers fused into one matmul (e.g. gate_proj | up_proj).

    Args:
        input_size: full input features.
        output_sizes: full output features of each fused layer, in order.
        bias: whether the layers have biases.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param, loaded_weight, shard_id: int | None = None):
        if shard_id is None:  # an already fused checkpoint tensor: load it shard by shard
            for i, part in enumerate(loaded_weight.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        local_sizes = [divide(size, self.tp_size) for size in self.output_sizes]
        offset, size = sum(local_sizes[:shard_id]), local_sizes[shard_id]
        _copy_checked(
            param.data.narrow(0, offset, size), loaded_weight.narrow(0, self.tp_rank * size, size)
        )


class QKVParallelLinear(ColumnParallelLinear):
    """q_proj, k_proj and v_proj fused, split by heads across ranks.

    Args:
        hidden_size: input features.
        head_size: features per head (D).
        total_num_heads: query heads of the whole model.
        total_num_kv_heads: key/value heads of the whole model (GQA when fewer).
        bias: whether q/k/v have biases (Qwen2 does).
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ):
        tp_size = get_tp_size()
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp_size)
        self.num_kv_heads = divide(total_num_kv_heads, tp_size)
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param, loaded_weight, shard_id: str | None = None):
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        if shard_id is None:  # an already fused checkpoint tensor
            full = [q_size * self.tp_size, kv_size * self.tp_size, kv_size * self.tp_size]
            for sid, part in zip("qkv", loaded_weight.split(full, dim=0)):
                self.weight_loader(param, part, sid)
            return
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[
            shard_id
        ]
        _copy_checked(
            param.data.narrow(0, offset, size), loaded_weight.narrow(0, self.tp_rank * size, size)
        )


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce.

    Args:
        input_size: full input features, split into input_size / tp per rank.
        output_size: full output features.
        bias: whether the layer has a bias (added once, on rank 0, before the sum).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, get_tp_size()), output_size, bias)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        assert shard_id is None, f"{type(self).__name__} has no shards"
        if param.dim() == 1:  # the bias is not split
            _copy_checked(param.data, loaded_weight)
            return
        cols = param.shape[1]
        _copy_checked(param.data, loaded_weight.narrow(1, self.tp_rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Every rank would add the bias before the sum: only rank 0 does.
        y = kernels.linear(x, self.weight, self.bias if self.tp_rank == 0 else None, self.gemm)
        if self.tp_size > 1:
            y = tensor_model_parallel_all_reduce(y)
        return y
