"""Batched LoRA linears: the model's own linear layers, wrapped from outside after the build.

Each wrapped layer holds every slot's adapter stacked and padded to max_lora_rank R. A fused
layer has one rank block per slice (qkv_proj: q | k | v, gate_up_proj: gate | up), so its B
is block diagonal and one shrink and one expand serve all slices:

    lora_a[slot]: [n * R, in]         rows [i*R, i*R + r) = slice i's A (rest zero)
    lora_b[slot]: [out, n * R]        rows of slice i x cols [i*R, i*R + r) = scaling * B_i

    y = base(x);  for each slot in the step:  y[rows] += (x[rows] A^T) B^T

The step's tokens are grouped by slot (`LoRAStep.segments`): a request's tokens are
contiguous in the flattened batch, so a slot's tokens are often one contiguous run (a view,
no copy); otherwise they are gathered and scattered back with index ops. The forward runs
once per step whatever the mix of adapters.

Tensor parallelism, as vLLM: a column-parallel layer keeps A whole and its rank's rows of B;
a row-parallel layer keeps its rank's columns of A, so each rank's shrink is a partial sum:
those [T, n * R] partials are all-reduced (small) before the expand, and the base layer
keeps its own all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.services.worker.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvserve.services.worker.parallel_state import tensor_model_parallel_all_reduce
from kvserve.shared.lora import SUPPORTED_TARGET_MODULES

# One slot's tokens in a step: a contiguous run, or their indices.
Rows = slice | torch.Tensor


class LoRAStep:
    """Which tokens of the current step run with which slot; shared by every wrapped layer
    and set by the LoRAManager before each forward."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, Rows]] = []


class LoRALinear(nn.Module):
    """A linear layer plus the LoRA of each slot.

    Args:
        base_layer: the model's layer (its forward(x) is called as is).
        slices: (HF module name, local output size) per fused slice, in output order.
        row_parallel: the layer splits its input across TP ranks.
        max_loras, max_lora_rank: slots and padded rank.
        step: the step's token grouping.
        dtype, device: of the stacked weights.
    """

    lora_a: torch.Tensor  # [max_loras, slices * max_lora_rank, in], a buffer
    lora_b: torch.Tensor  # [max_loras, out, slices * max_lora_rank], a buffer

    def __init__(
        self,
        base_layer: LinearBase,
        slices: list[tuple[str, int]],
        row_parallel: bool,
        max_loras: int,
        max_lora_rank: int,
        step: LoRAStep,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.base_layer = base_layer
        self.slices = slices
        self.row_parallel = row_parallel
        self.tp_rank, self.tp_size = base_layer.tp_rank, base_layer.tp_size
        self.max_lora_rank = max_lora_rank
        self.step = step
        num_ranks = len(slices) * max_lora_rank
        output_size = sum(size for _, size in slices)
        assert output_size == base_layer.output_size, (slices, base_layer.output_size)
        # Buffers, not parameters: the checkpoint loader and the GEMM plan never see them.
        self.register_buffer(
            "lora_a",
            torch.zeros(max_loras, num_ranks, base_layer.input_size, dtype=dtype, device=device),
            persistent=False,
        )
        self.register_buffer(
            "lora_b",
            torch.zeros(max_loras, output_size, num_ranks, dtype=dtype, device=device),
            persistent=False,
        )

    def set_slot(
        self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None], scaling: float
    ) -> None:
        """Write one adapter into `slot`: per slice its full (unsplit) (A [r, in], B [out, r])
        or None when the adapter leaves that slice alone."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        rank_block, row = self.max_lora_rank, 0
        for i, ((_, size), pair) in enumerate(zip(self.slices, pairs, strict=True)):
            if pair is not None:
                a, b = pair
                r = a.shape[0]
                if self.row_parallel:
                    a = a.narrow(
                        1, self.tp_rank * self.base_layer.input_size, self.base_layer.input_size
                    )
                else:
                    b = b.narrow(0, self.tp_rank * size, size)
                cols = slice(i * rank_block, i * rank_block + r)
                self.lora_a[slot, cols].copy_(a)
                self.lora_b[slot, row : row + size, cols].copy_(b * scaling)
            row += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        segments = self.step.segments
        if not segments:
            return y
        if self.row_parallel and self.tp_size > 1:
            return self._add_reduced(x, y, segments)
        for slot, rows in segments:
            if isinstance(rows, slice):
                y[rows].addmm_(F.linear(x[rows], self.lora_a[slot]), self.lora_b[slot].t())
            else:
                shrunk = F.linear(x.index_select(0, rows), self.lora_a[slot])
                y.index_add_(0, rows, F.linear(shrunk, self.lora_b[slot]))
        return y

    def _add_reduced(
        self, x: torch.Tensor, y: torch.Tensor, segments: list[tuple[int, Rows]]
    ) -> torch.Tensor:
        # Every rank has the same segments, so each makes the same one all-reduce.
        shrunk = x.new_zeros(x.shape[0], self.lora_a.shape[1])
        for slot, rows in segments:
            if isinstance(rows, slice):
                shrunk[rows] = F.linear(x[rows], self.lora_a[slot])
            else:
                shrunk.index_copy_(0, rows, F.linear(x.index_select(0, rows), self.lora_a[slot]))
        shrunk = tensor_model_parallel_all_reduce(shrunk)
        for slot, rows in segments:
            if isinstance(rows, slice):
                y[rows].addmm_(shrunk[rows], self.lora_b[slot].t())
            else:
                delta = F.linear(shrunk.index_select(0, rows), self.lora_b[slot])
                y.index_add_(0, rows, delta)
        return y


def _slices_of(name: str, layer: LinearBase, packed: dict[str, list[str]]) -> list[tuple[str, int]]:
    """(HF name, local output size) of each slice of a layer named `name` (its last part)."""
    if isinstance(layer, QKVParallelLinear):
        q_size = layer.num_heads * layer.head_size
        kv_size = layer.num_kv_heads * layer.head_size
        return list(zip(packed[name], (q_size, kv_size, kv_size), strict=True))
    if isinstance(layer, MergedColumnParallelLinear):
        sizes = [size // layer.tp_size for size in layer.output_sizes]
        return list(zip(packed[name], sizes, strict=True))
    return [(name, layer.output_size)]


def wrap_linear_layers(
    model: nn.Module, max_loras: int, max_lora_rank: int, dtype: torch.dtype, device: torch.device
) -> tuple[dict[str, LoRALinear], LoRAStep]:
    """Replace every linear layer an adapter may target by a LoRALinear around it.

    Returns:
        The wrapped layers by the module name of the layer they replaced
        ("model.layers.0.self_attn.qkv_proj"), and the step they share.
    """
    packed: dict[str, list[str]] = {}
    for src, (dst, _) in getattr(model, "packed_modules_mapping", {}).items():
        packed.setdefault(dst, []).append(src)
    step = LoRAStep()
    wrapped: dict[str, LoRALinear] = {}
    for module_name, module in list(model.named_modules()):
        parent_name, _, attr = module_name.rpartition(".")
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
            continue
        if not set(packed.get(attr, [attr])) <= SUPPORTED_TARGET_MODULES:
            continue
        layer = LoRALinear(
            module,
            _slices_of(attr, module, packed),
            isinstance(module, RowParallelLinear),
            max_loras,
            max_lora_rank,
            step,
            dtype,
            device,
        )
        setattr(model.get_submodule(parent_name), attr, layer)
        wrapped[module_name] = layer
    return wrapped, step
