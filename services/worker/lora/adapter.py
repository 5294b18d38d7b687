"""A PEFT LoRA adapter read from disk into host memory, one (A, B) pair per HF module.

PEFT saves `base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]
for each target module; y = W x + scaling * B (A x), scaling = lora_alpha / r.
"""

from __future__ import annotations

import os
import re

import torch

from kvserve.shared.lora import ADAPTER_WEIGHTS, LoRARequest, PeftAdapterConfig, read_adapter_config

_PEFT_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.\w+)?\.weight$"
)


class LoRAAdapter:
    """One adapter's weights on the host.

    Args:
        lora_int_id: the engine-wide id of the adapter.
        config: its checked adapter_config.json.
        weights: HF module name ("model.layers.0.self_attn.q_proj") -> (A [r, in], B [out, r]),
            float32 on the CPU.
    """

    def __init__(
        self,
        lora_int_id: int,
        config: PeftAdapterConfig,
        weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ):
        self.lora_int_id = lora_int_id
        self.config = config
        self.weights = weights

    @property
    def rank(self) -> int:
        return self.config.r

    @property
    def scaling(self) -> float:
        return self.config.scaling


def load_adapter(lora_request: LoRARequest, max_lora_rank: int) -> LoRAAdapter:
    """Read a PEFT folder; a ValueError says what is wrong with it."""
    from safetensors.torch import load_file

    config = read_adapter_config(lora_request.lora_path, max_lora_rank)
    tensors = load_file(os.path.join(lora_request.lora_path, ADAPTER_WEIGHTS), device="cpu")
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _PEFT_KEY.match(key)
        if match is None:
            raise ValueError(f"{lora_request.lora_path}: {key!r} is not a LoRA A or B weight")
        halves.setdefault(match["module"], {})[match["ab"]] = tensor.float()
    weights = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{lora_request.lora_path}: {module} lacks lora_A or lora_B")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != config.r or b.shape[1] != config.r:
            raise ValueError(
                f"{lora_request.lora_path}: {module} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}, not rank {config.r}"
            )
        weights[module] = (a, b)
    if not weights:
        raise ValueError(f"{lora_request.lora_path}: the adapter holds no LoRA weights")
    return LoRAAdapter(lora_request.lora_int_id, config, weights)
