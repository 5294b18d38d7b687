"""Start-up check that a model splits over the asked TP x PP layout.

The engine core calls it before it spawns any worker, so a size that does not divide becomes
a ValueError from `LLM(...)` / `kvserve serve` at once, not a worker traceback; the workers
call it again when they build the model. No torch here: the engine core's check stays cheap.
"""

from __future__ import annotations

from typing import Any


def load_hf_config(model_dir: str) -> Any:
    """The transformers config of a HF-style folder (config.json only, no weights); a
    vision-language model's language model config (what splits over the ranks)."""
    from kvserve.services.worker.plain_llama_config import load_config

    return load_config(model_dir).get_text_config()


def verify_parallel_sizes(
    hf_config: Any, tensor_parallel_size: int, pipeline_parallel_size: int
) -> None:
    """Raise ValueError naming every size that does not split over the layout.

    Args:
        hf_config: the model's transformers config.
        tensor_parallel_size: ranks that split each layer (heads, KV heads, the MLP's
            intermediate size and the vocabulary must all divide by it).
        pipeline_parallel_size: stages that split the layers (each needs at least one).
    """
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if tp < 1 or pp < 1:
        raise ValueError(
            f"tensor_parallel_size ({tp}) and pipeline_parallel_size ({pp}) must be at least 1"
        )
    if hasattr(hf_config, "get_text_config"):  # a multimodal config: its language model's
        hf_config = hf_config.get_text_config()
    num_heads = hf_config.num_attention_heads
    sizes = {
        "num_attention_heads": num_heads,
        "num_key_value_heads": getattr(hf_config, "num_key_value_heads", None) or num_heads,
        "intermediate_size": hf_config.intermediate_size,
        "vocab_size": hf_config.vocab_size,
    }
    if getattr(hf_config, "moe_intermediate_size", None):  # Qwen3-MoE's experts
        sizes["moe_intermediate_size"] = hf_config.moe_intermediate_size
    if getattr(hf_config, "intermediate_size_mlp", None):  # Llama 4's dense layers
        sizes["intermediate_size_mlp"] = hf_config.intermediate_size_mlp
    bad = [f"{name}={size}" for name, size in sizes.items() if size % tp]
    if bad:
        fitting = [
            n for n in range(1, num_heads + 1) if all(size % n == 0 for size in sizes.values())
        ]
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the model's "
            f"{', '.join(bad)}; tensor-parallel sizes that fit this model: "
            f"{fitting}"
        )
    num_layers = hf_config.num_hidden_layers
    if num_layers < pp:
        raise ValueError(
            f"pipeline_parallel_size={pp} exceeds the model's "
            f"num_hidden_layers={num_layers}: every stage needs a layer"
        )
