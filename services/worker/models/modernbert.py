"""ModernBERT encoders (embedding models and classifiers), served under `--runner pooling`.

Pre-LayerNorm layers (the first layer's attention norm is the embedding norm), rotary
position embeddings (rotate-half, as HF's), a GeGLU MLP, no biases by default, and attention
that alternates: every `global_attn_every_n_layers`-th layer sees the whole input with
`global_rope_theta`, the others a local window of `local_attention // 2` tokens on either
side with `local_rope_theta` (HF's `layer_types` and `rope_parameters`). Names mirror HF's:
`embeddings.*`, `layers.N.*`, `final_norm.*`, and for the classifier `model.*`, `head.*`,
`classifier.*`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from kvserve.services.worker.layers.attention import AttentionMetadata
from kvserve.services.worker.layers.bidirectional import EncoderBatch, bidirectional_attention
from kvserve.services.worker.models.bert import EncoderLinear, activation, load_named


def _layer_norm(config: Any) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


def _rope_theta(config: Any, layer_type: str) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params and params[layer_type]:
        return float(params[layer_type]["rope_theta"])
    name = "global_rope_theta" if layer_type == "full_attention" else "local_rope_theta"
    return float(getattr(config, name))


def _layer_types(config: Any) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    every = config.global_attn_every_n_layers
    return [
        "sliding_attention" if i % every else "full_attention"
        for i in range(config.num_hidden_layers)
    ]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of [T, H, D] rows by per-token [T, 1, D] tables."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class ModernBertAttention(nn.Module):
    def __init__(self, config: Any, window: int | None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        hidden = config.hidden_size
        self.Wqkv = EncoderLinear(hidden, 3 * hidden, bias=config.attention_bias)
        self.Wo = EncoderLinear(hidden, hidden, bias=config.attention_bias)
        self.window = window

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: EncoderBatch,
        residual: torch.Tensor,
    ) -> torch.Tensor:
        """residual + attention(x)."""
        qkv = self.Wqkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        out = bidirectional_attention(q, k, v, batch, self.head_dim**-0.5, self.window)
        return self.Wo(out, add=residual)


class ModernBertMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.Wi = EncoderLinear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.Wo = EncoderLinear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act = activation(config.hidden_activation)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + MLP(x)."""
        up, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(up) * gate, add=residual)


class ModernBertLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        window = config.local_attention // 2 if layer_type == "sliding_attention" else None
        self.attn_norm = nn.Identity() if layer_idx == 0 else _layer_norm(config)
        self.attn = ModernBertAttention(config, window)
        self.mlp_norm = _layer_norm(config)
        self.mlp = ModernBertMLP(config)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: EncoderBatch
    ) -> torch.Tensor:
        x = self.attn(self.attn_norm(x), rope, batch, residual=x)
        return self.mlp(self.mlp_norm(x), residual=x)


class _Embeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = _layer_norm(config)


class ModernBertModel(nn.Module):
    """The encoder: final hidden states [T, hidden] of the step's flattened tokens.

    Args:
        config: the HF ModernBertConfig.
    """

    is_encoder = True

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        types = _layer_types(config)
        self.embeddings = _Embeddings(config)
        self.layers = nn.ModuleList(ModernBertLayer(config, i, t) for i, t in enumerate(types))
        self.layer_types = types
        self.final_norm = _layer_norm(config)
        head_dim = config.hidden_size // config.num_attention_heads
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        # Inverse frequencies per layer type (float32, never the model dtype).
        self.inv_freq = {t: 1.0 / (_rope_theta(config, t) ** exponents) for t in set(types)}

    def _rope_tables(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        tables = {}
        for layer_type, inv_freq in self.inv_freq.items():
            freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
            tables[layer_type] = (emb.cos(), emb.sin())
        return tables

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        intermediate_tensors: Any = None,
        token_type_ids: torch.Tensor | None = None,  # ModernBERT has no token types
    ) -> torch.Tensor:
        batch = EncoderBatch(attn_metadata.query_start_loc)
        rope = self._rope_tables(positions)
        x = self.embeddings.norm(self.embeddings.tok_embeddings(input_ids))
        for layer, layer_type in zip(self.layers, self.layer_types, strict=True):
            x = layer(x, rope[layer_type], batch)
        return self.final_norm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named(self, weights, prefixes=("model.",))


class _PredictionHead(nn.Module):
    """HF's ModernBertPredictionHead: dense -> activation -> LayerNorm."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = EncoderLinear(config.hidden_size, config.hidden_size, config.classifier_bias)
        self.act = activation(config.classifier_activation)
        self.norm = _layer_norm(config)


class ModernBertForSequenceClassification(nn.Module):
    """ModernBERT, pooled as `classifier_pooling` says (cls or mean: the api asks the runner
    for it), then its head (dense -> activation -> LayerNorm) and a linear classifier."""

    is_encoder = True

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.num_labels = config.num_labels
        self.model = ModernBertModel(config)
        self.head = _PredictionHead(config)
        self.classifier = EncoderLinear(config.hidden_size, config.num_labels)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.model(*args, **kwargs)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] pooled rows -> [N, num_labels] logits."""
        head = self.head
        return self.classifier(head.norm(head.act(head.dense(pooled))))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named(self, weights, prefixes=())
