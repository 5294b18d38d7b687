"""How the served model pools (--runner pooling), read from its folder: config.json and a
sentence-transformers layout (modules.json, 1_Pooling/config.json, a Normalize module).

    embedding model, sentence-transformers folder   its Pooling module's mode (cls, mean,
                                                    last token); normalised iff modules.json
                                                    lists a Normalize module
    an encoder without one (BERT, XLM-R, ModernBERT) CLS, normalised (vLLM's default)
    a decoder without one                            the last token, normalised (vLLM's
                                                    --convert embed)
    *ForSequenceClassification                       CLS (ModernBERT: classifier_pooling),
                                                    then the model's classifier head: logits
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import msgspec

from kvserve.shared.model_dir import is_classifier_model, is_encoder_model, model_config

Pooling = Literal["last", "mean", "cls"]

# 1_Pooling/config.json's modes -> the engine's pooling.
_MODES: dict[str, Pooling] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}


class PoolingSpec(msgspec.Struct, frozen=True):
    """What a pooling request of the served model asks the engine for.

    Args:
        pooling: how the final hidden states are pooled.
        normalize: whether the pooled vector is L2-normalised.
        is_encoder: an encoder (bidirectional, token types, pair inputs).
        is_classifier: a `*ForSequenceClassification`: the engine returns its logits.
        id2label: the classifier's label names by class index.
        use_token_types: the model embeds token types (a BERT pair's second segment).
    """

    pooling: Pooling = "last"
    normalize: bool = True
    is_encoder: bool = False
    is_classifier: bool = False
    id2label: dict[int, str] = {}
    use_token_types: bool = False

    @property
    def num_labels(self) -> int:
        return len(self.id2label)


def pooling_spec(model_dir: str | None) -> PoolingSpec:
    """The PoolingSpec of a model folder (see the module docstring)."""
    config = model_config(model_dir)
    encoder = is_encoder_model(model_dir)
    use_types = encoder and int(config.get("type_vocab_size", 0)) > 1
    if is_classifier_model(model_dir):
        labels = {int(k): str(v) for k, v in (config.get("id2label") or {"0": "LABEL_0"}).items()}
        pooling: Pooling = "mean" if config.get("classifier_pooling") == "mean" else "cls"
        return PoolingSpec(pooling, False, encoder, True, labels, use_types)
    st_pooling, normalize = _sentence_transformers(model_dir)
    default: Pooling = "cls" if encoder else "last"
    return PoolingSpec(st_pooling or default, normalize, encoder, use_token_types=use_types)


def _sentence_transformers(model_dir: str | None) -> tuple[Pooling | None, bool]:
    """(the Pooling module's mode, whether a Normalize module follows) of a
    sentence-transformers folder; (None, True) without one."""
    root = Path(model_dir or "")
    if not model_dir:
        return None, True
    modules_path = root / "modules.json"
    modules = json.loads(modules_path.read_text()) if modules_path.is_file() else None
    pooling_dir = "1_Pooling"
    normalize = True
    if modules is not None:
        types = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
        pooling_dir = types.get("Pooling", pooling_dir)
        normalize = "Normalize" in types
    path = root / pooling_dir / "config.json"
    if not path.is_file():
        return None, normalize
    config = json.loads(path.read_text())
    chosen = [mode for key, mode in _MODES.items() if config.get(key)]
    others = sorted(k for k, v in config.items() if k.startswith("pooling_mode") and v)
    if len(chosen) != 1 or len(others) != 1:
        raise ValueError(
            f"{path}: pooling {others} is not supported (one of cls, mean, last token)"
        )
    return chosen[0], normalize
