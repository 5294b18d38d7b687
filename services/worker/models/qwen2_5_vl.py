"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): images in the prompt.

The language model is our Qwen2 decoder (llama.py's `Qwen2ForCausalLM`) with M-RoPE; the
vision encoder is transformers' own module class (`Qwen2_5_VisionTransformerPretrainedModel`),
its weights loaded from the checkpoint. It runs only on the prompts' images, once per image
(the worker's encoder cache keeps its output until the image's tokens are computed), so its
speed matters little next to the decoder's.

M-RoPE: each token has a (temporal, height, width) position; the rotary frequencies are
split into `mrope_section` groups, group i rotating by component i. A text token has three
equal components, so its rotation is plain RoPE at that position; only an image's tokens
differ (same temporal, their row and column in the merged patch grid). The runner therefore
hands the model one position per token, the temporal one (text and decode tokens after an
image sit at index + delta, delta <= 0: Qwen's `mrope_position_deltas`), and, for a step
holding image tokens, all three (`MultimodalInputs.mrope_positions`): that step builds each
token's rotary row from the three components and runs the modules (the native CPU stack and
the CUDA graphs take the plain steps).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvserve.kernels.quant import QuantizedTensor
from kvserve.services.worker.layers.attention import AttentionMetadata
from kvserve.services.worker.models.llama import (
    IntermediateTensors,
    Qwen2ForCausalLM,
    head_dim_of,
)


@dataclass
class MultimodalInputs:
    """A step's image inputs for the model (services/worker/multimodal.py builds them).

    Args:
        embeds: [N, hidden] the vision encoder's outputs for the step's image tokens.
        embed_rows: [N] int64, where in the flattened tokens each of those goes.
        mrope_positions: [3, T] int64 (temporal, height, width) of every token, when some
            token's components differ (None: the step's positions say it all).
    """

    embeds: torch.Tensor | None = None
    embed_rows: torch.Tensor | None = None
    mrope_positions: torch.Tensor | None = None


def mrope_positions(
    prompt_token_ids: list[int], images: list[tuple[int, int, tuple[int, int, int]]], merge: int
) -> tuple[np.ndarray, int]:
    """([3, P] M-RoPE positions of the prompt, delta for every later token), as HF's
    `get_rope_index` for images: text runs advance by one per token; an image at the
    current position p spans t x (h / merge) x (w / merge) tokens at (p + t, p + row,
    p + col) and advances p by max(h, w) / merge.

    Args:
        prompt_token_ids: the prompt (image placeholder tokens included).
        images: (offset, length, (t, h, w) patch grid) per image, in prompt order.
        merge: the vision tower's spatial_merge_size.
    """
    num_tokens = len(prompt_token_ids)
    positions = np.empty((3, num_tokens), dtype=np.int64)
    current = 0
    start = 0
    for offset, length, (t, h, w) in images:
        text = offset - start
        positions[:, start:offset] = current + np.arange(text)
        current += text
        grid_h, grid_w = h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(grid_h), np.arange(grid_w), indexing="ij")
        assert tt.size == length, f"image of {length} tokens has a {t}x{grid_h}x{grid_w} grid"
        positions[0, offset : offset + length] = current + tt.reshape(-1)
        positions[1, offset : offset + length] = current + hh.reshape(-1)
        positions[2, offset : offset + length] = current + ww.reshape(-1)
        current += max(grid_h, grid_w)
        start = offset + length
    positions[:, start:] = current + np.arange(num_tokens - start)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    """Qwen2.5-VL: transformers' vision tower, then our Qwen2 decoder with M-RoPE.

    Args:
        config: the Qwen2_5_VLConfig (text_config for the decoder, vision_config for the
            tower).
    """

    supports_images = True

    def __init__(self, config: Any):
        text_config = config.get_text_config()
        super().__init__(text_config)
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        vision_config = config.vision_config
        vision_config._attn_implementation = "sdpa"
        self.visual = Qwen2_5_VisionTransformerPretrainedModel(vision_config)
        self.spatial_merge_size = int(vision_config.spatial_merge_size)
        self.image_token_id = int(config.image_token_id)
        rope = text_config.rope_parameters or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(
                f"Qwen2.5-VL with rope_type {rope.get('rope_type')!r} is not supported "
                "(M-RoPE runs on the default rotary table)"
            )
        section = list(rope.get("mrope_section") or [16, 24, 24])
        half = head_dim_of(text_config) // 2
        if sum(section) != half:
            raise ValueError(f"mrope_section {section} does not cover head_dim / 2 = {half}")
        # The M-RoPE component of each table column (cos half, then sin half).
        component = torch.tensor([i % 3 for i in range(len(section))]).repeat_interleave(
            torch.tensor(section)
        )
        self.register_buffer("mrope_component", component.repeat(2), persistent=False)

    # -- images --------------------------------------------------------------------------

    def num_image_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // self.spatial_merge_size**2

    def embed_image(self, pixel_values: torch.Tensor, grid_thw: list[int]) -> torch.Tensor:
        """One image's [num tokens, hidden] embeddings from its flattened patches."""
        device = self.lm_head.weight.device if self.lm_head is not None else None
        pixels = pixel_values.to(dtype=self.visual.dtype, device=device)
        grid = torch.tensor([grid_thw], dtype=torch.int64, device=pixels.device)
        return self.visual(pixels, grid_thw=grid).pooler_output

    # -- forward -------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,
        multimodal: MultimodalInputs | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """As LlamaForCausalLM.forward; `multimodal` places the step's image embeddings and
        gives the M-RoPE positions of a step that holds image tokens."""
        if multimodal is None:
            return self.model(input_ids, positions, attn_metadata, intermediate_tensors)
        inputs_embeds = None
        if multimodal.embeds is not None and self.model.embed_tokens is not None:
            inputs_embeds = self.model.embed_tokens(input_ids)
            inputs_embeds[multimodal.embed_rows] = multimodal.embeds.to(inputs_embeds.dtype)
        if multimodal.mrope_positions is None:
            return self.model(
                input_ids,
                positions,
                attn_metadata,
                intermediate_tensors,
                inputs_embeds=inputs_embeds,
            )
        return self._forward_mrope(
            input_ids,
            multimodal.mrope_positions,
            attn_metadata,
            intermediate_tensors,
            inputs_embeds,
        )

    def _forward_mrope(
        self,
        input_ids: torch.Tensor,
        mrope_positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None,
        inputs_embeds: torch.Tensor | None,
    ) -> torch.Tensor | IntermediateTensors:
        """The modules' forward with each token's rotary row built from its three
        components: the step's rows are swapped into every layer's table, and the tokens
        read them at 0 .. T - 1."""
        inner = self.model
        layers: list[Any] = [
            layer.self_attn.rotary_emb  # type: ignore[union-attr]
            for layer in inner.layers[inner.start_layer : inner.end_layer]
        ]
        tables: list[torch.Tensor] = [rotary.cos_sin_cache for rotary in layers]
        base = tables[0]
        # rows[c, i] = base[mrope_positions[c, i]]; column j keeps component mrope_component[j]
        rows = base[mrope_positions]  # [3, T, D]
        component: Any = self.mrope_component
        index = component.view(1, 1, -1).expand(1, rows.shape[1], -1)
        step_table = rows.gather(0, index).squeeze(0).contiguous()
        order = torch.arange(step_table.shape[0], device=step_table.device)
        stack, inner.decode_stack = inner.decode_stack, None
        try:
            for rotary in layers:
                rotary.cos_sin_cache = step_table
            return inner(
                input_ids, order, attn_metadata, intermediate_tensors, inputs_embeds=inputs_embeds
            )
        finally:
            inner.decode_stack = stack
            for rotary, table in zip(layers, tables):
                rotary.cos_sin_cache = table

    # -- loading -------------------------------------------------------------------------

    def _on_this_stage(self, name: str) -> bool:
        return name.startswith("visual.") or super()._on_this_stage(name)

    def map_checkpoint_name(self, name: str) -> tuple[str, object]:
        if name.startswith("visual."):  # transformers' module: its own names, unfused
            return name, None
        return super().map_checkpoint_name(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        """Checkpoint names of both layouts: `visual.*` / `model.layers.*` (the released
        checkpoints) and `model.visual.*` / `model.language_model.*` (transformers 5)."""

        def renamed() -> Iterable[tuple[str, torch.Tensor | QuantizedTensor]]:
            for name, tensor in weights:
                if name.startswith("model.visual."):
                    name = name.removeprefix("model.")
                elif name.startswith("model.language_model."):
                    name = "model." + name.removeprefix("model.language_model.")
                yield name, tensor

        super().load_weights(renamed())
