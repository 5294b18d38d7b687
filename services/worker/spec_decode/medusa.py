"""Medusa heads: K residual heads over the target's final hidden state (Medusa-1).

At the last verified position the target's LM head reads hidden state h and predicts the next
token x1. Head i reads the same h and guesses the token i + 1 places after x1:

    h ──▶ LM head        ──▶ x1          (the target's own token, verified)
    h ──▶ blocks[0] ─▶ lm ──▶ x2          (draft 0)
    h ──▶ blocks[1] ─▶ lm ──▶ x3          (draft 1)  ...

Each block is `num_layers` times x <- x + SiLU(W x + b). The lm of a head is its own matrix,
one matrix for all heads (vLLM's `original_lm_head`), or the target's LM head itself (our
`share_lm_head`: no weights saved, and all heads' logits are one GEMM through the target's
`compute_logits`, which all-gathers TP slices and applies soft caps).

Checkpoints read (`load_medusa`):
- FasterDecoding/Medusa: config.json with `medusa_num_heads`, `medusa_num_layers`;
  `medusa_lm_head.safetensors` or `.pt` with `{head}.{layer}.linear.weight/bias` and
  `{head}.{num_layers}.weight` (the head's lm).
- vLLM: config.json with `model_type: "medusa"`, `num_heads`, `num_hidden_layers`,
  `hidden_size`, `vocab_size`, optional `truncated_vocab_size` (then a `token_map` tensor
  maps draft ids to target ids); model.safetensors with `blocks.{i}.layers.{j}.weight/bias`
  and `lm_heads.{i}.weight`. Biases are used when the file has them.
`save_medusa` writes the vLLM layout.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.services.worker.spec_decode.checkpoint import read_tensors
from kvserve.services.worker.spec_decode.draft_head import DraftLMHead

LMHeadKind = Literal["per_head", "single", "target"]
_VLLM_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
_MEDUSA_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


@dataclass(frozen=True)
class MedusaConfig:
    """The shape of a set of Medusa heads.

    Args:
        hidden_size: the target's hidden size.
        vocab_size: the target's vocabulary; None when the heads share the target's LM head
            and the checkpoint names none.
        num_heads: K, the most tokens proposed per step.
        num_layers: residual layers per head (0: the head is its lm alone).
        lm_head: "per_head" (each head its own matrix), "single" (one matrix for all heads)
            or "target" (the target's LM head, not stored).
        fc_bias: whether the residual layers have a bias.
        truncated_vocab_size: rows of a stored lm when it covers only the `token_map` ids.
        base_model: the target the heads were trained for (informational).
    """

    hidden_size: int
    vocab_size: int | None
    num_heads: int
    num_layers: int
    lm_head: LMHeadKind = "target"
    fc_bias: bool = True
    truncated_vocab_size: int | None = None
    base_model: str | None = None

    def __post_init__(self):
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(
                f"medusa: num_heads={self.num_heads} must be >= 1 and "
                f"num_layers={self.num_layers} >= 0"
            )
        if self.lm_head != "target" and self.vocab_size is None:
            raise ValueError("medusa: heads with their own lm head need a vocab_size")

    @property
    def draft_vocab_size(self) -> int | None:
        """Rows of a stored lm head (the truncated vocabulary when there is one)."""
        return self.truncated_vocab_size or self.vocab_size

    @property
    def is_truncated(self) -> bool:
        return self.draft_vocab_size != self.vocab_size


class ResidualBlock(nn.Module):
    """`num_layers` times x <- x + SiLU(W x + b), each layer its own W."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """The residual blocks and lm heads of K Medusa heads, zero-initialised so that every
    head starts as its lm head alone (SiLU(0) = 0).

    Args:
        config: the heads' shape.
    """

    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            ResidualBlock(config.hidden_size, config.num_layers, config.fc_bias)
            for _ in range(config.num_heads)
        )
        num_lm_heads = {"per_head": config.num_heads, "single": 1, "target": 0}[config.lm_head]
        rows = config.draft_vocab_size or 0
        self.lm_heads = nn.ModuleList(
            nn.Linear(config.hidden_size, rows, bias=False) for _ in range(num_lm_heads)
        )
        self.register_buffer("token_map", None)
        if config.is_truncated:
            self.token_map = torch.zeros(rows, dtype=torch.int64)
        for layer in self.blocks.modules():  # the blocks' only Linears are their layers
            if isinstance(layer, nn.Linear):
                nn.init.zeros_(layer.weight)
                if layer.bias is not None:
                    nn.init.zeros_(layer.bias)

    def forward(self, hidden_states: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """hidden_states [B, H] -> the first `num_heads` heads' states [B, k, H]."""
        blocks = self.blocks[: num_heads or self.config.num_heads]
        return torch.stack([block(hidden_states) for block in blocks], dim=1)

    def compute_logits(
        self,
        head_states: torch.Tensor,
        target_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """head_states [B, k, H] -> float32 logits [B, k, V] over the draft vocabulary.

        Args:
            target_logits: hidden [N, H] -> logits [N, V]: the target's LM head, for heads
                that share it (lm_head "target").
        """
        num_reqs, num_heads, hidden = head_states.shape
        if self.config.lm_head == "per_head":
            per_head = [lm(head_states[:, i]) for i, lm in enumerate(self.lm_heads[:num_heads])]
            return torch.stack(per_head, dim=1).float()
        # One lm for every head: all B * k rows in one GEMM.
        rows = head_states.reshape(num_reqs * num_heads, hidden)
        if self.config.lm_head == "single":
            logits = self.lm_heads[0](rows)
        else:
            assert target_logits is not None, "these heads share the target's LM head"
            logits = target_logits(rows)
        return logits.float().view(num_reqs, num_heads, -1)


class MedusaProposer:
    """Greedy chain drafts from Medusa heads over the target's final hidden states.

    Args:
        heads: the loaded heads, in the target's dtype and on its device.
        target_model: the target (a LlamaForCausalLM-style model: `.config`,
            `.compute_logits`), whose LM head shared heads use.
    """

    def __init__(self, heads: MedusaHeads, target_model: nn.Module):
        check_target(heads.config, target_model.config)
        self.heads = heads.eval()
        self.target_model = target_model
        self.lm_head = DraftLMHead(target_model)

    @classmethod
    def load(
        cls,
        path: str,
        target_model: nn.Module,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> MedusaProposer:
        """Heads from a checkpoint folder of either layout (see the module docstring)."""
        return cls(load_medusa(path, dtype, device), target_model)

    @property
    def num_heads(self) -> int:
        return self.heads.config.num_heads

    @torch.inference_mode()
    def propose(self, hidden_states: torch.Tensor, num_spec: int) -> torch.Tensor:
        """hidden_states [B, H]: the target's final hidden states (after the final norm) at
        each request's last verified position. Returns [B, num_spec] int64 draft ids: the
        argmax of heads 0 .. num_spec - 1."""
        assert 0 < num_spec <= self.num_heads, (num_spec, self.num_heads)
        head_states = self.heads(hidden_states, num_spec)
        logits = self.heads.compute_logits(head_states, self.lm_head.logits)
        draft_ids = logits.argmax(dim=-1)
        if self.heads.token_map is not None:
            draft_ids = self.heads.token_map[draft_ids]
        return draft_ids.to(torch.int64)


def check_target(config: MedusaConfig, target_config: Any) -> None:
    """Raise ValueError when the heads were not made for a model of this shape."""
    hidden, vocab = target_config.hidden_size, target_config.vocab_size
    if config.hidden_size != hidden:
        raise ValueError(
            f"medusa heads have hidden size {config.hidden_size}, the target model {hidden}: "
            f"the heads were trained for another model ({config.base_model or 'unnamed'})"
        )
    if config.vocab_size is not None and config.vocab_size != vocab:
        raise ValueError(
            f"medusa heads have vocabulary {config.vocab_size}, the target model {vocab}: "
            f"the heads were trained for another model ({config.base_model or 'unnamed'})"
        )


# ---------------------------------------------------------------------- reading and writing


def load_medusa(
    path: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> MedusaHeads:
    """MedusaHeads from a folder in FasterDecoding's or vLLM's layout."""
    config, tensors = read_medusa_checkpoint(path)
    # Built on the meta device and given the file's tensors: no float32 copy of a 7B
    # model's lm heads is ever initialised.
    with torch.device("meta"):
        heads = MedusaHeads(config)
    try:
        heads.load_state_dict(tensors, strict=True, assign=True)
    except RuntimeError as exc:
        raise ValueError(
            f"medusa checkpoint {path}: tensors do not fit its config: {exc}"
        ) from None
    return heads.to(device=device, dtype=dtype)


def read_medusa_checkpoint(path: str) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    """(config, tensors under MedusaHeads' names) of either layout."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"medusa checkpoint {path}: no config.json")
    with open(config_path) as f:
        raw = json.load(f)
    if raw.get("model_type") == "medusa" or "num_heads" in raw:
        tensors = read_tensors(path, _VLLM_WEIGHTS, "medusa")
        tensors = {k.removeprefix("medusa_heads."): v for k, v in tensors.items()}
        return _vllm_config(raw, tensors), tensors
    if "medusa_num_heads" in raw:
        return _from_medusa_layout(raw, read_tensors(path, _MEDUSA_WEIGHTS, "medusa"))
    raise ValueError(
        f"medusa checkpoint {path}: config.json names neither `medusa_num_heads` "
        "(FasterDecoding/Medusa) nor `model_type: medusa` (vLLM)"
    )


def _vllm_config(raw: dict, tensors: dict[str, torch.Tensor]) -> MedusaConfig:
    num_heads, num_layers = int(raw["num_heads"]), int(raw.get("num_hidden_layers", 1))
    vocab = int(raw["vocab_size"]) if raw.get("vocab_size") is not None else None
    truncated = raw.get("truncated_vocab_size")
    if truncated is not None and vocab is not None and int(truncated) >= vocab:
        truncated = None
    if raw.get("share_lm_head"):
        lm_head: LMHeadKind = "target"
    elif raw.get("original_lm_head") or "lm_heads.1.weight" not in tensors:
        lm_head = "single"
        # vLLM's original_lm_head: lm_heads.0 serves every head.
        for i in range(1, num_heads):
            tensors.pop(f"lm_heads.{i}.weight", None)
    else:
        lm_head = "per_head"
    if truncated is not None and "token_map" not in tensors:
        raise ValueError(
            f"medusa checkpoint: truncated_vocab_size={truncated} needs a `token_map` tensor"
        )
    return MedusaConfig(
        hidden_size=int(raw["hidden_size"]),
        vocab_size=vocab,
        num_heads=num_heads,
        num_layers=num_layers,
        lm_head=lm_head,
        fc_bias=num_layers > 0 and "blocks.0.layers.0.bias" in tensors,
        truncated_vocab_size=int(truncated) if truncated is not None else None,
        base_model=raw.get("base_model_name_or_path"),
    )


def _from_medusa_layout(
    raw: dict, tensors: dict[str, torch.Tensor]
) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    # FasterDecoding's heads are nn.Sequential(ResBlock x num_layers, Linear): layer j of
    # head i is `i.j.linear`, its lm is `i.{num_layers}`.
    num_heads, num_layers = int(raw["medusa_num_heads"]), int(raw.get("medusa_num_layers", 1))
    renamed = {}
    for name, tensor in tensors.items():
        head, index, rest = name.removeprefix("medusa_head.").split(".", 2)
        if int(index) == num_layers:
            renamed[f"lm_heads.{head}.{rest}"] = tensor
        else:
            renamed[f"blocks.{head}.layers.{index}.{rest.removeprefix('linear.')}"] = tensor
    lm_head: LMHeadKind = "target" if raw.get("share_lm_head") else "per_head"
    first = renamed.get("lm_heads.0.weight", renamed.get("blocks.0.layers.0.weight"))
    if first is None:
        raise ValueError("medusa checkpoint: no tensors of head 0")
    config = MedusaConfig(
        hidden_size=first.shape[1],
        vocab_size=renamed["lm_heads.0.weight"].shape[0] if lm_head == "per_head" else None,
        num_heads=num_heads,
        num_layers=num_layers,
        lm_head=lm_head,
        fc_bias=num_layers > 0 and "blocks.0.layers.0.bias" in renamed,
        base_model=raw.get("base_model_name_or_path"),
    )
    return config, renamed


def save_medusa(heads: MedusaHeads, folder: str, base_model: str | None = None) -> None:
    """Write heads in vLLM's layout (config.json + model.safetensors).

    Heads that share the target's LM head save no lm weights and mark `share_lm_head`: only
    kvserve reads those (vLLM expects `lm_heads.{i}.weight`).
    """
    from safetensors.torch import save_file

    config = replace(heads.config, base_model=base_model or heads.config.base_model)
    os.makedirs(folder, exist_ok=True)
    fields = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "num_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "truncated_vocab_size": config.truncated_vocab_size,
        "medusa_fc_bias": config.fc_bias,
        "original_lm_head": config.lm_head == "single",
        "share_lm_head": config.lm_head == "target",
        "base_model_name_or_path": config.base_model,
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(fields, f, indent=1)
    tensors = {
        name: tensor.detach().to("cpu").contiguous() for name, tensor in heads.state_dict().items()
    }
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
