"""What a process reads of a model folder without loading the model (no transformers).

The engine core bounds token ids by it (engine/request_checks.py) and structured outputs size
their token bitmask by it (structured_output/grammar.py); neither package may import the other.
"""

from __future__ import annotations

import json
import os


def model_vocab_size(model_dir: str) -> int | None:
    """config.json's vocab_size (the embedding's rows), or None when it names none."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        config = json.load(f)
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if size else None


# Encoder architectures (bidirectional attention, no KV cache kept; --runner pooling only):
# the engine schedules each of their requests whole (engine/engine_core.py).
ENCODER_ARCHITECTURES = frozenset(
    {
        "BertModel",
        "XLMRobertaModel",
        "RobertaModel",
        "ModernBertModel",
        "BertForSequenceClassification",
        "XLMRobertaForSequenceClassification",
        "RobertaForSequenceClassification",
        "ModernBertForSequenceClassification",
    }
)


def model_config(model_dir: str | None) -> dict:
    """config.json of model_dir as a dict ({} when there is none)."""
    if not isinstance(model_dir, str) or not model_dir:
        return {}
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def is_encoder_model(model_dir: str | None) -> bool:
    """Whether config.json names an encoder architecture (BERT, XLM-R, ModernBERT)."""
    return bool(
        ENCODER_ARCHITECTURES.intersection(model_config(model_dir).get("architectures") or [])
    )


def is_classifier_model(model_dir: str | None) -> bool:
    """Whether the model is a `*ForSequenceClassification` (a cross-encoder or classifier)."""
    architectures = model_config(model_dir).get("architectures") or []
    return any(arch.endswith("ForSequenceClassification") for arch in architectures)
