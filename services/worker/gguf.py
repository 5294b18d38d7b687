"""Convert a llama.cpp GGUF file into a HF-style folder kvserve loads like any other.

    out_dir/config.json, generation_config.json     from transformers' GGUF metadata reader
    out_dir/tokenizer.json, tokenizer_config.json,
            chat_template.jinja                      from transformers' GGUF tokenizer reader
    out_dir/model.safetensors                        float32, dequantized by the `gguf` package
            (or model-0000i-of-0000N.safetensors + model.safetensors.index.json when large)

transformers is used for the config and tokenizer only; the weights are ours: dequantized,
renamed to HF names, and with llama.cpp's q/k row permutation undone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

MAX_SHARD_BYTES = 2 << 30  # float32 bytes per safetensors file: bounds conversion memory

# Architectures whose GGUF tensors we know how to name (general.architecture values).
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")

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


def iterate_gguf_tensors(gguf_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) for every tensor of gguf_path, in file order.

    `lm_head.weight` is absent when the file has no `output.weight` (tied embeddings).
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
        array = dequantize(tensor.data, tensor.tensor_type)
        # Unquantized tensors are read-only views of the file's memory map: copy those only.
        array = np.require(array, dtype=np.float32, requirements=("C", "W"))
        weight = torch.from_numpy(array.reshape(shape))
        # Only llama.cpp's llama converter permutes q/k; qwen2 files keep HF's order.
        if arch == "llama" and ".q_proj." in name:
            weight = unpermute_qk_rows(weight, num_heads)
        elif arch == "llama" and ".k_proj." in name:
            weight = unpermute_qk_rows(weight, num_kv_heads)
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

    from kvserve.services.worker.models import architecture_of_model_type

    gguf_dir, gguf_file = os.path.split(os.path.abspath(gguf_path))
    names = save_sharded(iterate_gguf_tensors(gguf_path), out_dir, max_shard_bytes)

    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_file)
    arch = architecture_of_model_type(config.model_type)
    if arch is None:
        raise ValueError(f"model_type {config.model_type!r} of {gguf_path} is not supported")
    config.architectures = [arch]
    config.tie_word_embeddings = "lm_head.weight" not in names
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)
