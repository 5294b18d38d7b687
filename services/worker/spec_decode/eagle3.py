"""EAGLE-3 draft head (arXiv 2503.01840): one decoder layer over three target layers' states.

The target keeps the residual stream entering three of its layers (LlamaModel's
`aux_hidden_state_layers`: the draft config's `eagle_aux_hidden_state_layer_ids`, else
vLLM's and SpecForge's default (2, L // 2, L - 3) for a target of L layers). For the pair
(position p, token x_{p+1}):

    g_p = fc([a_p | b_p | c_p])                 Linear(3H, H), no bias: the three states fused
    e_p = embed(x_{p+1})                        the draft's own embedding, else the target's
    x   = [input_layernorm(e_p) | hidden_norm(g_p)]     2H wide: qkv_proj takes 2H
    r   = attn(x at RoPE position p) + g_p      (+ hidden_norm(g_p) with norm_before_residual)
    h_p = mlp(post_attention_layernorm(r)) + r  the head's output, before its final norm
    guess x_{p+2} = d2t-map(argmax lm_head(norm(h_p)))  over the draft vocabulary

Drafting chains as EAGLE-1's does (eagle_proposer.py): the next pair is (h_p, guess) at
position p + 1, with h_p in place of g (no more fc). The draft vocabulary may be smaller than
the target's: `d2t[d]` is the offset of draft id d, target id = d + d2t[d].

Checkpoints are the published EAGLE-3 layout (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B):
config.json (architectures ["LlamaForCausalLMEagle3"], a one-layer LlamaConfig with
`draft_vocab_size`) and model.safetensors or pytorch_model.bin with `fc.weight`,
`midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`,
`norm.weight`, `lm_head.weight`, `d2t`, optionally `t2d` (checked for shape, not used) and
`embed_tokens.weight` (then the draft's own embedding).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvserve.services.worker.layers.attention import Attention, AttentionMetadata
from kvserve.services.worker.layers.embed_head import VocabParallelEmbedding
from kvserve.services.worker.layers.layernorm import RMSNorm
from kvserve.services.worker.layers.linear import (
    QKVParallelLinear,
    ReplicatedLinear,
    default_weight_loader,
)
from kvserve.services.worker.models import _default_dtype
from kvserve.services.worker.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)
from kvserve.services.worker.spec_decode.checkpoint import read_tensors
from kvserve.services.worker.spec_decode.eagle import EagleConfig, _fused_name, split_fused

_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's and SpecForge's layers for a target of num_layers: low, middle, high."""
    return 2, num_layers // 2, num_layers - 3


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 head's config.json.

    Args:
        layer: the decoder layer's shape (hidden and vocabulary sizes are the target's).
        draft_vocab_size: rows of lm_head (the vocabulary the draft guesses in).
        aux_layer_ids: the target layers whose input stream fc fuses (None: the default
            for the target's depth).
        norm_before_residual: the residual after attention is hidden_norm(g), not g.
    """

    layer: EagleConfig
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Eagle3Config:
        archs = raw.get("architectures") or []
        if not any(arch in ARCHITECTURES for arch in archs):
            raise ValueError(
                f"config.json architectures {archs}: an EAGLE-3 head is one of "
                f"{list(ARCHITECTURES)}"
            )
        layer = EagleConfig.from_dict(raw)
        nested = raw.get("eagle_config") or {}
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or nested.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        return cls(
            layer=layer,
            draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
            aux_layer_ids=tuple(int(i) for i in ids) if ids else None,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
        )

    @classmethod
    def from_folder(cls, path: str) -> Eagle3Config:
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"eagle3 checkpoint {path}: no config.json")
        with open(config_path) as f:
            raw = json.load(f)
        try:
            return cls.from_dict(raw)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"eagle3 checkpoint {path}: {exc}") from None

    def to_dict(self) -> dict:
        """The config.json fields (EAGLE-1's LlamaConfig dict plus EAGLE-3's keys)."""
        out = self.layer.to_dict()
        del out["bias"]
        out["architectures"] = [ARCHITECTURES[0]]
        out["draft_vocab_size"] = self.draft_vocab_size
        out["norm_before_residual"] = self.norm_before_residual
        if self.aux_layer_ids is not None:
            out["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        return out

    def aux_layers_for(self, num_layers: int) -> tuple[int, ...]:
        """The target layers to read, checked against its depth (an index of num_layers is
        the last layer's output, before the final norm)."""
        ids = self.aux_layer_ids or default_aux_layer_ids(num_layers)
        if len(ids) != 3 or not all(0 <= i <= num_layers for i in ids):
            raise ValueError(
                f"aux hidden state layers {list(ids)} for a target of {num_layers} layers: "
                f"EAGLE-3 reads three layers in [0, {num_layers}] (set "
                "eagle_aux_hidden_state_layer_ids in the draft's config.json)"
            )
        return tuple(ids)


class Eagle3Layer(LlamaDecoderLayer):
    """A Llama layer whose attention reads [embedding | hidden state] (2H wide), with
    `hidden_norm` for the hidden state; Eagle3Head.forward runs its parts."""

    def __init__(self, shape: EagleConfig, max_position: int):
        super().__init__(shape.layer_config(max_position), 0, LlamaForCausalLM)
        hidden = shape.hidden_size
        self.self_attn.qkv_proj = QKVParallelLinear(
            2 * hidden,
            self.self_attn.head_dim,
            shape.num_attention_heads,
            shape.num_key_value_heads,
        )
        self.hidden_norm = RMSNorm(hidden, shape.rms_norm_eps)


class Eagle3Head(nn.Module):
    """The EAGLE-3 draft over the paged KV cache (see the module docstring).

    Args:
        config: the head's shape.
        target_model: the target (LlamaForCausalLM-style), whose aux hidden states the head
            reads and, without its own embedding, whose embedding too (not submodules).
        own_embedding: the checkpoint has `embed_tokens.weight`.
    """

    d2t: torch.Tensor  # [draft_vocab_size] target id - draft id (a buffer)

    def __init__(self, config: Eagle3Config, target_model: nn.Module, own_embedding: bool):
        super().__init__()
        shape = config.layer
        target_config: Any = target_model.config
        for what, ours, theirs in (
            ("hidden size", shape.hidden_size, target_config.hidden_size),
            ("vocabulary", shape.vocab_size, target_config.vocab_size),
        ):
            if ours != theirs:
                raise ValueError(
                    f"the head has {what} {ours}, the target model {theirs}: it was trained "
                    f"for another model ({shape.base_model or 'unnamed'})"
                )
        if not 0 < config.draft_vocab_size <= shape.vocab_size:
            raise ValueError(
                f"draft_vocab_size {config.draft_vocab_size} is not in [1, {shape.vocab_size}]"
            )
        self.config = config
        inner = target_model.get_submodule("model")
        assert isinstance(inner, LlamaModel), "load_eagle3 checks the target's decoder"
        # A function, not a submodule: the target is neither saved nor moved with the head.
        self._target_aux = lambda: inner.aux_hidden_states
        self.aux_layer_ids = config.aux_layers_for(target_config.num_hidden_layers)
        hidden = shape.hidden_size
        if own_embedding:
            self.embed_tokens: nn.Module | None = VocabParallelEmbedding(shape.vocab_size, hidden)
        else:
            self.embed_tokens = None
            self._target_embed = target_model.get_submodule("model.embed_tokens").forward
        self.fc = ReplicatedLinear(len(self.aux_layer_ids) * hidden, hidden, bias=False)
        max_position = max(
            shape.max_position_embeddings,
            getattr(target_config, "max_position_embeddings", 0) or 0,
        )
        self.midlayer = Eagle3Layer(shape, max_position)
        self.norm = RMSNorm(hidden, shape.rms_norm_eps)
        self.lm_head = ReplicatedLinear(hidden, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))

    @property
    def attention_layers(self) -> list[Attention]:
        """The head's one Attention module; the runner binds its `kv_cache`."""
        return [m for m in self.midlayer.modules() if isinstance(m, Attention)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        return self._target_embed(input_ids)

    def target_features(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """g for the step's rows: fc over the target's aux hidden states (not its final
        hidden states, `hidden`, which EAGLE-3 does not read)."""
        del hidden
        aux = self._target_aux()
        assert aux is not None, "the target keeps its aux hidden states (LlamaModel)"
        return self.fc(aux[rows])

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids [T] (x_{p+1}), features [T, H] (g_p, or the head's own h), positions
        [T] (p). Returns h [T, H] before the final norm; `guess(h)` guesses x_{p+2}."""
        layer = self.midlayer
        embeds = self.embed(input_ids).to(features.dtype)
        normed = layer.hidden_norm(features)
        residual = normed if self.config.norm_before_residual else features
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        x = layer.self_attn(positions, x, attn_metadata)
        x, residual = layer.post_attention_layernorm(x, residual)
        return layer.mlp(x) + residual

    def guess(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] head outputs -> [N] target token ids (argmax over the draft vocabulary)."""
        draft_ids = self.lm_head(self.norm(hidden)).argmax(dim=-1)
        return draft_ids + self.d2t[draft_ids]

    # -- published names ------------------------------------------------------------------

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy published-layout tensors into the (fused) parameters; ValueError on an
        unknown name, a missing parameter or a tensor of another shape."""
        vocab, draft_vocab = self.config.layer.vocab_size, self.config.draft_vocab_size
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in tensors.items():
            if "rotary_emb.inv_freq" in name:
                continue
            if name in ("d2t", "t2d"):
                self._load_vocab_map(name, tensor)
                continue
            param_name, shard_id = _fused_name(name)
            param = params.get(param_name)
            if param is None:
                raise ValueError(f"tensor {name!r} matches no parameter of an EAGLE-3 head")
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                if shard_id is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard_id)
            except (RuntimeError, ValueError) as exc:
                raise ValueError(f"tensor {name!r}: {exc}") from None
            loaded.add(param_name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"lacks {len(missing)} parameters, e.g. {missing[:3]}")
        if "d2t" not in tensors and draft_vocab != vocab:
            raise ValueError(f"draft_vocab_size {draft_vocab} < vocab_size {vocab} needs d2t")

    def _load_vocab_map(self, name: str, tensor: torch.Tensor) -> None:
        vocab, draft_vocab = self.config.layer.vocab_size, self.config.draft_vocab_size
        size = draft_vocab if name == "d2t" else vocab
        if tuple(tensor.shape) != (size,):
            raise ValueError(f"{name} is {tuple(tensor.shape)}, expected ({size},)")
        if name == "t2d":
            return  # target -> draft membership: not needed to guess
        targets = torch.arange(draft_vocab) + tensor.long()
        if targets.min() < 0 or targets.max() >= vocab:
            raise ValueError(f"d2t maps draft ids outside the target vocabulary [0, {vocab})")
        self.d2t.copy_(tensor.long())

    def published_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors under the published names (q/k/v and gate/up split again)."""
        attn = self.midlayer.self_attn
        return split_fused(self.state_dict(), attn.q_size, attn.kv_size)


def load_eagle3(
    path: str,
    target_model: nn.Module,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Eagle3Head:
    """An Eagle3Head from a folder in the published layout, in dtype on device; the target
    keeps its aux hidden states from now on (LlamaModel.aux_hidden_state_layers)."""
    inner = getattr(target_model, "model", None)
    if not isinstance(inner, LlamaModel):
        raise ValueError(
            f"eagle3: the target {type(target_model).__name__} has no Llama-style decoder "
            "whose layers' hidden states the head could read"
        )
    config = Eagle3Config.from_folder(path)
    tensors = read_tensors(path, _WEIGHT_FILES, "eagle3")
    try:
        with _default_dtype(dtype), torch.device(device):
            head = Eagle3Head(config, target_model, "embed_tokens.weight" in tensors)
        head.load_weights(tensors)
    except ValueError as exc:
        raise ValueError(f"eagle3 checkpoint {path}: {exc}") from None
    inner.aux_hidden_state_layers = head.aux_layer_ids
    return head.eval()


def save_eagle3(head: Eagle3Head, folder: str) -> None:
    """Write the published layout (config.json + model.safetensors)."""
    save_eagle3_tensors(head.config, head.published_state_dict(), folder)


def save_eagle3_tensors(
    config: Eagle3Config, tensors: Mapping[str, torch.Tensor], folder: str
) -> None:
    """Write config and tensors already under the published names (a head's
    published_state_dict, or the training module's state_dict) as the published layout."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=1)
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    save_file(cpu, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
