"""KV-cache bytes of DeepSeek's latent cache against the same model's full K and V.

Builds DeepSeek-V2-Lite- and V3-shaped models on the meta device (no weights, no memory) with
the shipped model classes, and asks the shipped sizing function
(`layers/attention.kv_cache_bytes_per_block`, what `Worker.determine_num_blocks` divides the
budget by) for the bytes of one block over every layer. The full-KV equivalent is the same
model caching K (qk_nope + qk_rope) and V (v_head_dim) for every head, as an MLA model served
without the latent cache would. Then the blocks of a 4 GiB budget (budget // block bytes, as
the worker computes them; block 0 is the null block) and how many 4,096-token sequences fit.

    .venv/bin/python bench/mla_kv_bytes.py [--dtype bfloat16] [--budget-gib 4] [--tokens 4096]
"""

from __future__ import annotations

import argparse

import torch

from kvserve.services.worker.layers.attention import (
    Attention,
    KVCacheSpec,
    kv_cache_bytes_per_block,
)
from kvserve.services.worker.models.deepseek_v2 import (
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
)

BLOCK_SIZE = 16


def _configs() -> dict:
    import transformers as tf

    v2_lite = tf.DeepseekV2Config(  # deepseek-ai/DeepSeek-V2-Lite's config.json
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_shared_experts=2,
        n_routed_experts=64,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_position_embeddings=163840,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )
    v3 = tf.DeepseekV3Config()  # its defaults are DeepSeek-V3's (61 layers, 128 heads)
    return {
        "DeepseekV2ForCausalLM (V2-Lite shape)": (DeepseekV2ForCausalLM, v2_lite),
        "DeepseekV3ForCausalLM (V3 / R1 shape)": (DeepseekV3ForCausalLM, v3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--budget-gib", type=float, default=4.0)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    budget = int(args.budget_gib * 2**30)
    blocks_per_sequence = -(-args.tokens // BLOCK_SIZE)
    print(
        f"dtype {args.dtype}, block {BLOCK_SIZE} tokens, budget {args.budget_gib:g} GiB, "
        f"sequences of {args.tokens} tokens ({blocks_per_sequence} blocks each)"
    )
    header = "| model | layers | KV bytes / token | blocks in budget | sequences that fit |"
    for name, (model_class, config) in _configs().items():
        with torch.device("meta"):
            model = model_class(config)
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        latent = kv_cache_bytes_per_block(layers, BLOCK_SIZE, dtype)
        full_spec = KVCacheSpec(  # K | V of every head in one plane: (Dn + R + Dv) per head
            1,
            config.num_attention_heads,
            config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim,
        )
        full = len(layers) * full_spec.block_bytes(BLOCK_SIZE, dtype)
        print(f"\n{name}: spec per layer {layers[0].kv_cache_spec()}")
        print(header)
        print("|---|---:|---:|---:|---:|")
        for label, per_block in (("latent (MLA cache)", latent), ("full K and V", full)):
            num_blocks = budget // per_block  # Worker.determine_num_blocks
            fits = (num_blocks - 1) // blocks_per_sequence  # block 0 is the null block
            print(
                f"| {label} | {len(layers)} | {per_block // BLOCK_SIZE:,} | {num_blocks:,} "
                f"| {fits:,} |"
            )
        print(f"full / latent: {full / latent:.1f}x")


if __name__ == "__main__":
    main()
