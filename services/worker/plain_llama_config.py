"""A plain Llama's config read from config.json without transformers.

Importing transformers costs an engine process ~3 s of CPU (its `__init__` scans every model
file of the package; `LlamaConfig` pulls in torch.distributed.tensor), paid again by every
engine core and every worker at each start, to read a dozen numbers. A plain Llama (the
default model, SmolLM2, TinyLlama, the tiny test models: no rope scaling, no quantization
config, no sub-configs) is read here instead, with transformers' `LlamaConfig` defaults and
derived values; any other config goes to `AutoConfig` (`load_config`).
tests/unit/worker/test_plain_llama_config.py holds this to transformers' own result.
"""

from __future__ import annotations

import json
import os
from typing import Any

# transformers' LlamaConfig defaults (5.x) of the fields a config.json may leave out.
_LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,  # None: num_attention_heads
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "use_cache": True,
    "pad_token_id": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "head_dim": None,  # None: hidden_size // num_attention_heads
}
_DEFAULT_ROPE_THETA = 10000.0
# Keys whose meaning this reader does not reproduce: such a config goes to transformers.
_NOT_PLAIN_KEYS = frozenset(
    {"rope_scaling", "quantization_config", "text_config", "vision_config", "auto_map"}
)
# config.json bookkeeping transformers does not keep as attributes.
_IGNORED_KEYS = frozenset({"transformers_version", "torch_dtype", "dtype", "rope_theta"})


class PlainLlamaConfig:
    """The attributes transformers' LlamaConfig would hold for a plain Llama's config.json.

    Args:
        raw: the parsed config.json (a plain Llama's: see `is_plain_llama`).
        name_or_path: the folder it was read from.
    """

    model_type = "llama"

    def __init__(self, raw: dict[str, Any], name_or_path: str):
        values = _LLAMA_DEFAULTS | {k: v for k, v in raw.items() if k not in _IGNORED_KEYS}
        if values["num_key_value_heads"] is None:
            values["num_key_value_heads"] = values["num_attention_heads"]
        if values["head_dim"] is None:
            values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
        rope = dict(raw.get("rope_parameters") or {})
        rope.setdefault("rope_theta", raw.get("rope_theta", _DEFAULT_ROPE_THETA))
        rope.setdefault("rope_type", "default")
        values["rope_parameters"] = rope
        values["_name_or_path"] = name_or_path
        self.__dict__.update(values)

    def get_text_config(self) -> PlainLlamaConfig:
        """Itself: a plain Llama has no sub-configs (transformers' API)."""
        return self

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def is_plain_llama(raw: dict[str, Any]) -> bool:
    """Whether a parsed config.json is a plain Llama this module reads as transformers does."""
    rope = raw.get("rope_parameters") or {}
    return (
        raw.get("model_type") == "llama"
        and raw.get("architectures") == ["LlamaForCausalLM"]
        and not _NOT_PLAIN_KEYS.intersection(raw)
        and rope.get("rope_type", "default") == "default"
        and set(rope) <= {"rope_type", "rope_theta"}
    )


def load_config(model_dir: str) -> Any:
    """model_dir's config: a PlainLlamaConfig for a plain Llama, else transformers'
    `AutoConfig` (configs only; the forward pass is ours).

    Args:
        model_dir: a HF-style folder with a config.json.
    """
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    if is_plain_llama(raw):
        return PlainLlamaConfig(raw, model_dir)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)
