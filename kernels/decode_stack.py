"""The native decode stack: a decode step's every layer in one C call (csrc/decode_stack.c).

The module path runs a dense decoder layer as ~10 dispatched ops (norms, three GEMMs, rotary,
the KV write, attention, SiLU-and-mul), each a Python call, a ctypes or ATen dispatch and a
new output tensor. At batch 1 on a two-core CPU that Python costs as much as the arithmetic.
`DecodeStack` holds each layer's weight and cache pointers in a C array built once, and its
work buffers; `run` hands a whole stack of layers to C for a decode step of up to `max_rows`
tokens. Weights are read once per step whatever the row count, so a batch-1 step is bound by
the weights' bytes over the memory bandwidth (bench/decode_roofline.py).

It covers what the C code does: a Llama-style pre-norm block (RMSNorm, neox RoPE from a
float32 cos|sin table, GQA attention with an optional window and soft cap, a qkv bias,
SiLU-gated MLP) with float weights in float32 or bfloat16. The model decides whether its
layers are that (models/native_decode.py); everything else runs the module path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvserve.kernels import cpu


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv_w", ctypes.c_void_p),
        ("qkv_b", ctypes.c_void_p),
        ("o_w", ctypes.c_void_p),
        ("gate_up_w", ctypes.c_void_p),
        ("down_w", ctypes.c_void_p),
        ("key_cache", ctypes.c_void_p),
        ("value_cache", ctypes.c_void_p),
        ("cos_sin", ctypes.c_void_p),
        ("sliding_window", ctypes.c_int64),
    ]


class _Shape(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_size", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("is_bf16", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("soft_cap", ctypes.c_float),
        ("pad", ctypes.c_float),
    ]


@dataclass
class StackLayer:
    """One layer's tensors, as the C code reads them.

    Matrices are [out, in], contiguous, in the model dtype: qkv_w [(Hq + 2 Hkv) D, H], o_w
    [H, Hq D], gate_up_w [2 I, H] (gate rows first), down_w [H, I]. Norm weights, the qkv bias
    and cos_sin ([max_position, D], cos | sin halves) are float32. The caches are the layer's
    paged [num_blocks, block_size, Hkv, D] key and value caches.
    """

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    gate_up_w: torch.Tensor
    down_w: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    cos_sin: torch.Tensor
    sliding_window: int | None


@dataclass(frozen=True)
class StackShape:
    """The shape every layer of the stack shares."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate: int
    eps: float
    scale: float
    soft_cap: float | None


def available(dtype: torch.dtype) -> bool:
    return dtype in cpu.DTYPES and cpu.library() is not None


