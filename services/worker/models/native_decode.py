"""Whether a model's decode steps can run as one native call, and binding it if so.

`bind_decode_stack` looks at a loaded model once its KV cache is bound (the model runner calls
it on the CPU) and, when every layer is what kernels/decode_stack.py computes, gives the
model's `LlamaModel` a `DecodeStack`; its forward then hands steps of few requests and tokens
to it (decodes, speculative verify steps, short prefill chunks), and the LM head computes
their logits with the stack's GEMV. A token's greedy choice then does not depend on what
shares its step: a verify step gives what decode steps give. The start-up log says which way
it went and why, so a family or option the stack does not cover is visible, not slow in
silence.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from kvserve.kernels import decode_stack, w8a8
from kvserve.kernels.decode_stack import DecodeStack, Matrix, StackLayer, StackShape
from kvserve.kernels.quant import QuantizedTensor
from kvserve.services.worker.layers.activation import SiluAndMul
from kvserve.services.worker.layers.embed_head import ParallelLMHead
from kvserve.services.worker.layers.layernorm import RMSNorm
from kvserve.services.worker.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    QuantizedLinearMethod,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from kvserve.services.worker.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaModel,
)
from kvserve.services.worker.parallel_state import get_tp_size


class NotCovered(Exception):
    """What in the model the native stack does not compute (the message says)."""


def _matrix(linear: nn.Module, kind: type[LinearBase], dtype: torch.dtype) -> Matrix:
    """The layer's weight as the stack's parts: one float part, or the quantized method's
    parts (GGUF blocks of one or more types, int8 rows, float shards of a type the quantized
    kernels lack)."""
    if type(linear) is not kind:
        raise NotCovered(f"{type(linear).__name__} where {kind.__name__} was expected (LoRA?)")
    assert isinstance(linear, LinearBase)
    method = linear.quant_method
    if isinstance(method, UnquantizedLinearMethod):
        parts: Matrix = [(0, linear.weight.data)]
    elif isinstance(method, QuantizedLinearMethod):
        if not decode_stack.quantized_available():
            raise NotCovered("quantized weights with KVSERVE_QUANT_ACTIVATIONS=float32")
        parts = list(cast(Matrix, linear.quant_parts))  # set by QuantizedLinearMethod
    else:
        raise NotCovered(f"{type(method).__name__} weights")
    if len(parts) > decode_stack.MAX_PARTS:
        raise NotCovered(f"a matrix in {len(parts)} parts")
    for _, weight in parts:
        if isinstance(weight, QuantizedTensor) and weight.qtype not in decode_stack.STACK_QTYPES:
            raise NotCovered(f"{weight.qtype} weights")
        if isinstance(weight, QuantizedTensor) and weight.perm is not None:
            raise NotCovered("act-order 4-bit weights (activations gathered per call)")
        if isinstance(weight, torch.Tensor) and (
            weight.dtype != dtype or not weight.is_contiguous()
        ):
            raise NotCovered(f"a {weight.dtype} weight in a {dtype} model")
    return parts


def _norm_weight(norm: nn.Module) -> torch.Tensor:
    if not isinstance(norm, RMSNorm):
        raise NotCovered(f"{type(norm).__name__} norms")
    return norm.weight.data.float().contiguous()


def _decoder_layer(layer: nn.Module) -> LlamaDecoderLayer:
    if not isinstance(layer, LlamaDecoderLayer) or type(layer) is not LlamaDecoderLayer:
        raise NotCovered(f"{type(layer).__name__} layers")
    if type(layer.self_attn) is not LlamaAttention:  # e.g. DeepSeek's latent attention
        raise NotCovered(f"{type(layer.self_attn).__name__} attention")
    return layer


def _stack_layer(layer: LlamaDecoderLayer, dtype: torch.dtype) -> StackLayer:
    if layer.sandwich_norms:
        raise NotCovered("sandwich norms")
    attn = layer.self_attn
    if attn.q_norm is not None:
        raise NotCovered("per-head q/k norms")
    # Llama 4's switches (the C stack's attention has windows, not chunks).
    if attn.attn.attention_chunk_size:
        raise NotCovered("chunked local attention")
    if attn.rotary_emb is None:
        raise NotCovered("layers without RoPE (NoPE)")
    if attn.query_scale is not None:
        raise NotCovered("a per-position query scale")
    if attn.attn.sinks is not None:
        raise NotCovered("attention sinks")
    mlp = layer.mlp
    if not isinstance(mlp, LlamaMLP) or type(mlp) is not LlamaMLP:
        raise NotCovered(f"{type(mlp).__name__} feed-forward blocks")
    if not isinstance(mlp.act_fn, SiluAndMul):
        raise NotCovered(f"{type(mlp.act_fn).__name__} activations")
    # The matrices first: they refuse wrapped layers (LoRA), which have no .bias.
    qkv_w = _matrix(attn.qkv_proj, QKVParallelLinear, dtype)
    o_w = _matrix(attn.o_proj, RowParallelLinear, dtype)
    gate_up_w = _matrix(mlp.gate_up_proj, MergedColumnParallelLinear, dtype)
    down_w = _matrix(mlp.down_proj, RowParallelLinear, dtype)
    if attn.o_proj.bias is not None or mlp.gate_up_proj.bias is not None:
        raise NotCovered("a bias on o_proj or the MLP")
    if mlp.down_proj.bias is not None:
        raise NotCovered("a bias on down_proj")
    cache = attn.attn.kv_cache
    assert cache is not None, "bind_decode_stack checks the caches are bound"
    if cache.dtype != dtype:  # the C stack reads K/V in the model's dtype
        raise NotCovered(f"a {cache.dtype} KV cache (--kv-cache-dtype) in a {dtype} model")
    qkv_bias = attn.qkv_proj.bias
    return StackLayer(
        input_norm=_norm_weight(layer.input_layernorm),
        post_norm=_norm_weight(layer.post_attention_layernorm),
        qkv_w=qkv_w,
        qkv_b=None if qkv_bias is None else qkv_bias.data.float().contiguous(),
        o_w=o_w,
        gate_up_w=gate_up_w,
        down_w=down_w,
        key_cache=cache[0],
        value_cache=cache[1],
        cos_sin=attn.rotary_emb.cos_sin_cache.float().contiguous(),
        sliding_window=attn.attn.sliding_window,
    )


def _build(
    stage: list[LlamaDecoderLayer],
    hidden_size: int,
    dtype: torch.dtype,
    max_requests: int,
    tokens_per_request: int,
) -> DecodeStack:
    if get_tp_size() > 1:
        raise NotCovered("tensor parallelism (an all-reduce sits inside each layer)")
    if not decode_stack.available(dtype):
        raise NotCovered(f"{dtype} (no C kernels for it here)")
    layers = [_stack_layer(layer, dtype) for layer in stage]
    if len({layer.self_attn.attn.logits_soft_cap for layer in stage}) > 1:
        raise NotCovered("attention soft caps that differ by layer")
    first = stage[0]
    attn, norm = first.self_attn.attn, first.input_layernorm
    assert isinstance(norm, RMSNorm)  # _stack_layer checked
    shape = StackShape(
        hidden=hidden_size,
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        head_size=attn.head_size,
        intermediate=layers[0].down_w[0][1].shape[1],
        eps=float(norm.eps),
        scale=float(attn.scale),
        soft_cap=attn.logits_soft_cap,
    )
    return DecodeStack(layers, shape, dtype, max_requests, tokens_per_request)


def bind_decode_stack(
    model: nn.Module, dtype: torch.dtype, max_requests: int, tokens_per_request: int = 1
) -> str:
    """Give the model's decoder a native decode stack for steps of up to max_requests
    requests of up to tokens_per_request tokens each (1 + k under speculative decoding) when
    it is covered; say what was done (for the start-up log)."""
    inner = getattr(model, "model", None)
    if not isinstance(inner, LlamaModel):
        return f"off: {type(model).__name__} has no Llama-style decoder"
    inner.decode_stack = None
    head = getattr(model, "lm_head", None)
    if isinstance(head, ParallelLMHead):
        head.native_rows = 0
        head.native_amx = False
    if max_requests <= 0:
        return "off (KVSERVE_NATIVE_DECODE_ROWS=0)"
    try:
        stage = [
            _decoder_layer(layer) for layer in inner.layers[inner.start_layer : inner.end_layer]
        ]
        if any(layer.self_attn.attn.kv_cache is None for layer in stage):
            return "off: no KV cache is bound yet"
        hidden_size = _norm_weight(stage[0].input_layernorm).shape[0]
        stack = _build(stage, hidden_size, dtype, max_requests, tokens_per_request)
    except NotCovered as reason:
        return f"off: the stack does not compute {reason}; decode steps run the modules"
    inner.decode_stack = stack
    if isinstance(head, ParallelLMHead) and _plain(head.weight, dtype):
        head.native_rows = stack.max_rows  # the same per-row arithmetic for the logits
        # on AMX: tiles with that property (kernels/w8a8.py linear_amx_bf16)
        head.native_amx = dtype == torch.bfloat16 and w8a8.amx_available()
    return (
        f"on: steps of up to {max_requests} requests of up to {tokens_per_request} tokens "
        f"run {len(stage)} layers in one C call"
    )


def fit_stack_limit(counts: list[int], stack_s: list[float], modules_s: list[float]) -> int:
    """The most requests a stack step should take, from decode steps timed both ways: the
    largest of `counts` (ascending) up to which the stack was never slower than the modules;
    0 when the modules were faster already at the first."""
    limit = 0
    for count, stack, modules in zip(counts, stack_s, modules_s):
        if stack > modules:
            break
        limit = count
    return limit


def _plain(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    return type(weight.data) is torch.Tensor and weight.dtype == dtype and weight.is_contiguous()
