"""EAGLE-1 draft head: one Llama decoder layer that predicts the target's next feature.

f_p is the target's final hidden state at position p after the final norm (what its LM head
reads). The draft's input at position p is the pair (f_p, x_{p+1}), x_{p+1} the token after p:

    e_p = embed(x_{p+1})                    the target's own embedding (shared, frozen)
    z_p = fc([e_p | f_p])                   Linear(2H, H), bias when config `bias`
    h_p = layer(z_p) at RoPE position p     causal over pairs 0..p; no input norm (EAGLE-1)
    logits_p = target LM head(h_p)          guesses x_{p+2}; h_p is the guess of f_{p+1}

h_p is the layer's output sum (residual + MLP), with no final norm. Drafting chains: after
h_p gives d1, the next pair is (h_p, d1) at position p + 1, and so on. The layer is our
LlamaDecoderLayer, so its K/V live in a paged cache (`attention_layers[0].kv_cache`, bound
by the runner with the target's block ids).

Checkpoints (`load_eagle`, written by `save_eagle`) are the published EAGLE-1 layout:
config.json (a LlamaConfig with num_hidden_layers 1, `bias` for fc) and model.safetensors or
pytorch_model.bin with `fc.weight`, `fc.bias`, `layers.0.self_attn.{q,k,v,o}_proj.weight`,
`layers.0.mlp.{gate,up,down}_proj.weight`, `layers.0.post_attention_layernorm.weight`, and
optionally `embed_tokens.weight` (a copy of the target's: checked for shape, not used).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import torch
from torch import nn

from kvserve.services.worker.layers.attention import Attention, AttentionMetadata
from kvserve.services.worker.layers.linear import ReplicatedLinear, default_weight_loader
from kvserve.services.worker.layers.rotary_embedding import rope_parameters_from_config
from kvserve.services.worker.models import _default_dtype
from kvserve.services.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from kvserve.services.worker.parallel_state import get_tp_size
from kvserve.services.worker.spec_decode.checkpoint import read_tensors

_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass(frozen=True)
class EagleConfig:
    """The shape of an EAGLE-1 head (its config.json, a one-layer LlamaConfig).

    Args:
        hidden_size, vocab_size: the target's.
        num_attention_heads, num_key_value_heads, head_dim, intermediate_size: the layer's.
        rms_norm_eps: of the post-attention norm.
        rope_parameters: `rope_type`, `rope_theta` and scaling keys (rope_parameters_from_config).
        max_position_embeddings: positions the config names (the head's RoPE table covers at
            least the target's too).
        hidden_act: the MLP activation.
        fc_bias: whether fc has a bias (EAGLE's `bias`, true by default).
        base_model: the target the head was trained for (informational).
    """

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default"})
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    fc_bias: bool = True
    base_model: str | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> EagleConfig:
        num_layers = int(raw.get("num_hidden_layers", 1))
        if num_layers != 1:
            raise ValueError(
                f"eagle: num_hidden_layers={num_layers}; an EAGLE head (1 or 3) has one "
                "decoder layer"
            )
        num_heads = int(raw["num_attention_heads"])
        max_position = int(raw.get("max_position_embeddings") or 2048)
        rope_source = SimpleNamespace(
            rope_parameters=raw.get("rope_parameters"),
            rope_scaling=raw.get("rope_scaling"),
            rope_theta=raw.get("rope_theta", 10000.0),
            max_position_embeddings=max_position,
        )
        return cls(
            hidden_size=int(raw["hidden_size"]),
            vocab_size=int(raw["vocab_size"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // num_heads),
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_parameters=rope_parameters_from_config(rope_source),
            max_position_embeddings=max_position,
            hidden_act=raw.get("hidden_act", "silu"),
            fc_bias=bool(raw.get("bias", True)),
            base_model=raw.get("base_model_name_or_path"),
        )

    @classmethod
    def from_folder(cls, path: str) -> EagleConfig:
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"eagle checkpoint {path}: no config.json")
        with open(config_path) as f:
            raw = json.load(f)
        try:
            return cls.from_dict(raw)
        except KeyError as exc:
            raise ValueError(f"eagle checkpoint {path}: config.json lacks {exc}") from None

    def to_dict(self) -> dict:
        """The config.json fields (a LlamaConfig dict, as EAGLE-1 publishes)."""
        rope = dict(self.rope_parameters)
        rope_theta = rope.pop("rope_theta", 10000.0)
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": rope_theta,
            "rope_scaling": rope if rope.get("rope_type", "default") != "default" else None,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act,
            "bias": self.fc_bias,
            "base_model_name_or_path": self.base_model,
        }

    def layer_config(self, max_position: int) -> SimpleNamespace:
        """What LlamaDecoderLayer reads, with a RoPE table of `max_position` positions."""
        return SimpleNamespace(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            hidden_act=self.hidden_act,
            max_position_embeddings=max_position,
            rope_parameters=dict(self.rope_parameters),
        )


class _NoInputNorm(nn.Module):
    """EAGLE-1's first layer has no input norm: the identity, keeping RMSNorm's calling
    convention (with a residual: the fused add alone, (x + residual, x + residual))."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return x
        x = x + residual
        return x, x


class EagleHead(nn.Module):
    """The EAGLE-1 draft over the paged KV cache (see the module docstring).

    Args:
        config: the head's shape; hidden and vocabulary must be the target's.
        target_model: the target (LlamaForCausalLM-style: `.config`,
            `.model.embed_tokens`), whose embedding the head reads (not a submodule: it is
            neither saved nor moved with the head).
    """

    def __init__(self, config: EagleConfig, target_model: nn.Module):
        super().__init__()
        check_target(config, target_model.config)
        self.config = config
        # A method, not a submodule: not registered.
        self.embed_tokens = target_model.get_submodule("model.embed_tokens").forward
        hidden = config.hidden_size
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias=config.fc_bias)
        max_position = max(
            config.max_position_embeddings,
            getattr(target_model.config, "max_position_embeddings", 0) or 0,
        )
        layer = LlamaDecoderLayer(config.layer_config(max_position), 0, LlamaForCausalLM)
        layer.input_layernorm = _NoInputNorm()
        self.layers = nn.ModuleList([layer])

    @property
    def attention_layers(self) -> list[Attention]:
        """The head's one Attention module; the runner binds its `kv_cache`."""
        return [m for m in self.layers.modules() if isinstance(m, Attention)]

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids [T] (x_{p+1}), features [T, H] (f_p, or the draft's own h), positions
        [T] (p). Returns h [T, H]; the target's compute_logits(h) guesses x_{p+2}."""
        embeds = self.embed_tokens(input_ids).to(features.dtype)
        hidden_states = self.fc(torch.cat([embeds, features], dim=-1))
        hidden_states, residual = self.layers[0](positions, hidden_states, None, attn_metadata)
        return hidden_states + residual

    # -- published names ------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy published-layout tensors into the (fused) parameters; ValueError on an
        unknown name, a missing parameter or an embedding of another shape."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "embed_tokens.weight":
                hidden, vocab = self.config.hidden_size, self.config.vocab_size
                if tuple(tensor.shape) != (vocab, hidden):
                    raise ValueError(
                        f"eagle checkpoint: embed_tokens.weight is {tuple(tensor.shape)}, the "
                        f"target's embedding ({vocab}, {hidden})"
                    )
                continue  # the target's embedding is used
            param_name, shard_id = _fused_name(name)
            param = params.get(param_name)
            if param is None:
                raise ValueError(f"eagle checkpoint tensor {name!r} matches no parameter")
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
            loaded.add(param_name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(
                f"eagle checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}"
            )

    def published_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters under the published names (q/k/v and gate/up split again)."""
        assert get_tp_size() == 1, "save a head from a single-rank model"
        attn = cast(LlamaDecoderLayer, self.layers[0]).self_attn
        return split_fused(self.state_dict(), attn.q_size, attn.kv_size)


def split_fused(
    state_dict: Mapping[str, torch.Tensor], q_size: int, kv_size: int
) -> dict[str, torch.Tensor]:
    """A head's tensors under the published names: the fused qkv_proj and gate_up_proj
    split again into q/k/v and gate/up (`_fused_name` is the way in)."""
    out = {}
    for name, tensor in state_dict.items():
        if name.endswith("qkv_proj.weight"):
            parts = tensor.split([q_size, kv_size, kv_size])
            for shard, part in zip(("q_proj", "k_proj", "v_proj"), parts):
                out[name.replace("qkv_proj", shard)] = part
        elif name.endswith("gate_up_proj.weight"):
            for shard, part in zip(("gate_proj", "up_proj"), tensor.chunk(2)):
                out[name.replace("gate_up_proj", shard)] = part
        else:
            out[name] = tensor
    return out


def _fused_name(name: str) -> tuple[str, object]:
    for src, (dst, shard_id) in LlamaForCausalLM.packed_modules_mapping.items():
        if f".{src}." in name:
            return name.replace(f".{src}.", f".{dst}."), shard_id
    return name, None


def check_target(config: EagleConfig, target_config: Any) -> None:
    """Raise ValueError when the head was not made for a model of this shape."""
    made_for = config.base_model or "unnamed"
    for what, ours, theirs in (
        ("hidden size", config.hidden_size, target_config.hidden_size),
        ("vocabulary", config.vocab_size, target_config.vocab_size),
    ):
        if ours != theirs:
            raise ValueError(
                f"eagle head has {what} {ours}, the target model {theirs}: the head was "
                f"trained for another model ({made_for})"
            )


# ---------------------------------------------------------------------- reading and writing


def load_eagle(
    path: str,
    target_model: nn.Module,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> EagleHead:
    """An EagleHead from a folder in the published EAGLE-1 layout, in dtype on device (its
    RoPE table stays float32)."""
    config = EagleConfig.from_folder(path)
    tensors = read_tensors(path, _WEIGHT_FILES, "eagle")
    with _default_dtype(dtype), torch.device(device):
        head = EagleHead(config, target_model)
    try:
        head.load_weights(tensors.items())
    except ValueError as exc:
        raise ValueError(f"eagle checkpoint {path}: {exc}") from None
    return head.eval()


def save_eagle(
    head_or_state: EagleHead | Mapping[str, torch.Tensor],
    folder: str,
    base_model: str | None = None,
    config: EagleConfig | None = None,
) -> None:
    """Write the published layout (config.json + model.safetensors).

    Args:
        head_or_state: a head, or tensors already under the published names (the training
            module's state_dict), which then need `config`.
        base_model: recorded as `base_model_name_or_path`.
    """
    from dataclasses import replace

    from safetensors.torch import save_file

    if isinstance(head_or_state, EagleHead):
        config = config or head_or_state.config
        state = head_or_state.published_state_dict()
    else:
        assert config is not None, "tensors without a head need their config"
        state = dict(head_or_state)
    config = replace(config, base_model=base_model or config.base_model)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=1)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
