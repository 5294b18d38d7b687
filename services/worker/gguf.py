"""Convert a llama.cpp GGUF file into a HF-style folder kvserve loads like any other.

    out_dir/config.json, generation_config.json     from transformers' GGUF metadata reader
    out_dir/tokenizer.json, tokenizer_config.json,
            chat_template.jinja                      from transformers' GGUF tokenizer reader
    out_dir/model.safetensors                        float32, dequantized by the `gguf` package
            (or model-0000i-of-0000N.safetensors + model.safetensors.index.json when large)

transformers is used for the config and tokenizer only; the weights are ours: dequantized,
renamed to HF names, and with llama.cpp's q/k row permutation undone.

With `--quantization gguf` the weights skip the folder: `iterate_gguf_tensors(path,
keep_quantized=True)` reads the stored blocks from the .gguf file itself (the folder still
gives the config and tokenizer). `requantize_gguf` writes a copy of a GGUF with its weights
re-quantized (bench/quantized.py and the tests make Q8_0 / Q4_0 / Q4_K models with it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from typing import Any, Literal, overload

import numpy as np
import torch

from kvserve.kernels.quant import GGUF_QTYPES, QuantizedTensor

MAX_SHARD_BYTES = 2 << 30  # float32 bytes per safetensors file: bounds conversion memory

# Architectures whose GGUF tensors we know how to name (general.architecture values), and
# the HF architecture each converts to.
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_GGUF_ARCHITECTURES = tuple(_HF_ARCHITECTURES)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Llama 3 GGUFs store RoPE scaling factors as a tensor; we recompute them from the config.
_SKIPPED = {"rope_freqs.weight"}


def hf_tensor_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}; kvserve maps {sorted(_LAYER_NAMES)}")


def unpermute_qk_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation of attn_q / attn_k.

    llama.cpp (convert_hf_to_gguf) interleaves the two rotary halves of each head so its
    RoPE rotates adjacent pairs: rows (h, half, i) become (h, i, half). We swap them back
    for the rotate-half RoPE that HF checkpoints and our kernel use.
    """
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"GGUF metadata lacks {key!r}")
    return field.contents()


@overload
def iterate_gguf_tensors(
    gguf_path: str, keep_quantized: Literal[False] = False
) -> Iterator[tuple[str, torch.Tensor]]: ...


@overload
def iterate_gguf_tensors(
    gguf_path: str, keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]: ...


def iterate_gguf_tensors(
    gguf_path: str, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield (HF name, float32 tensor) for every tensor of gguf_path, in file order.

    With keep_quantized, a 2-D tensor stored as one of kernels.quant.GGUF_QTYPES comes as a
    `QuantizedTensor` of its stored blocks instead (q/k rows still unpermuted: blocks run
    along the input dim, so whole rows move). `lm_head.weight` is absent when the file has
    no `output.weight` (tied embeddings).
    """
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; "
            f"supported: {SUPPORTED_GGUF_ARCHITECTURES}"
        )
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv"))
    for tensor in reader.tensors:
        if tensor.name in _SKIPPED:
            continue
        name = hf_tensor_name(tensor.name)
        # GGUF lists dims fastest-first; numpy (and HF) order is the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        qtype = tensor.tensor_type.name
        weight: torch.Tensor | QuantizedTensor
        if keep_quantized and len(shape) == 2 and qtype in GGUF_QTYPES:
            # The blocks are a read-only view of the file's memory map: copy them.
            data = np.array(tensor.data, dtype=np.uint8, copy=True).reshape(shape[0], -1)
            weight = QuantizedTensor(qtype, shape, torch.from_numpy(data))
        else:
            array = dequantize(tensor.data, tensor.tensor_type)
            # Unquantized tensors are read-only views of the file's memory map: copy those.
            array = np.require(array, dtype=np.float32, requirements=("C", "W"))
            weight = torch.from_numpy(array.reshape(shape))
        # Only llama.cpp's llama converter permutes q/k; qwen2 files keep HF's order.
        heads = None
        if arch == "llama" and ".q_proj." in name:
            heads = num_heads
        elif arch == "llama" and ".k_proj." in name:
            heads = num_kv_heads
        if isinstance(weight, QuantizedTensor):
            if heads is not None:
                weight = weight.permute_rows(lambda t, h=heads: unpermute_qk_rows(t, h))
            yield name, weight
            continue
        if heads is not None:
            weight = unpermute_qk_rows(weight, heads)
        yield name, weight.contiguous()


def read_gguf_state_dict(gguf_path: str) -> dict[str, torch.Tensor]:
    """All of `iterate_gguf_tensors(gguf_path)` as one dict (tests, small models)."""
    return dict(iterate_gguf_tensors(gguf_path))


def save_sharded(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> set[str]:
    """Write tensors as HF safetensors: one model.safetensors, or numbered shards and
    model.safetensors.index.json when they exceed max_shard_bytes. Returns the names written.

    Only one shard is in memory at a time, so a model larger than RAM in float32 converts.
    """
    from safetensors.torch import save_file

    shard_files: list[str] = []
    weight_map: dict[str, int] = {}  # name -> shard index
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_bytes = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        path = os.path.join(out_dir, f"shard-{len(shard_files)}.partial")
        save_file(shard, path, metadata={"format": "pt"})
        shard_files.append(path)
        shard, shard_bytes = {}, 0

    for name, tensor in tensors:
        num_bytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + num_bytes > max_shard_bytes:
            flush()
        shard[name] = tensor
        weight_map[name] = len(shard_files)
        shard_bytes += num_bytes
        total_bytes += num_bytes
    if shard or not shard_files:
        flush()
    num_shards = len(shard_files)
    if num_shards == 1:
        os.rename(shard_files[0], os.path.join(out_dir, "model.safetensors"))
        return set(weight_map)
    names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    for path, file_name in zip(shard_files, names):
        os.rename(path, os.path.join(out_dir, file_name))
    index = {
        "metadata": {"total_size": total_bytes},
        "weight_map": {name: names[i] for name, i in weight_map.items()},
    }
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return set(weight_map)


def convert_gguf(gguf_path: str, out_dir: str, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write the HF-style folder of gguf_path into out_dir (an existing, empty folder).

    Args:
        gguf_path: a llama.cpp GGUF file (any quantization the `gguf` package dequantizes).
        out_dir: destination; the caller makes it appear atomically (model_loader).
        max_shard_bytes: float32 bytes per safetensors shard.
    """
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    gguf_dir, gguf_file = os.path.split(os.path.abspath(gguf_path))
    names = save_sharded(iterate_gguf_tensors(gguf_path), out_dir, max_shard_bytes)

    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_file)
    # Not models.architecture_of_model_type: models/ imports the quantized loader, which
    # reads GGUFs through this module (a cycle).
    arch = _HF_ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise ValueError(f"model_type {config.model_type!r} of {gguf_path} is not supported")
    config.architectures = [arch]
    config.tie_word_embeddings = "lm_head.weight" not in names
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)


