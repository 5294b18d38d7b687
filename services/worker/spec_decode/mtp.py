"""DeepSeek-V3's multi-token-prediction (MTP) layer, run as the drafter (vLLM's deepseek_mtp).

A checkpoint whose config has `num_nextn_predict_layers` = n >= 1 holds, after its L =
num_hidden_layers decoder layers, n MTP layers under `model.layers.{L + i}.*`. The first one
(later ones are not run, as in vLLM's V1) computes, for the pair (h_p, x_{p+1}) at position p:

    e   = enorm(embed(x_{p+1}))                the target's embedding, shared
    z   = eh_proj([e | hnorm(h_p)])            Linear(2H, H), no bias
    g_p = block(z) at RoPE position p          a whole DeepSeek decoder layer (MLA attention
                                               over its own latent cache, MoE): its output
                                               sum, residual + MLP
    guess x_{p+2} = argmax shared_head.head(shared_head.norm(g_p))

h_p is the target's final hidden state (after its final norm: what its LM head reads), as
EAGLE-1's f_p is; for k > 1 drafts the one layer runs again with g_p in h's place, one
position on. So the EAGLE proposer (eagle_proposer.py) runs it unchanged: the catch-up over
each step's verified pairs, the lookahead slots, the greedy chain. vLLM also zeroes the
token embedding at position 0; here it is not (DeepSeek-V3's report defines no such mask):
that changes guesses only, never output.

Checkpoint names, under `model.layers.{L}.`: `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`,
`shared_head.head` (the layer's LM head: loaded, as vLLM does), `embed_tokens` (a copy of the
target's: checked for shape, not loaded), and the decoder layer's own names (`self_attn.*`,
`mlp.*`, the two norms), loaded by the target's rules (fused experts and gate/up). The target's
loader skips these layers (deepseek_v2.py); `load_mtp_head` reads only them from the same
files (their headers say which hold them), through the same quantization path as the target's
weights. A checkpoint without them fails at start-up, saying so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from kvserve.kernels.quant import QuantizedTensor
from kvserve.services.worker.layers.attention import AttentionMetadata
from kvserve.services.worker.layers.embed_head import ParallelLMHead
from kvserve.services.worker.layers.layernorm import RMSNorm
from kvserve.services.worker.layers.linear import ReplicatedLinear, default_weight_loader
from kvserve.services.worker.models import _default_dtype
from kvserve.services.worker.models.deepseek_v2 import DeepseekV2ForCausalLM
from kvserve.services.worker.models.llama import LlamaDecoderLayer
from kvserve.services.worker.spec_decode.checkpoint import read_tensors_named, tensor_names_under
from kvserve.services.worker.spec_decode.eagle_proposer import DraftHead, rows_of

# The MTP layer's own modules; every other name of the layer is its decoder block's.
_OWN_MODULES = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


class SharedHead(nn.Module):
    """The layer's output norm and LM head (DeepSeek's `shared_head`)."""

    def __init__(self, config: Any):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size)


class MtpHead(nn.Module):
    """One MTP layer over the paged KV cache (see the module docstring).

    Args:
        config: the target's HF config.
        target_model: the target (a DeepseekV2ForCausalLM or subclass), whose embedding the
            layer reads (not a submodule) and whose class builds the decoder block.
    """

    def __init__(self, config: Any, target_model: DeepseekV2ForCausalLM):
        super().__init__()
        self.config = config
        self.layer_index = int(config.num_hidden_layers)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        # A method, not a submodule: not registered, not loaded.
        self.embed_tokens = target_model.get_submodule("model.embed_tokens").forward
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, bias=False)
        # Index L: past first_k_dense_replace, so a MoE layer, as the checkpoint's is.
        self.mtp_block = LlamaDecoderLayer(config, self.layer_index, type(target_model))
        self.shared_head = SharedHead(config)
        self.map_checkpoint_name = target_model.map_checkpoint_name

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids [T] (x_{p+1}), features [T, H] (h_p, or the layer's own g), positions
        [T] (p). Returns g [T, H]; `guess(g)` guesses x_{p+2}."""
        embeds = self.enorm(self.embed_tokens(input_ids).to(features.dtype))
        z = self.eh_proj(torch.cat([embeds, self.hnorm(features)], dim=-1))
        hidden_states, residual = self.mtp_block(positions, z, None, attn_metadata)
        return hidden_states + residual

    def guess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N] greedy guesses over the full vocabulary (every TP rank: the head
        gathers its vocabulary slices)."""
        logits = self.shared_head.head(self.shared_head.norm(hidden_states))
        return logits.argmax(dim=-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        """Copy the layer's tensors, named without their `model.layers.{L}.` prefix, into the
        (fused, TP-sliced) parameters; ValueError on an unknown name, a missing parameter or
        an embedding of another shape."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "embed_tokens.weight":
                expected = (self.config.vocab_size, self.config.hidden_size)
                if tuple(tensor.shape) != expected:
                    raise ValueError(
                        f"embed_tokens.weight is {tuple(tensor.shape)}, the target's {expected}"
                    )
                continue  # the target's embedding is used
            if not name.startswith(_OWN_MODULES):
                name = "mtp_block." + name
            param_name, shard_id = self.map_checkpoint_name(name)
            param = params.get(param_name)
            if param is None:
                raise ValueError(f"tensor {name!r} matches no parameter of the MTP layer")
            loader: Callable[..., None] = getattr(param, "weight_loader", default_weight_loader)
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
            loaded.add(param_name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"it lacks {len(missing)} parameters, e.g. {missing[:3]}")


