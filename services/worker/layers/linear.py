"""Linear layers that split their weight across tensor-parallel ranks.

Each parameter carries `weight_loader(param, loaded_weight, shard_id=None)`, which copies this
rank's slice of a full checkpoint tensor into it. Fused layers (QKV, gate|up) take one
checkpoint tensor per shard:

    QKVParallelLinear weight rows on one rank:  [ q (Hq/tp * D) | k (Hkv/tp * D) | v (Hkv/tp * D) ]
    MergedColumnParallelLinear rows:            [ shard 0 / tp  | shard 1 / tp | ... ]

How a layer stores its weight and computes x W^T is its `quant_method` (vLLM's
QuantizeMethodBase): `UnquantizedLinearMethod` (a float parameter, the measured CPU GEMM) or
`QuantizedLinearMethod` (GGUF blocks or int8, kernels/quant.py). The method is picked at
construction from `quantization_scope` (set by the model loader). The loaders below only pick
this rank's rows and columns of a checkpoint tensor and hand them to the method with the row
offset they go to (`load_rows`); a checkpoint tensor may be a float tensor or a
`QuantizedTensor`, which splits by rows and by block-aligned columns.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from kvserve import kernels
from kvserve.kernels.gemm import LinearWeights
from kvserve.kernels.quant import (
    QuantizedTensor,
    cat_rows,
    quant_linear,
    quantize_int8,
    same_perm,
)
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


def set_weight_loader(param: torch.Tensor, loader: Callable[..., None]) -> None:
    """Attach the function that copies a checkpoint tensor into param; the model's
    load_weights finds it as `getattr(param, "weight_loader", default_weight_loader)`."""
    param.weight_loader = loader  # type: ignore[attr-defined]  # a tensor takes any attribute


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if isinstance(src, QuantizedTensor):
        src = src.dequantize()
    if dst.shape != src.shape:
        raise ValueError(
            f"checkpoint shard shape {tuple(src.shape)} does not match "
            f"parameter shard shape {tuple(dst.shape)}"
        )
    dst.copy_(src)


# ---------------------------------------------------------------------- quant methods

_QUANT_SCOPE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvserve_linear_quantization", default=None
)
# mxfp4 holds only gpt-oss's MoE experts (layers/gpt_oss_moe.py): linear layers stay float,
# as the published checkpoints keep them.
# 8-bit checkpoints held as stored (services/worker/quant_formats/eight_bit.py; fp8 loads
# float linears: build_quantized builds those with no quantization); awq, gptq and
# compressed-tensors' pack-quantized: 4-bit checkpoints (services/worker/quant_formats/int4.py),
# held like gguf's blocks.
LINEAR_QUANTIZATIONS: tuple[str, ...] = (
    "gguf", "int8", "mxfp4", "awq", "gptq", "compressed-tensors", "fp8"
)  # fmt: skip


@contextlib.contextmanager
def quantization_scope(method: str | None) -> Iterator[None]:
    """Linear layers built inside hold their weights as `method` (None: float)."""
    if method is not None and method not in LINEAR_QUANTIZATIONS:
        raise ValueError(f"unknown quantization {method!r}; have {LINEAR_QUANTIZATIONS}")
    token = _QUANT_SCOPE.set(method)
    try:
        yield
    finally:
        _QUANT_SCOPE.reset(token)


def current_quantization() -> str | None:
    return _QUANT_SCOPE.get()


def _placeholder() -> nn.Parameter:
    """The `weight` parameter of a layer whose weight lives elsewhere: loaders find it by
    name; it holds nothing."""
    return nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)


class LinearMethod:
    """How a linear layer holds its weight and computes y = x W^T + b."""

    def create_weights(self, layer: LinearBase) -> None:
        raise NotImplementedError

    def load_rows(self, layer: LinearBase, row_offset: int, src) -> None:
        """Put src (rows of this rank's weight, all its columns) at row_offset."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        pass

    def apply(
        self,
        layer: LinearBase,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        add: torch.Tensor | None = None,
    ):
        """x W^T + b, plus `add` ([T, N]) when given: fused where `fuses_add` says."""
        raise NotImplementedError

    def fuses_add(self, layer: LinearBase, x: torch.Tensor) -> bool:
        """Whether apply(..., add=) adds inside the GEMM for x (no pass of its own)."""
        return False

    def weight_bytes(self, layer: LinearBase) -> int:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    """A float weight parameter [output_size, input_size], multiplied on the GEMM path the
    CPU plan names (kernels.linear)."""

    def create_weights(self, layer):
        layer.weight = nn.Parameter(
            torch.empty(layer.output_size, layer.input_size), requires_grad=False
        )

    def load_rows(self, layer, row_offset, src):
        _copy_checked(layer.weight.data.narrow(0, row_offset, src.shape[0]), src)

    def apply(self, layer, x, bias, add=None):
        return kernels.linear(x, layer.weight, bias, layer.gemm, add)

    def fuses_add(self, layer, x):
        return kernels.linear_fuses_add(x.device, layer.gemm, x.shape[0])

    def weight_bytes(self, layer):
        return layer.weight.numel() * layer.weight.element_size()


class QuantizedLinearMethod(LinearMethod):
    """The weight held quantized, never expanded to float (kernels/quant.py).

    gguf: each checkpoint tensor keeps its GGUF blocks; shards of one fused layer may differ in
        type (then each runs its own kernel into its columns of the output). A shard of a type
        kernels/quant.py lacks arrives as float and is kept as float.
    int8: a float parameter is loaded as usual, then quantized per output channel.
    """

    def __init__(self, method: str):
        self.method = method

    def create_weights(self, layer):
        layer.quant_parts = []  # (row offset, rows) as loaded: list[tuple[int, Tensor | QT]]
        layer.params_dtype = torch.get_default_dtype()  # the model's dtype (set while built)
        if self.method == "int8":
            UnquantizedLinearMethod().create_weights(layer)
        else:
            layer.weight = _placeholder()

    def load_rows(self, layer, row_offset, src):
        if self.method == "int8":
            UnquantizedLinearMethod().load_rows(layer, row_offset, src)
            return
        if src.shape[1] != layer.input_size:
            raise ValueError(
                f"checkpoint shard has {src.shape[1]} input features, the layer {layer.input_size}"
            )
        device = layer.weight.device
        if isinstance(src, QuantizedTensor):
            src = src.to(device).contiguous()
        else:
            src = src.to(device, layer.params_dtype).contiguous()
        layer.quant_parts.append((row_offset, src))

    def process_weights_after_loading(self, layer):
        if self.method == "int8":
            weight = layer.weight.detach()
            layer.quant_parts = [(0, quantize_int8(weight))]
            layer.weight = _placeholder()
            set_weight_loader(layer.weight, layer.weight_loader)
            return
        parts = sorted(layer.quant_parts, key=lambda p: p[0])
        merged: list[tuple[int, QuantizedTensor | torch.Tensor]] = []
        end = 0
        for offset, part in parts:
            if offset != end:
                what = (
                    f"rows {end}..{offset} missing"
                    if offset > end
                    else f"row {offset} loaded twice"
                )
                raise ValueError(f"{type(layer).__name__}: checkpoint {what}")
            end = offset + part.shape[0]
            prev = merged[-1][1] if merged else None
            if (
                isinstance(part, QuantizedTensor)
                and isinstance(prev, QuantizedTensor)
                and prev.qtype == part.qtype
                and same_perm(prev, part)
            ):
                merged[-1] = (merged[-1][0], cat_rows([prev, part]))
            elif isinstance(part, torch.Tensor) and isinstance(prev, torch.Tensor):
                merged[-1] = (merged[-1][0], torch.cat([prev, part]))
            else:
                merged.append((offset, part))
        if end != layer.output_size:
            raise ValueError(
                f"{type(layer).__name__}: loaded {end} of its {layer.output_size} weight rows"
            )
        layer.quant_parts = merged

    def apply(self, layer, x, bias, add=None):
        y = self._apply(layer, x, bias)
        return y if add is None else y + add

    def _apply(self, layer, x, bias):
        parts = layer.quant_parts
        if len(parts) == 1 and isinstance(parts[0][1], QuantizedTensor):
            return quant_linear(x, parts[0][1], bias)
        out = torch.empty(x.shape[0], layer.output_size, dtype=torch.float32, device=x.device)
        for offset, part in parts:
            view = out[:, offset : offset + part.shape[0]]
            if isinstance(part, QuantizedTensor):
                quant_linear(x, part, None, out=view)
            else:
                view.copy_(torch.nn.functional.linear(x, part.to(x.dtype)))
        if bias is not None:
            out += bias.float()
        return out.to(x.dtype)

    def weight_bytes(self, layer):
        return sum(
            p.nbytes if isinstance(p, QuantizedTensor) else p.numel() * p.element_size()
            for _, p in layer.quant_parts
        )


def make_linear_method(method: str | None) -> LinearMethod:
    if method is None or method == "mxfp4":
        return UnquantizedLinearMethod()
    return QuantizedLinearMethod(method)


class LinearBase(nn.Module):
    """y = x W^T + b with W: [output_size, input_size] local to this rank.

    Args:
        input_size, output_size: this rank's (already split) sizes.
        bias: whether the layer has a bias of output_size.
        quant_method: how W is held (default: from `quantization_scope`, float outside one).
    """

    weight: nn.Parameter  # set by quant_method.create_weights
    bias: nn.Parameter | None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_method: LinearMethod | None = None,
    ):
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.input_size = input_size
        self.output_size = output_size
        self.quant_method = quant_method or make_linear_method(current_quantization())
        self.quant_method.create_weights(self)
        set_weight_loader(self.weight, self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)
        # The CPU GEMM plan and packed weight, set after loading (cpu_tuning.prepare_gemm).
        self.gemm: LinearWeights | None = None

    @property
    def is_quantized(self) -> bool:
        return not isinstance(self.quant_method, UnquantizedLinearMethod)

    def weight_bytes(self) -> int:
        """Bytes of this rank's weight as held (the bias not counted)."""
        return self.quant_method.weight_bytes(self)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def _load(self, param: nn.Parameter, row_offset: int, src) -> None:
        """src: rows for this rank's weight (or bias) starting at row_offset."""
        if param is self.bias:
            _copy_checked(param.data.narrow(0, row_offset, src.shape[0]), src)
        else:
            self.quant_method.load_rows(self, row_offset, src)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None
    ) -> None:
        """shard_id: which part of a fused layer loaded_weight is, of the layer's own type
        (an index, "q"/"k"/"v"); None for a whole checkpoint tensor."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """The same full weight on every rank."""

    def weight_loader(self, param, loaded_weight, shard_id=None):
        assert shard_id is None, "an unsplit parameter has no shards"
        rows = self.output_size
        if tuple(loaded_weight.shape) != (
            (rows,) if param is self.bias else (rows, self.input_size)
        ):
            raise ValueError(
                f"checkpoint tensor shape {tuple(loaded_weight.shape)} does not match "
                f"the layer's {(rows, self.input_size)}"
            )
        self._load(param, 0, loaded_weight)


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
        rows = self.output_size
        self._load(param, 0, loaded_weight.narrow(0, self.tp_rank * rows, rows))


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
        self._load(param, offset, loaded_weight.narrow(0, self.tp_rank * size, size))


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
        self._load(param, offset, loaded_weight.narrow(0, self.tp_rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce.

    Args:
        input_size: full input features, split into input_size / tp per rank.
        output_size: full output features.
        bias: whether the layer has a bias (added once, on rank 0, before the sum).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, get_tp_size()), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id=None):
        assert shard_id is None, f"{type(self).__name__} has no shards"
        if param is self.bias:  # the bias is not split
            self._load(param, 0, loaded_weight)
            return
        cols = self.input_size
        self._load(param, 0, loaded_weight.narrow(1, self.tp_rank * cols, cols))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + b, summed over the ranks; + residual when given (added once, on rank 0,
        before the sum, like the bias: into the GEMM where `adds_residual` says)."""
        rank0 = self.tp_rank == 0
        y = self.quant_method.apply(
            self, x, self.bias if rank0 else None, residual if rank0 else None
        )
        if self.tp_size > 1:
            y = tensor_model_parallel_all_reduce(y)
        return y

    def adds_residual(self, x: torch.Tensor) -> bool:
        """Whether forward(x, residual) adds the residual inside the GEMM, so that the caller
        should hand it over rather than add it with a norm. One rank: with more, each rank's
        measured GEMM plan could answer differently, and all must take the same branch."""
        return self.tp_size == 1 and self.quant_method.fuses_add(self, x)
