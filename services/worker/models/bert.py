"""BERT and XLM-RoBERTa encoders (embedding models and cross-encoders), served under
`--runner pooling`.

Post-LayerNorm transformer layers with bidirectional attention (layers/bidirectional.py),
learned absolute position embeddings and token-type embeddings. XLM-RoBERTa is BERT with its
positions counted from padding_idx + 1 (and one token type). The modules mirror HF's, so the
checkpoint's names load as they are: `embeddings.*`, `encoder.layer.N.*`, and for
`*ForSequenceClassification` the `bert.` / `roberta.` prefix and the classifier head.

An encoder keeps no KV cache: `is_encoder` tells the runner, which gives it each request's
whole input in one step, with token type ids from the request's pooling fields.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.services.worker.layers.attention import AttentionMetadata
from kvserve.services.worker.layers.bidirectional import EncoderBatch, bidirectional_attention
from kvserve.services.worker.layers.linear import ReplicatedLinear, UnquantizedLinearMethod

# HF's hidden_act names of the activations these checkpoints use, each applied in place:
# every caller hands it a GEMM's fresh output (a new [T, intermediate] tensor per call costs
# page faults: bench/RESULTS.md, issue 50).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": lambda x: torch.ops.aten.gelu_(x),
    "gelu_new": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
    "relu": torch.relu_,
    "silu": lambda x: F.silu(x, inplace=True),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """HF's activation `name`, applied in place (x is overwritten and returned)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class EncoderLinear(ReplicatedLinear):
    """An encoder's linear layer: a float weight on every rank (never quantized: the
    checkpoint's names load into it as they are), multiplied on the path of the CPU GEMM
    plan that worker/cpu_tuning.prepare_gemm measures for every linear layer, as a
    decoder's are; `add` ([T, N]) is summed inside the GEMM where that path can.

    Args:
        input_size, output_size: the weight's [output_size, input_size].
        bias: whether the layer has a bias.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True) -> None:
        super().__init__(input_size, output_size, bias, UnquantizedLinearMethod())

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias, add)


class BertEmbeddings(nn.Module):
    """Word + position + token type embeddings, then LayerNorm."""

    position_offset = 0  # XLM-RoBERTa counts positions from padding_idx + 1

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(
            positions + self.position_offset
        )
        return self.LayerNorm(x + self.token_type_embeddings(token_type_ids))


class XLMRobertaEmbeddings(BertEmbeddings):
    """RoBERTa's positions start after the padding index (HF's
    create_position_ids_from_input_ids, for inputs holding no padding token)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.position_offset = config.pad_token_id + 1


class _SelfAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.query = EncoderLinear(hidden, hidden)
        self.key = EncoderLinear(hidden, hidden)
        self.value = EncoderLinear(hidden, hidden)


class _DenseNorm(nn.Module):
    """HF's BertSelfOutput / BertOutput: dense, then LayerNorm over the residual sum."""

    def __init__(self, config: Any, in_features: int) -> None:
        super().__init__()
        self.dense = EncoderLinear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x, add=residual))


class _Attention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self = _SelfAttention(config)  # HF's name: attention.self.query
        self.output = _DenseNorm(config, config.hidden_size)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        attn: _SelfAttention = self.self
        shape = (x.shape[0], attn.num_heads, attn.head_dim)
        q, k, v = (proj(x).view(shape) for proj in (attn.query, attn.key, attn.value))
        out = bidirectional_attention(q, k, v, batch, attn.head_dim**-0.5)
        return self.output(out, x)


class _Intermediate(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = EncoderLinear(config.hidden_size, config.intermediate_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.attention = _Attention(config)
        self.intermediate = _Intermediate(config)
        self.output = _DenseNorm(config, config.intermediate_size)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        x = self.attention(x, batch)
        return self.output(self.intermediate(x), x)


class _Encoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """The encoder: final hidden states [T, hidden] of the step's flattened tokens.

    Args:
        config: the HF config (BertConfig or XLMRobertaConfig).
    """

    is_encoder = True
    embeddings_class: type[BertEmbeddings] = BertEmbeddings

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.embeddings = self.embeddings_class(config)
        self.encoder = _Encoder(config)
        # The longest input the position table holds (XLM-R's starts past padding_idx).
        self.max_positions = config.max_position_embeddings - self.embeddings.position_offset

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        intermediate_tensors: Any = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        batch = EncoderBatch(attn_metadata.query_start_loc)
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, batch)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named(self, weights, prefixes=("bert.", "roberta.", "model."))


class XLMRobertaModel(BertModel):
    embeddings_class = XLMRobertaEmbeddings


class BertForSequenceClassification(nn.Module):
    """A cross-encoder or classifier: BERT, its pooler (CLS -> dense -> tanh), a linear head.

    The runner pools each request to its CLS row and calls `classify` on it.
    """

    is_encoder = True
    encoder_class: type[BertModel] = BertModel
    encoder_name = "bert"

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.num_labels = config.num_labels
        setattr(self, self.encoder_name, self.encoder_class(config))
        self.make_head(config)

    def make_head(self, config: Any) -> None:
        self.pooler = _Pooler(config)
        self.classifier: nn.Module = EncoderLinear(config.hidden_size, config.num_labels)

    @property
    def encoder_model(self) -> BertModel:
        return getattr(self, self.encoder_name)

    @property
    def max_positions(self) -> int:
        return self.encoder_model.max_positions

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.encoder_model(*args, **kwargs)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] pooled (CLS) rows -> [N, num_labels] logits."""
        return self.classifier(torch.tanh(self.pooler.dense(pooled)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # HF keeps the pooler inside BertModel: bert.pooler.dense -> pooler.dense.
        renamed = ((n.replace("bert.pooler.", "pooler."), w) for n, w in weights)
        load_named(self, renamed, prefixes=())


class _Pooler(nn.Module):
    """HF's BertPooler (its tanh is applied in classify)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = EncoderLinear(config.hidden_size, config.hidden_size)


class _RobertaHead(nn.Module):
    """HF's RobertaClassificationHead: CLS -> dense -> tanh -> out_proj."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = EncoderLinear(config.hidden_size, config.hidden_size)
        self.out_proj = EncoderLinear(config.hidden_size, config.num_labels)


class XLMRobertaForSequenceClassification(BertForSequenceClassification):
    encoder_class = XLMRobertaModel
    encoder_name = "roberta"

    def make_head(self, config: Any) -> None:
        self.classifier = _RobertaHead(config)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        head = cast(_RobertaHead, self.classifier)
        return head.out_proj(torch.tanh(head.dense(pooled)))


def load_named(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], prefixes: tuple[str, ...]
) -> None:
    """Copy HF-named tensors into the parameters of the same name, dropping what an encoder
    does not use (the pooler of an embedding model, a masked-LM head, position id buffers).

    Args:
        model: the module whose names mirror the checkpoint's.
        weights: (name, tensor) pairs.
        prefixes: a wrapper's prefix to strip (a BertModel saved inside another model).

    Raises ValueError when a parameter got nothing.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        for prefix in prefixes:
            if name.startswith(prefix) and name not in params:
                name = name.removeprefix(prefix)
        param = params.get(name)
        if param is None:
            continue  # pooler, lm head, buffers: not part of what this model computes
        if param.shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)}, model {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"{type(model).__name__}: no checkpoint tensor for {missing[:5]}")
