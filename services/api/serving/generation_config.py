"""Request defaults from a model's generation_config.json (vLLM's --generation-config).

    auto    the model folder's generation_config.json (the default, as in vLLM)
    vllm    none: SamplingParams' own defaults
    FOLDER  the generation_config.json in that folder

Only the sampling knobs vLLM takes from it become defaults; a request's own value always
wins. `max_new_tokens` becomes the default max_tokens (still capped by the context).
"""

from __future__ import annotations

import json
import os
from typing import Any

# generation_config.json key -> SamplingParams field.
_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_generation_defaults(spec: str, model_dir: str) -> dict[str, Any]:
    """SamplingParams defaults for --generation-config `spec` ({} for `vllm`).

    Raises:
        ValueError: `spec` names a folder without a generation_config.json.
    """
    if spec == "vllm":
        return {}
    folder = model_dir if spec == "auto" else spec
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if spec == "auto":
            return {}
        raise ValueError(f"--generation-config {spec!r}: no generation_config.json there")
    with open(path) as f:
        config = json.load(f)
    return {
        field: config[key] for key, field in _SAMPLING_KEYS.items() if config.get(key) is not None
    }