class DecodeStack:
    """A stack of layers run by one C call per decode step.

    Args:
        layers: the layers in order; their tensors must outlive the stack (it holds them).
        shape: what they share.
        dtype: float32 or bfloat16 (the weights', caches' and activations' dtype).
        max_rows: the most tokens a step may have (work buffers are sized for it).
    """

    def __init__(
        self, layers: list[StackLayer], shape: StackShape, dtype: torch.dtype, max_rows: int
    ) -> None:
        lib = cpu.library()
        assert lib is not None and dtype in cpu.DTYPES
        self._fn = lib.decode_stack
        self.layers, self.shape, self.dtype, self.max_rows = layers, shape, dtype, max_rows
        block_size = layers[0].key_cache.shape[1]
        for layer in layers:
            _check_layer(layer, shape, dtype, block_size)
        self._c_layers = (_Layer * len(layers))(
            *(
                _Layer(
                    layer.input_norm.data_ptr(),
                    layer.post_norm.data_ptr(),
                    layer.qkv_w.data_ptr(),
                    None if layer.qkv_b is None else layer.qkv_b.data_ptr(),
                    layer.o_w.data_ptr(),
                    layer.gate_up_w.data_ptr(),
                    layer.down_w.data_ptr(),
                    layer.key_cache.data_ptr(),
                    layer.value_cache.data_ptr(),
                    layer.cos_sin.data_ptr(),
                    layer.sliding_window or 0,
                )
                for layer in layers
            )
        )
        self._c_shape = _Shape(
            shape.hidden,
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_size,
            shape.intermediate,
            block_size,
            int(dtype == torch.bfloat16),
            shape.eps,
            shape.scale,
            shape.soft_cap or 0.0,
            0.0,
        )
        qd, kvd = shape.num_heads * shape.head_size, shape.num_kv_heads * shape.head_size
        per_row = 3 * shape.hidden + qd + 2 * kvd + 3 * qd + 3 * shape.intermediate
        self._work = torch.empty(max_rows * per_row + 16, dtype=torch.float32)
        self._token_rows = torch.arange(max_rows, dtype=torch.int64)

    def run(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer for M tokens, one per request (a decode step, M <= max_rows).

        hidden, residual: [M, H] as the module path's (hidden_states, residual); residual
        None when the stack starts at the model's first layer. positions, slot_mapping: [M]
        int64; block_table [M, max_blocks] int32; seq_lens [M] int32. Returns the last
        layer's (hidden_states, residual), new tensors.
        """
        num_rows = hidden.shape[0]
        assert 0 < num_rows <= self.max_rows and hidden.dtype == self.dtype
        assert positions.dtype == slot_mapping.dtype == torch.int64
        assert block_table.dtype == seq_lens.dtype == torch.int32
        assert block_table.stride(1) == 1 and block_table.shape[0] >= num_rows
        has_residual = residual is not None
        hidden = hidden.contiguous().clone()
        residual = torch.empty_like(hidden) if residual is None else residual.contiguous().clone()
        # Locals: each must outlive the call (a .contiguous() copy would not).
        positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
        seq_lens = seq_lens.contiguous()
        self._fn(
            self._c_layers,
            ctypes.c_int(len(self.layers)),
            ctypes.byref(self._c_shape),
            ctypes.c_void_p(hidden.data_ptr()),
            ctypes.c_void_p(residual.data_ptr()),
            ctypes.c_int(int(has_residual)),
            ctypes.c_int(num_rows),
            ctypes.c_void_p(positions.data_ptr()),
            ctypes.c_void_p(slot_mapping.data_ptr()),
            ctypes.c_void_p(block_table.data_ptr()),
            ctypes.c_int64(block_table.stride(0)),
            ctypes.c_void_p(seq_lens.data_ptr()),
            ctypes.c_void_p(self._token_rows.data_ptr()),
            ctypes.c_void_p(self._work.data_ptr()),
        )
        return hidden, residual


def _check_layer(layer: StackLayer, shape: StackShape, dtype: torch.dtype, block_size: int):
    """The C code's reading of a layer's tensors holds (a broken one would read garbage)."""
    qd, kvd = shape.num_heads * shape.head_size, shape.num_kv_heads * shape.head_size
    h, i = shape.hidden, shape.intermediate
    expected = {
        "qkv_w": (layer.qkv_w, (qd + 2 * kvd, h), dtype),
        "o_w": (layer.o_w, (h, qd), dtype),
        "gate_up_w": (layer.gate_up_w, (2 * i, h), dtype),
        "down_w": (layer.down_w, (h, i), dtype),
        "input_norm": (layer.input_norm, (h,), torch.float32),
        "post_norm": (layer.post_norm, (h,), torch.float32),
    }
    if layer.qkv_b is not None:
        expected["qkv_b"] = (layer.qkv_b, (qd + 2 * kvd,), torch.float32)
    for name, (tensor, size, want) in expected.items():
        if tuple(tensor.shape) != size or tensor.dtype != want or not tensor.is_contiguous():
            raise ValueError(
                f"{name}: {tuple(tensor.shape)} {tensor.dtype}, want {size} {want} contiguous"
            )
    cache_shape = (block_size, shape.num_kv_heads, shape.head_size)
    for cache in (layer.key_cache, layer.value_cache):
        if tuple(cache.shape[1:]) != cache_shape or cache.dtype != dtype:
            raise ValueError(f"a KV cache of {tuple(cache.shape)} {cache.dtype}")
        if not cache.is_contiguous():
            raise ValueError("a KV cache is not contiguous")
    cos_sin = layer.cos_sin
    if cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous():
        raise ValueError("cos_sin must be contiguous float32")
    if cos_sin.shape[1] != shape.head_size:
        raise ValueError(f"cos_sin rows of {cos_sin.shape[1]}, want {shape.head_size}")
