"""A tiny gpt-oss checkpoint with its experts in the published MXFP4 layout, and the HF model
that computes the same numbers (its experts set to transformers' own dequantization).

The published gpt-oss checkpoints store each layer's experts as
`mlp.experts.gate_up_proj_blocks` [E, 2I, H/32, 16] + `gate_up_proj_scales` [E, 2I, H/32]
and `down_proj_blocks` [E, H, I/32, 16] + `down_proj_scales` [E, H, I/32] (uint8: e2m1
nibble pairs, e8m0 exponents), biases in float, and config.json says
`quantization_config: {"quant_method": "mxfp4", ...}`. This writes that from a random model.
"""

from __future__ import annotations

import json
import os

import torch

from kvserve.kernels.quant import quantize_mxfp4
from tests.support.hf_models import make_tiny_family_model

# Hidden 64 and intermediate 128: 32-blocks along both experts' inputs, and along each TP=2
# rank's half of the intermediate dim.
MXFP4_DIMS = dict(intermediate_size=128)


def save_mxfp4_checkpoint(hf_model, model_dir: str) -> None:
    """save_pretrained, then the experts rewritten as MXFP4 blocks + scales, in place: the
    HF model's expert weights become their dequantization (transformers'
    `convert_moe_packed_tensors`), so it computes what the checkpoint holds."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf_model.save_pretrained(model_dir)
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    params = dict(hf_model.named_parameters())
    for name in [n for n in tensors if n.endswith((".gate_up_proj", ".down_proj"))]:
        weight = tensors.pop(name)  # [E, in, out], HF's layout
        blocks, scales = quantize_mxfp4(weight.transpose(1, 2))  # [E, out, in/32, ...]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        dequantized = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        with torch.no_grad():
            params[name].copy_(dequantized)
    save_file(tensors, path, metadata={"format": "pt"})
    config_path = os.path.join(model_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def make_mxfp4_gpt_oss(model_dir: str, seed: int = 0, **config_overrides):
    """A tiny random gpt-oss saved with MXFP4 experts in model_dir; returns the HF model
    whose experts hold the dequantized values."""
    hf_model = make_tiny_family_model("gpt_oss", seed, **(MXFP4_DIMS | config_overrides))
    save_mxfp4_checkpoint(hf_model, model_dir)
    return hf_model
