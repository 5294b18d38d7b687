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