def check_mtp_target(model_dir: str, target_model: nn.Module) -> DeepseekV2ForCausalLM:
    """The target, when it has MTP layers; ValueError when it has none (another family, or
    num_nextn_predict_layers 0)."""
    config: Any = getattr(target_model, "config", None)
    num_layers = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if not isinstance(target_model, DeepseekV2ForCausalLM) or num_layers < 1:
        raise ValueError(
            f"mtp speculation runs a checkpoint's own multi-token-prediction layers (a "
            f"DeepSeek-V3-style config with num_nextn_predict_layers >= 1); {model_dir} "
            f"({type(target_model).__name__}, num_nextn_predict_layers={num_layers}) has none"
        )
    return target_model


def load_mtp_head(
    model_dir: str,
    target_model: nn.Module,
    dtype: torch.dtype,
    device: torch.device | str,
    quantization: str | None = None,
) -> DraftHead:
    """The target checkpoint's first MTP layer, in dtype on device, as a draft head.

    Args:
        model_dir: the target's checkpoint folder.
        target_model: the loaded target.
        quantization: the target's --quantization (its weights are read alike).
    """
    from kvserve.services.worker import quantization as quant

    target = check_mtp_target(model_dir, target_model)
    if quantization == "gguf":
        raise ValueError("mtp speculation does not run with --quantization gguf")
    config: Any = target.config
    prefix = f"model.layers.{config.num_hidden_layers}."
    names = tensor_names_under(model_dir, prefix)
    if not names:
        raise ValueError(
            f"{model_dir}: config.json names {config.num_nextn_predict_layers} "
            f"multi-token-prediction layer(s), but its *.safetensors hold no {prefix}* "
            "tensors (a checkpoint saved without them?): mtp speculation needs them"
        )
    method, _ = quant.resolve_quantization(quantization, None, model_dir)
    with _default_dtype(dtype), torch.device(device):
        head = quant.build_quantized(lambda c: MtpHead(c, target), config, method)
    weights = quant.quantized_weights(method, None, read_tensors_named(names), model_dir)
    try:
        head.load_weights((name.removeprefix(prefix), t) for name, t in weights)
    except ValueError as exc:
        raise ValueError(f"{model_dir}: the MTP layer {prefix}*: {exc}") from None
    quant.finish_loading(head)
    return DraftHead(head.eval(), head.guess, rows_of, f"{model_dir} ({prefix}*)")
