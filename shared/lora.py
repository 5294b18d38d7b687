"""LoRA adapters as every process sees them: the request's adapter and a PEFT folder's config.

A LoRA adapter is a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`). The
api, the engine core and the worker all read its config, so this module reads it with json
only (the api process never imports torch); the worker loads the tensors
(services/worker/lora/adapter.py).

    LoRARequest(lora_name, lora_int_id, lora_path)   what a request carries, as vLLM's

The int id names the adapter inside the engine (worker slots, CPU cache, block hashes): two
different adapters must never share one, and one adapter keeps its id while it is loaded.
"""

from __future__ import annotations

import json
import math
import os

import msgspec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The linear layers of the Llama family an adapter may target (HF names).
SUPPORTED_TARGET_MODULES = frozenset(
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
)


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """The adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`).

    Args:
        lora_name: the adapter's name (what the api's `model` field names).
        lora_int_id: its id, unique among loaded adapters and > 0.
        lora_path: the PEFT folder, on the engine's machine.
        base_model_name: the model it was trained on (informational; /v1/models' parent).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}")


class LoRAModulePath(msgspec.Struct, frozen=True, kw_only=True):
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON form
    `{"name": ..., "path": ..., "base_model_name": ...}`."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse_flag(cls, text: str) -> LoRAModulePath:
        """A flag value: `name=path` or a JSON object."""
        text = text.strip()
        if text.startswith("{"):
            return msgspec.json.decode(text, type=cls)
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{text!r}: give name=path or a JSON object with name and path")
        return cls(name=name, path=path)


class PeftAdapterConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What kvserve reads of a PEFT `adapter_config.json`.

    Args:
        r: the rank.
        lora_alpha: the scale numerator: scaling = lora_alpha / r (/ sqrt(r) with rsLoRA).
        target_modules: the HF linear names the adapter changes (q_proj, ...).
        use_rslora: rank-stabilized scaling.
        base_model_name_or_path: the model it was trained on.
    """

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    base_model_name_or_path: str | None = None

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def read_adapter_config(path: str, max_lora_rank: int | None = None) -> PeftAdapterConfig:
    """Read and check a PEFT folder's config: what kvserve can serve, else a ValueError that
    says why (the api turns it into a 400, the scheduler into the request's error).

    Args:
        path: the PEFT folder.
        max_lora_rank: the engine's --max-lora-rank; None skips that check.
    """
    config_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(config_path):
        raise ValueError(f"no LoRA adapter at {path!r}: {ADAPTER_CONFIG} not found")
    if not os.path.isfile(os.path.join(path, ADAPTER_WEIGHTS)):
        raise ValueError(f"the LoRA adapter at {path!r} lacks {ADAPTER_WEIGHTS}")
    try:
        with open(config_path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {config_path}: {exc}") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{config_path}: peft_type {raw['peft_type']!r} is not LORA")
    unsupported = {
        "use_dora": bool(raw.get("use_dora")),
        "modules_to_save": bool(raw.get("modules_to_save")),
        "rank_pattern": bool(raw.get("rank_pattern")),
        "alpha_pattern": bool(raw.get("alpha_pattern")),
        "fan_in_fan_out": bool(raw.get("fan_in_fan_out")),
        "bias": raw.get("bias", "none") not in (None, "none"),
    }
    refused = sorted(name for name, used in unsupported.items() if used)
    if refused:
        raise ValueError(f"{config_path}: kvserve does not support LoRA {', '.join(refused)}")
    targets = raw.get("target_modules") or []
    if isinstance(targets, str):
        raise ValueError(f"{config_path}: target_modules must be a list of names, not a regex")
    targets = tuple(sorted({name.rsplit(".", 1)[-1] for name in targets}))
    unknown = sorted(set(targets) - SUPPORTED_TARGET_MODULES)
    if unknown or not targets:
        raise ValueError(
            f"{config_path}: target_modules {list(targets)} must be among "
            f"{sorted(SUPPORTED_TARGET_MODULES)}"
        )
    rank = int(raw.get("r", 8))
    if rank < 1:
        raise ValueError(f"{config_path}: r must be positive, got {rank}")
    if max_lora_rank is not None and rank > max_lora_rank:
        raise ValueError(
            f"the LoRA adapter at {path!r} has rank {rank}, more than --max-lora-rank "
            f"{max_lora_rank}"
        )
    return PeftAdapterConfig(
        r=rank,
        lora_alpha=float(raw.get("lora_alpha", 8)),
        target_modules=targets,
        use_rslora=bool(raw.get("use_rslora", False)),
        base_model_name_or_path=raw.get("base_model_name_or_path"),
    )


def lora_extra_key(lora_request: LoRARequest | None) -> bytes:
    """The block-hash extra key of a request's adapter (empty for the base model): blocks
    computed under one adapter are never a prefix hit for another."""
    if lora_request is None:
        return b""
    return b"lora\x00" + lora_request.lora_int_id.to_bytes(8, "little")
