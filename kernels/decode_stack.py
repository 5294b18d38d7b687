"""The native decode stack: a decode step's every layer in one C call (csrc/decode_stack.c).

The module path runs a dense decoder layer as ~10 dispatched ops (norms, three GEMMs, rotary,
the KV write, attention, SiLU-and-mul), each a Python call, a ctypes or ATen dispatch and a
new output tensor. At batch 1 on a two-core CPU that Python costs as much as the arithmetic.
`DecodeStack` holds each layer's weight and cache pointers in a C array built once, and its
work buffers; `run` hands a whole stack of layers to C for a step of up to `max_requests`
requests (a decode step; a speculative verify step of 1 + k tokens each; a short prefill).
Weights are read once per step whatever the row count, so a batch-1 step is bound by the
weights' bytes over the memory bandwidth (bench/decode_roofline.py). Each token's result is
computed alone (the GEMV's sums, the norms and its attention do not depend on the other rows),
so it is bit for bit the same whatever shares its step.

It covers what the C code does: a Llama-style pre-norm block (RMSNorm, neox RoPE from a
float32 cos|sin table, GQA attention with an optional window and soft cap, a qkv bias,
SiLU-gated MLP) with float weights in float32 or bfloat16. The model decides whether its
layers are that (models/native_decode.py); everything else runs the module path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvserve.kernels import cpu, int4, quant, w8a8
from kvserve.kernels.quant import QTYPES, QuantizedTensor

MAX_PARTS = 4  # STACK_MAX_PARTS
# A W8A8 part packed for csrc/w8a8.c's AMX-INT8 kernel (STACK_AMX_W8A8): what the stack runs
# for W8A8 weights where that kernel runs (the module path's kernel too, kernels/w8a8.py).
AMX_W8A8 = 300


class _Part(ctypes.Structure):
    _fields_ = [
        ("w", ctypes.c_void_p),
        ("wscale", ctypes.c_void_p),
        ("qtype", ctypes.c_int64),
        ("ldw", ctypes.c_int64),
        ("row_offset", ctypes.c_int64),
        ("rows", ctypes.c_int64),
    ]


class _Matrix(ctypes.Structure):
    _fields_ = [("parts", _Part * MAX_PARTS), ("num_parts", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", _Matrix),
        ("qkv_b", ctypes.c_void_p),
        ("o", _Matrix),
        ("gate_up", _Matrix),
        ("down", _Matrix),
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
        ("kvq_linear", ctypes.c_void_p),
        ("amx_linear", ctypes.c_void_p),
    ]


# A matrix as the C code reads it: (first output row, those rows' weight) in row order, each
# weight a float tensor [rows, K] in the model dtype or a QuantizedTensor (GGUF blocks, int8).
Matrix = list[tuple[int, "torch.Tensor | QuantizedTensor"]]


def _c_matrix(parts: Matrix, amx: bool) -> _Matrix:
    matrix = _Matrix()
    matrix.num_parts = len(parts)
    for i, (offset, weight) in enumerate(parts):
        if amx and isinstance(weight, QuantizedTensor) and weight.qtype == "W8A8":
            assert weight.scales is not None and weight.data.is_contiguous()
            # packed once, kept on the weight's storage (the module path shares it)
            packed = w8a8.packed_for_amx(weight.data.view(torch.int8))
            matrix.parts[i] = _Part(
                packed.data_ptr(), weight.scales.data_ptr(), AMX_W8A8, 0, offset, weight.shape[0]
            )
        elif isinstance(weight, QuantizedTensor):
            scales = weight.scales
            matrix.parts[i] = _Part(
                weight.data.data_ptr(),
                None if scales is None else scales.data_ptr(),
                QTYPES[weight.qtype][0],
                weight.data.stride(0),
                offset,
                weight.shape[0],
            )
        else:
            matrix.parts[i] = _Part(weight.data_ptr(), None, 0, 0, offset, weight.shape[0])
    return matrix


@dataclass
class StackLayer:
    """One layer's tensors, as the C code reads them.

    Matrices are [out, in] `Matrix` parts: qkv_w [(Hq + 2 Hkv) D, H], o_w [H, Hq D], gate_up_w
    [2 I, H] (gate rows first), down_w [H, I]. Norm weights, the qkv bias and cos_sin
    ([max_position, D], cos | sin halves) are float32. The caches are the layer's paged
    [num_blocks, block_size, Hkv, D] key and value caches.
    """

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_w: Matrix
    qkv_b: torch.Tensor | None
    o_w: Matrix
    gate_up_w: Matrix
    down_w: Matrix
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


# The quantized types kvq_linear (quant_gemm.c) computes, and the 4-bit checkpoints' W4G
# groups (int4_gemm.c's w4_any_linear, passed instead when a stack holds them; act-order
# weights, whose activations are gathered per call, keep the layer-by-layer path).
# W8A8 (I8's bytes) runs csrc/w8a8.c's AMX-INT8 kernel where it runs (w8a8_amx), else
# kvq_linear's I8 path.
STACK_QTYPES = (
    "Q8_0", "Q4_0", "Q4_1", "Q4_K", "MXFP4", "I8", "W8A8", "W4G32", "W4G64", "W4G128"
)  # fmt: skip


def w8a8_amx() -> bool:
    """Whether the stack runs W8A8 parts on the AMX-INT8 kernel: it runs here and
    KVSERVE_W8A8_KERNEL does not force another (kvq keeps quant_gemm.c's I8 VNNI path; intmm,
    torch._int_mm, has no C entry, so the stack runs kvq's for it)."""
    return w8a8.amx_available() and w8a8.forced() in (None, "amx")


def quantized_available() -> bool:
    """Quantized parts run here: quant_gemm.c is built and activations are int8 (its
    kvq_linear; KVSERVE_QUANT_ACTIVATIONS=float32 runs another kernel the stack does not
    call)."""
    return quant.c_available() and int4.c_available() and quant.activations() == "int8"


def _held_qtypes(layers: list[StackLayer]) -> set[str]:
    """The quantized types of the weight parts the layers hold (empty: all float)."""
    return {
        weight.qtype
        for layer in layers
        for matrix in (layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w)
        for _, weight in matrix
        if isinstance(weight, QuantizedTensor)
    }


def _c_layer(layer: StackLayer, amx: bool) -> _Layer:
    """The C struct of one layer: its tensors' addresses (the stack holds the tensors)."""
    return _Layer(
        layer.input_norm.data_ptr(),
        layer.post_norm.data_ptr(),
        _c_matrix(layer.qkv_w, amx),
        None if layer.qkv_b is None else layer.qkv_b.data_ptr(),
        _c_matrix(layer.o_w, amx),
        _c_matrix(layer.gate_up_w, amx),
        _c_matrix(layer.down_w, amx),
        layer.key_cache.data_ptr(),
        layer.value_cache.data_ptr(),
        layer.cos_sin.data_ptr(),
        layer.sliding_window or 0,
    )


class DecodeStack:
    """A stack of layers run by one C call per decode step.

    Args:
        layers: the layers in order; their tensors must outlive the stack (it holds them).
        shape: what they share.
        dtype: float32 or bfloat16 (the weights', caches' and activations' dtype).
        max_requests: the most requests a step may have.
        tokens_per_request: the most tokens each (1 + k for a speculative verify step); the
            work buffers are sized for max_rows = max_requests * tokens_per_request tokens.
    """

    def __init__(
        self,
        layers: list[StackLayer],
        shape: StackShape,
        dtype: torch.dtype,
        max_requests: int,
        tokens_per_request: int = 1,
    ) -> None:
        lib = cpu.library()
        assert lib is not None and dtype in cpu.DTYPES
        self._fn = lib.decode_stack
        self.layers, self.shape, self.dtype = layers, shape, dtype
        self.max_requests = max_requests
        self.max_rows = max_rows = max_requests * tokens_per_request
        block_size = layers[0].key_cache.shape[1]
        for layer in layers:
            _check_layer(layer, shape, dtype, block_size)
        held_qtypes = _held_qtypes(layers)
        quantized = bool(held_qtypes)
        assert not quantized or quantized_available()
        held_w4 = any(qtype in int4.W4_GROUPS for qtype in held_qtypes)
        self.amx = amx = "W8A8" in held_qtypes and w8a8_amx()
        self._c_layers = (_Layer * len(layers))(*(_c_layer(layer, amx) for layer in layers))
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
            _kvq_linear_address(held_w4) if quantized else None,
            w8a8.amx_linear_address() if amx else None,
        )
        qd, kvd = shape.num_heads * shape.head_size, shape.num_kv_heads * shape.head_size
        per_row = 3 * shape.hidden + qd + 2 * kvd + 3 * qd + 3 * shape.intermediate
        self._work = torch.empty(max_rows * per_row + 16, dtype=torch.float32)
        self._token_rows = torch.arange(max_rows, dtype=torch.int64)

    def takes(self, num_tokens: int, num_requests: int) -> bool:
        """Whether a step of this many tokens of this many requests is the stack's."""
        return num_tokens <= self.max_rows and num_requests <= self.max_requests

    def run(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor | None = None,
        layers: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer (or the stack's layers [first, last) of `layers`: a model that reads
        the stream between layers, EAGLE-3's target) for a step the stack takes (M tokens).

        hidden, residual: [M, H] as the module path's (hidden_states, residual); residual
        None when the stack starts at the model's first layer. positions, slot_mapping: [M]
        int64; block_table [R, max_blocks] int32; seq_lens [R] int32 (context after the
        step). query_start_loc: [R+1] int32, the requests' token ranges; None when every
        request has one token (a decode step, R = M). A request of several tokens (a
        speculative verify step, a short prefill chunk) attends token by token over its
        causal prefix, so each token's result is what a decode step would give it. Returns
        the last layer's (hidden_states, residual), new tensors.
        """
        num_rows = hidden.shape[0]
        assert self.takes(num_rows, seq_lens.shape[0]) and hidden.dtype == self.dtype
        assert positions.dtype == slot_mapping.dtype == torch.int64
        assert block_table.dtype == seq_lens.dtype == torch.int32
        if query_start_loc is not None:
            block_table, seq_lens = per_token_rows(query_start_loc, seq_lens, block_table)
        assert block_table.stride(1) == 1 and block_table.shape[0] >= num_rows
        has_residual = residual is not None
        hidden = hidden.contiguous().clone()
        residual = torch.empty_like(hidden) if residual is None else residual.contiguous().clone()
        # Locals: each must outlive the call (a .contiguous() copy would not).
        positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
        seq_lens = seq_lens.contiguous()
        first, last = layers or (0, len(self.layers))
        c_layers = (_Layer * (last - first)).from_buffer(
            self._c_layers, first * ctypes.sizeof(_Layer)
        )
        self._fn(
            c_layers,
            ctypes.c_int(last - first),
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


def per_token_rows(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token as a request of its own: its request's block-table row and its causal
    context length (the request's length after the step, less the tokens after it)."""
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    num_tokens = int(query_start_loc[-1])
    ends = query_start_loc[1:].repeat_interleave(query_lens, output_size=num_tokens)
    after = ends - 1 - torch.arange(num_tokens, dtype=torch.int32)
    lens = seq_lens.repeat_interleave(query_lens, output_size=num_tokens) - after
    table = block_table[: query_lens.shape[0]].repeat_interleave(
        query_lens, dim=0, output_size=num_tokens
    )
    return table, lens.to(torch.int32)


def _check_layer(layer: StackLayer, shape: StackShape, dtype: torch.dtype, block_size: int):
    """The C code's reading of a layer's tensors holds (a broken one would read garbage)."""
    qd, kvd = shape.num_heads * shape.head_size, shape.num_kv_heads * shape.head_size
    h, i = shape.hidden, shape.intermediate
    matrices = {
        "qkv_w": (layer.qkv_w, qd + 2 * kvd, h),
        "o_w": (layer.o_w, h, qd),
        "gate_up_w": (layer.gate_up_w, 2 * i, h),
        "down_w": (layer.down_w, h, i),
    }
    for name, (parts, n, k) in matrices.items():
        _check_matrix(name, parts, n, k, dtype)
    vectors = {"input_norm": (layer.input_norm, h), "post_norm": (layer.post_norm, h)}
    if layer.qkv_b is not None:
        vectors["qkv_b"] = (layer.qkv_b, qd + 2 * kvd)
    for name, (tensor, size) in vectors.items():
        if tuple(tensor.shape) != (size,) or tensor.dtype != torch.float32:
            raise ValueError(
                f"{name}: {tuple(tensor.shape)} {tensor.dtype}, want ({size},) float32"
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


def _check_matrix(name: str, parts: Matrix, n: int, k: int, dtype: torch.dtype) -> None:
    if not 0 < len(parts) <= MAX_PARTS:
        raise ValueError(f"{name}: {len(parts)} parts, the C code takes 1 to {MAX_PARTS}")
    row = 0
    for offset, weight in parts:
        if offset != row:
            raise ValueError(f"{name}: a part starts at row {offset}, want {row}")
        if isinstance(weight, QuantizedTensor):
            if weight.shape[1] != k or weight.data.stride(1) != 1:
                raise ValueError(f"{name}: a quantized part of {weight.shape}, want K = {k}")
        elif weight.dtype != dtype or weight.shape[1] != k or not weight.is_contiguous():
            raise ValueError(f"{name}: a {weight.dtype} part of {tuple(weight.shape)}")
        row += weight.shape[0]
    if row != n:
        raise ValueError(f"{name}: parts cover {row} rows, want {n}")


def _kvq_linear_address(held_w4: bool = False) -> int | None:
    if held_w4:
        w4 = int4.library()
        assert w4 is not None
        return ctypes.cast(w4.w4_any_linear, ctypes.c_void_p).value
    lib = quant.library()
    assert lib is not None
    return ctypes.cast(lib.kvq_linear, ctypes.c_void_p).value
