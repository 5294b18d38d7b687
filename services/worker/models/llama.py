"""The Llama decoder, with the switches the other dense families flip (see `LlamaForCausalLM`).

Llama 2/3 (rope scaling `llama3`), SmolLM2, TinyLlama, Mistral (sliding window) and Qwen2 (qkv
bias) are this file; qwen3.py, gemma2.py, gemma3.py, phi3.py and mixtral.py are subclasses that
override a few class attributes or hooks.

Checkpoint names are HF's; q/k/v and gate/up are fused on load (`packed_modules_mapping`).
With pipeline parallelism each stage builds only its slice of the layers (the others are
parameter-free placeholders, so layer indices stay global), the first stage the embedding,
the last the final norm and LM head; checkpoint tensors of other stages are skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar, cast

import torch
from torch import nn

from kvserve.kernels.decode_stack import DecodeStack
from kvserve.kernels.quant import QuantizedTensor
from kvserve.services.worker.layers.activation import get_act_and_mul
from kvserve.services.worker.layers.attention import Attention, AttentionMetadata
from kvserve.services.worker.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from kvserve.services.worker.layers.layernorm import RMSNorm
from kvserve.services.worker.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
    divide,
)
from kvserve.services.worker.layers.rotary_embedding import get_rope, rope_parameters_from_config
from kvserve.services.worker.parallel_state import (
    get_pp_rank,
    get_pp_size,
    get_tp_size,
    is_first_pp_rank,
    is_last_pp_rank,
    pp_layer_range,
)

# What one pipeline stage hands the next: (hidden_states, residual), both [T, hidden].
IntermediateTensors = tuple[torch.Tensor, torch.Tensor]


class PPMissingLayer(nn.Identity):
    """Stands in for a layer that lives on another pipeline stage (no parameters)."""


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """Self-attention: fused qkv, [per-head q/k norm], RoPE on q and k, paged attention, o_proj.

    Args:
        config: the HF model config.
        layer_idx: this layer's global index (windows and RoPE may vary by layer).
        arch: the model class, whose hooks say what this family changes.
    """

    def __init__(self, config: Any, layer_idx: int, arch: type[LlamaForCausalLM]):
        super().__init__()
        tp_size = get_tp_size()
        total_num_heads = config.num_attention_heads
        total_num_kv_heads = getattr(config, "num_key_value_heads", None) or total_num_heads
        head_dim = head_dim_of(config)
        num_heads = divide(total_num_heads, tp_size)
        num_kv_heads = divide(total_num_kv_heads, tp_size)
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        qkv_bias, o_bias = arch.attention_biases(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, total_num_heads, total_num_kv_heads, bias=qkv_bias
        )
        self.o_proj = RowParallelLinear(total_num_heads * head_dim, config.hidden_size, bias=o_bias)
        self.q_norm = arch.make_qk_norm(config, layer_idx, head_dim)
        self.k_norm = arch.make_qk_norm(config, layer_idx, head_dim)
        rope_parameters = arch.rope_parameters(config, layer_idx)
        # None on a layer without positions in its attention (Llama 4's NoPE layers).
        self.rotary_emb = (
            get_rope(head_dim, config.max_position_embeddings, rope_parameters)
            if rope_parameters is not None
            else None
        )
        self.query_scale = arch.query_scale(config, layer_idx)
        self.attn = Attention(
            num_heads,
            head_dim,
            arch.attention_scale(config),
            num_kv_heads,
            sliding_window=arch.sliding_window(config, layer_idx),
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
            attention_chunk_size=arch.attention_chunk_size(config, layer_idx),
            sinks=arch.attention_sinks(config),
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        attn_metadata: AttentionMetadata,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention block's output; with `residual`, residual + that output, the add
        inside the output GEMM where `adds_residual` says."""
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:  # per head: [T * H, D] rows
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        if self.query_scale is not None:  # a factor per token, from its position
            q = (q * self.query_scale(positions)[:, None]).to(q.dtype)
        # RoPE is the attention layer's first step: fused there with the KV-cache write.
        out = self.attn(q, k, v, attn_metadata, rotary=self.rotary_emb, positions=positions)
        return self.o_proj(out) if residual is None else self.o_proj(out, residual)

    def adds_residual(self, hidden_states: torch.Tensor) -> bool:
        """Whether forward(..., residual) adds the residual inside the output GEMM (a plain
        output projection on one rank, on a GEMM path with the add fused; not under LoRA,
        whose wrapper adds its delta to the projection's output)."""
        o_proj = self.o_proj
        return isinstance(o_proj, RowParallelLinear) and o_proj.adds_residual(hidden_states)


class LlamaMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul.

    Args:
        config: the HF model config (`hidden_activation` or `hidden_act`: silu or gelu;
            mlp_bias optional).
        intermediate_size: the MLP width, if not config.intermediate_size.
    """

    def __init__(self, config: Any, intermediate_size: int | None = None):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias)
        self.act_fn = get_act_and_mul(
            getattr(config, "hidden_activation", None) or config.hidden_act
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)), residual adds fused in norms.

    With `arch.sandwich_norms` (Gemma 2/3) the attention and MLP outputs are normed too,
    before their residual adds: x + norm(attn(norm(x))), then + norm(mlp(norm(.))).
    """

    def __init__(self, config: Any, layer_idx: int, arch: type[LlamaForCausalLM]):
        super().__init__()
        # A family's own attention (deepseek_v2.py's latent attention) has LlamaAttention's
        # forward and adds_residual; native_decode.py checks the type before it reads more.
        self.self_attn = cast(LlamaAttention, arch.make_attention(config, layer_idx))
        self.mlp = arch.make_mlp(config, layer_idx)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        # Any norm module with RMSNorm's calling convention (EAGLE's first layer has none).
        self.input_layernorm: nn.Module = arch.norm_class(hidden, eps)
        self.post_attention_layernorm = arch.norm_class(hidden, eps)
        self.sandwich_norms = arch.sandwich_norms
        if arch.sandwich_norms:
            self.pre_feedforward_layernorm = arch.norm_class(hidden, eps)
            self.post_feedforward_layernorm = arch.norm_class(hidden, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream travels beside the hidden states so each norm fuses its add.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if not self.sandwich_norms and self.self_attn.adds_residual(hidden_states):
            # The output GEMM adds the residual: the norm has no add left to fuse.
            residual = self.self_attn(positions, hidden_states, attn_metadata, residual)
            return self.mlp(self.post_attention_layernorm(residual)), residual
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
        if not self.sandwich_norms:
            hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
            return self.mlp(hidden_states), residual
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm: token ids -> hidden states.

    On a pipeline stage: the embedding only on the first stage, layers
    [start_layer, end_layer) only, the final norm only on the last stage.
    """

    def __init__(self, config: Any, arch: type[LlamaForCausalLM]):
        super().__init__()
        num_layers = config.num_hidden_layers
        self.start_layer, self.end_layer = pp_layer_range(num_layers, get_pp_rank(), get_pp_size())
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size)
            if is_first_pp_rank()
            else None
        )
        self.embed_scale = arch.embedding_scale(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, arch)
            if self.start_layer <= i < self.end_layer
            else PPMissingLayer()
            for i in range(num_layers)
        )
        self.norm = (
            arch.norm_class(config.hidden_size, config.rms_norm_eps) if is_last_pp_rank() else None
        )
        # Steps of few requests and tokens (decodes, verify steps, short prefill chunks) run
        # the stage's layers in one C call (models/native_decode.py binds it on the CPU once
        # the KV cache is bound).
        self.decode_stack: DecodeStack | None = None
        # EAGLE-3 (spec_decode/eagle3.py) reads the residual stream entering these layers
        # (an index of num_layers: the last layer's output): each step writes them side by
        # side into the first rows of aux_hidden_states [tokens, len(ids) * hidden], a
        # buffer kept across steps (so a CUDA graph's replay writes it too). The native
        # decode stack then runs the layers between them, one call per run.
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.aux_hidden_states: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,
        num_layers: int | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """The final hidden states on the last stage; (hidden, residual) on the others.

        The first stage embeds input_ids; later stages start from the previous stage's
        intermediate_tensors instead. num_layers runs only the first layers, then the final
        norm (a self-draft for speculative decoding, on a model without pipeline stages).
        inputs_embeds replaces the embedding's output (a VLM's image tokens placed in it).
        """
        if inputs_embeds is not None:
            hidden_states, residual = inputs_embeds, None
        elif self.embed_tokens is not None:
            hidden_states, residual = self.embed_tokens(input_ids), None
            if self.embed_scale is not None:  # rounded to the model dtype, as HF does
                hidden_states = hidden_states * torch.tensor(
                    self.embed_scale, dtype=hidden_states.dtype
                )
        else:
            assert intermediate_tensors is not None, "a later stage needs the previous one's"
            hidden_states, residual = intermediate_tensors
        end_layer = self.end_layer if num_layers is None else min(num_layers, self.end_layer)
        stack = self.decode_stack
        if stack is not None and not (
            end_layer == self.end_layer
            and stack.takes(hidden_states.shape[0], attn_metadata.seq_lens.shape[0])
        ):
            stack = None
        if self.aux_hidden_state_layers:
            hidden_states, residual = self._run_keeping_aux(
                positions, hidden_states, residual, attn_metadata, end_layer, stack
            )
        else:
            hidden_states, residual = self._run_layers(
                (self.start_layer, end_layer), positions, hidden_states, residual, attn_metadata,
                stack,
            )  # fmt: skip
        if self.norm is None:
            assert residual is not None  # every stage runs at least one layer (pp_layer_range)
            return hidden_states, residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def _run_layers(
        self,
        layer_range: tuple[int, int],
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
        stack: DecodeStack | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layers [first, last): on the native stack when it takes the step, else the
        modules one by one."""
        first, last = layer_range
        if stack is None:
            for layer in self.layers[first:last]:
                hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
            return hidden_states, residual
        multi = attn_metadata.max_query_len > 1  # a verify step or a short prefill chunk
        return stack.run(
            hidden_states,
            residual,
            positions,
            attn_metadata.slot_mapping,
            attn_metadata.block_table,
            attn_metadata.seq_lens,
            attn_metadata.query_start_loc if multi else None,
            (first - self.start_layer, last - self.start_layer),
        )

    def _run_keeping_aux(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
        end_layer: int,
        stack: DecodeStack | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers in runs cut at the aux layers, each one's input stream (hidden +
        residual) kept at its cut."""
        ids = self.aux_hidden_state_layers
        num_tokens, hidden = hidden_states.shape
        buffer = self.aux_hidden_states
        if buffer is None or buffer.shape[0] < num_tokens:
            buffer = hidden_states.new_empty(num_tokens, len(ids) * hidden)
            self.aux_hidden_states = buffer
        first = self.start_layer
        for cut in sorted({i for i in ids if first <= i <= end_layer}):
            if cut > first:
                hidden_states, residual = self._run_layers(
                    (first, cut), positions, hidden_states, residual, attn_metadata, stack
                )
                first = cut
            stream = hidden_states if residual is None else hidden_states + residual
            for slot in (s for s, layer_id in enumerate(ids) if layer_id == cut):
                buffer[:num_tokens, slot * hidden : (slot + 1) * hidden].copy_(stream)
        if end_layer > first:
            hidden_states, residual = self._run_layers(
                (first, end_layer), positions, hidden_states, residual, attn_metadata, stack
            )
        return hidden_states, residual


class LlamaForCausalLM(nn.Module):
    """Causal LM over flattened tokens of many requests.

    A family that differs from Llama subclasses this and overrides the class attributes and
    hooks below; each layer reads them through `arch`, the model's class.

    Args:
        config: the HF model config (LlamaConfig or compatible).
    """

    # checkpoint sub-name -> (our fused parameter's sub-name, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, object]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # The norm of every layer norm (GemmaRMSNorm scales by 1 + weight).
    norm_class: ClassVar[type[RMSNorm]] = RMSNorm
    # Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
    qk_norm: ClassVar[bool] = False
    # Norms after attention and around the MLP too (Gemma 2/3; see LlamaDecoderLayer).
    sandwich_norms: ClassVar[bool] = False

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, type(self))
        self.lm_head = (
            ParallelLMHead(config.vocab_size, config.hidden_size) if is_last_pp_rank() else None
        )
        self.final_logit_softcap = getattr(config, "final_logit_softcapping", None)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if (
            self.tie_word_embeddings
            and self.lm_head is not None
            and self.model.embed_tokens is not None
        ):
            self.lm_head.weight = self.model.embed_tokens.weight

    # -- hooks: what a family may change --------------------------------------------------

    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        """(qkv_proj has bias, o_proj has bias): Llama's `attention_bias` covers both."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    @staticmethod
    def attention_sinks(config: Any) -> bool:
        """Whether each attention layer has a learned sink logit per head (gpt-oss)."""
        return False

    @staticmethod
    def attention_scale(config: Any) -> float:
        """The softmax scale: head_dim ** -0.5."""
        return head_dim_of(config) ** -0.5

    @staticmethod
    def sliding_window(config: Any, layer_idx: int) -> int | None:
        """The layer's window: config.sliding_window on the layers `layer_types` marks
        sliding_attention (on all layers when the config has no layer_types), else None."""
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if window is None or (layer_types and layer_types[layer_idx] != "sliding_attention"):
            return None
        return int(window)

    @staticmethod
    def rope_parameters(config: Any, layer_idx: int) -> dict | None:
        """The layer's RoPE settings (see rope_parameters_from_config); None: the layer has
        no RoPE (Llama 4's NoPE layers)."""
        return rope_parameters_from_config(config)

    @staticmethod
    def attention_chunk_size(config: Any, layer_idx: int) -> int | None:
        """The layer's chunked local attention (a token sees only its own chunk of this
        many positions: Llama 4), or None."""
        return None

    @classmethod
    def make_qk_norm(cls, config: Any, layer_idx: int, head_dim: int) -> nn.Module | None:
        """The per-head norm of q (and, a second one, of k) before RoPE, or None: a
        `norm_class` where `qk_norm` (Qwen3, Gemma 3)."""
        return cls.norm_class(head_dim, config.rms_norm_eps) if cls.qk_norm else None

    @staticmethod
    def query_scale(config: Any, layer_idx: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A function of the tokens' positions [T] giving a factor [T] (float32) each
        token's query is multiplied by before attention (Llama 4's attention temperature on
        NoPE layers), or None."""
        return None

    @staticmethod
    def embedding_scale(config: Any) -> float | None:
        """A factor the embeddings are multiplied by (Gemma: sqrt(hidden_size)), or None."""
        return None

    @staticmethod
    def make_mlp(config: Any, layer_idx: int) -> nn.Module:
        """The layer's feed-forward block (mixtral.py returns a mixture of experts)."""
        return LlamaMLP(config)

    @classmethod
    def make_attention(cls, config: Any, layer_idx: int) -> nn.Module:
        """The layer's attention block: LlamaAttention, or a module with its forward and
        `adds_residual` (deepseek_v2.py returns multi-head latent attention)."""
        return LlamaAttention(config, layer_idx, cls)

    # -- forward ----------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions: [T] int64. Returns the final hidden states [T, hidden]
        (last pipeline stage) or (hidden_states, residual) for the next stage."""
        return self.model(input_ids, positions, attn_metadata, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [N, hidden], only the rows to sample. Returns [N, vocab] float32
        (on every TP rank: the vocab slices are all-gathered). Last pipeline stage only."""
        assert self.lm_head is not None, "only the last pipeline stage has the LM head"
        logits = self.lm_head(hidden_states).float()
        if self.final_logit_softcap:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    # -- loading ----------------------------------------------------------------------------

    def _on_this_stage(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to a module this pipeline stage holds."""
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            return self.model.start_layer <= index < self.model.end_layer
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is not None
        if name.startswith("model.norm."):
            return self.model.norm is not None
        if name.startswith("lm_head."):
            return self.lm_head is not None
        return True

    def map_checkpoint_name(self, name: str) -> tuple[str, object]:
        """(our parameter's name, shard id or None) of checkpoint tensor `name`."""
        for src, (dst, shard_id) in self.packed_modules_mapping.items():
            if f".{src}." in name:
                return name.replace(f".{src}.", f".{dst}."), shard_id
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        """Copy HF-named checkpoint tensors into the (fused, TP-sliced) parameters (GGUF
        blocks, under --quantization gguf, stay QuantizedTensors).

        Raises ValueError on a name the model does not know, or when a parameter got nothing.
        """
        params = dict(self.named_parameters())
        loaded_names = set()
        for name, loaded_weight in weights:
            if "rotary_emb.inv_freq" in name:  # recomputed, never loaded
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            if (
                self.tie_word_embeddings
                and name == "model.embed_tokens.weight"
                and self.model.embed_tokens is None
                and self.lm_head is not None
            ):
                name = "lm_head.weight"  # a last stage without the embedding it is tied to
            if not self._on_this_stage(name):
                continue
            param_name, shard_id = self.map_checkpoint_name(name)
            param = params.get(param_name)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} matches no parameter of "
                    f"{type(self).__name__}: is this the right architecture?"
                )
            loader: Callable[..., None] = getattr(param, "weight_loader", default_weight_loader)
            if shard_id is None:
                loader(param, loaded_weight)
            else:
                loader(param, loaded_weight, shard_id)
            loaded_names.add(param_name)
        missing = sorted(set(params) - loaded_names)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the Llama block with a bias on q/k/v (never on o_proj)."""

    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        return True, False