# ---------------------------------------------------------------------- re-quantization


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """A simple Q4_K quantizer (the `gguf` package has none): [N, K] float32 -> [N, K/256*144]
    uint8 blocks. Per 32-element sub-block a scale and a min from its range, both stored as
    6-bit multiples of the super-block's fp16 d / dmin; no search for better ranges (llama.cpp
    does one, so its files are slightly more accurate)."""
    n, k = weight.shape
    if k % 256:
        raise ValueError(f"Q4_K needs rows of a multiple of 256 elements, got {k}")
    x = weight.astype(np.float32).reshape(n, k // 256, 8, 32)
    lo = np.minimum(x.min(axis=-1), 0.0)  # w = d sc q - dmin m, m >= 0: offsets are <= 0
    hi = x.max(axis=-1)
    scale = (hi - lo) / 15.0
    mins = -lo
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = (mins.max(axis=-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32), dmin.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df[..., None] > 0, np.rint(scale / df[..., None]), 0).clip(0, 63)
        mn = np.where(dminf[..., None] > 0, np.rint(mins / dminf[..., None]), 0).clip(0, 63)
        step = df[..., None] * sc
        offset = dminf[..., None] * mn
        q = np.where(
            step[..., None] > 0, np.rint((x + offset[..., None]) / step[..., None]), 0
        ).clip(0, 15)
    sc, mn, q = sc.astype(np.uint8), mn.astype(np.uint8), q.astype(np.uint8)
    scales = np.zeros((n, k // 256, 12), dtype=np.uint8)
    scales[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    scales[..., 4:8] = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    q = q.reshape(n, k // 256, 4, 2, 32)  # pairs of sub-blocks share bytes: lo | hi << 4
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(n, k // 256, 128)
    blocks = np.concatenate(
        [
            d.reshape(n, k // 256, 1).view(np.uint8),
            dmin.reshape(n, k // 256, 1).view(np.uint8),
            scales,
            qs,
        ],
        axis=-1,
    )
    return blocks.reshape(n, k // 256 * 144)


def requantize_gguf(
    src_path: str, dst_path: str, qtype: str, fallback: str = "Q4_1", keep: tuple[str, ...] = ()
) -> dict[str, str]:
    """Write dst_path: src_path's metadata and tensors, its 2-D weights dequantized to float32
    and re-quantized as qtype (Q8_0, Q4_0, Q4_1 by the `gguf` package, Q4_K by
    `quantize_q4_k`). A tensor whose rows do not divide into qtype's blocks takes fallback;
    tensors named in keep (GGUF names, e.g. token_embd.weight) keep their stored type.
    Returns the type written per GGUF tensor name.
    """
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(src_path)
    arch = _field(reader, "general.architecture")
    writer = GGUFWriter(dst_path, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the writer adds these itself
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
    written: dict[str, str] = {}
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))
        src_type = tensor.tensor_type
        if len(shape) != 2 or tensor.name in keep:
            data, out_type = np.array(tensor.data), src_type
        else:
            weight = dequantize(tensor.data, src_type).reshape(shape).astype(np.float32)
            name = qtype
            if shape[1] % (256 if qtype == "Q4_K" else 32):
                name = fallback
            out_type = GGMLQuantizationType[name]
            if name == "Q4_K":
                data = quantize_q4_k(weight)
            else:
                data = quantize(weight, out_type)
        written[tensor.name] = out_type.name
        writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=out_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written
