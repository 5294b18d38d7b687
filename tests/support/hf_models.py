"""Tiny random-weight HF models of every supported family beyond Llama/Qwen2 (those are in
tests/support/models.py), to compare our forward against and to save as checkpoints.

Every config is small (hidden 64, 2-3 layers, vocab 128) and sets what makes its family
differ at a size the tests reach: sliding windows of 5-7 tokens and Llama 4's attention chunks
of 6 (prompts are longer), soft caps small enough to bend the scores, a longrope switch at
position 32.
"""

from __future__ import annotations

import torch

from tests.support.models import TINY_HF_DIMS, random_hf_model

VOCAB_SIZE = 128
SLIDING_WINDOW = 6
LLAMA4_CHUNK_SIZE = 6
_COMMON = dict(TINY_HF_DIMS, vocab_size=VOCAB_SIZE, tie_word_embeddings=False)
_GEMMA_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]


def _kinds() -> dict:
    import transformers as tf

    return {
        "mistral": (
            tf.MistralConfig,
            tf.MistralForCausalLM,
            dict(sliding_window=SLIDING_WINDOW - 1, head_dim=16),
        ),
        "qwen3": (
            tf.Qwen3Config,
            tf.Qwen3ForCausalLM,
            dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        ),
        "gemma2": (
            tf.Gemma2Config,
            tf.Gemma2ForCausalLM,
            dict(
                num_hidden_layers=3,
                head_dim=16,
                query_pre_attn_scalar=24,
                sliding_window=SLIDING_WINDOW,
                layer_types=_GEMMA_LAYERS,
                attn_logit_softcapping=2.0,
                final_logit_softcapping=8.0,
                hidden_activation="gelu_pytorch_tanh",
                tie_word_embeddings=True,
            ),
        ),
        "gemma3": (
            tf.Gemma3TextConfig,
            tf.Gemma3ForCausalLM,
            dict(
                num_hidden_layers=3,
                head_dim=16,
                query_pre_attn_scalar=16,
                sliding_window=SLIDING_WINDOW + 1,
                layer_types=_GEMMA_LAYERS,
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
                },
                hidden_activation="gelu_pytorch_tanh",
                tie_word_embeddings=True,
            ),
        ),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(pad_token_id=0)),
        "phi3_longrope": (
            tf.Phi3Config,
            tf.Phi3ForCausalLM,
            dict(
                pad_token_id=0,
                original_max_position_embeddings=32,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "short_factor": [1.0 + 0.1 * i for i in range(8)],
                    "long_factor": [2.0 + 0.5 * i for i in range(8)],
                },
            ),
        ),
        "mixtral": (
            tf.MixtralConfig,
            tf.MixtralForCausalLM,
            dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
        ),
        "qwen3_moe": (
            tf.Qwen3MoeConfig,
            tf.Qwen3MoeForCausalLM,
            dict(
                num_hidden_layers=3,
                head_dim=16,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=48,
                norm_topk_prob=True,
                mlp_only_layers=[1],
            ),
        ),
        # Windows on layers 0 and 2, YaRN scaled 8x from a 16-token original context (its
        # ramp and attention factor both bend the tables), 4 experts of which 2 per token.
        "gpt_oss": (
            tf.GptOssConfig,
            tf.GptOssForCausalLM,
            dict(
                num_hidden_layers=3,
                head_dim=16,
                sliding_window=SLIDING_WINDOW,
                layer_types=_GEMMA_LAYERS,
                num_local_experts=4,
                num_experts_per_tok=2,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 150000.0,
                    "factor": 8.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": False,
                    "original_max_position_embeddings": 16,
                },
            ),
        ),
        # Layer 0: RoPE, chunked local attention, q/k L2 norm, dense MLP; layer 1: NoPE,
        # full attention with the query temperature (floor_scale small enough to change it
        # within the prompts), MoE with a shared expert.
        "llama4": (
            tf.Llama4TextConfig,
            tf.Llama4ForCausalLM,
            dict(
                head_dim=16,
                intermediate_size=48,
                intermediate_size_mlp=96,
                num_local_experts=4,
                num_experts_per_tok=1,
                interleave_moe_layer_step=2,
                no_rope_layers=[1, 0],
                attention_chunk_size=LLAMA4_CHUNK_SIZE,
                use_qk_norm=True,
                attn_temperature_tuning=True,
                floor_scale=4,
                attn_scale=0.5,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 10000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
            ),
        ),
        # V2-Lite's shape: no q compression, yarn with mscale_all_dim, softmax routing within
        # groups, two shared experts.
        "deepseek_v2": (
            tf.DeepseekV2Config,
            tf.DeepseekV2ForCausalLM,
            dict(
                _DEEPSEEK_MLA,
                q_lora_rank=None,
                n_routed_experts=8,
                num_experts_per_tok=2,
                n_shared_experts=2,
                topk_method="group_limited_greedy",
                n_group=2,
                topk_group=1,
                routed_scaling_factor=1.5,
                first_k_dense_replace=0,
                rope_parameters=_deepseek_yarn(0.707),
            ),
        ),
        # V3's shape: q through its own latent, a dense first layer, sigmoid routing with the
        # correction bias (drawn in make_tiny_family_model) in 2 of 4 groups, renormalized.
        "deepseek_v3": (
            tf.DeepseekV3Config,
            tf.DeepseekV3ForCausalLM,
            dict(
                _DEEPSEEK_MLA,
                num_hidden_layers=3,
                q_lora_rank=48,
                n_routed_experts=8,
                num_experts_per_tok=2,
                n_shared_experts=1,
                n_group=4,
                topk_group=2,
                norm_topk_prob=True,
                routed_scaling_factor=2.5,
                first_k_dense_replace=1,
                rope_parameters=_deepseek_yarn(1.0),
            ),
        ),
    }


# Multi-head latent attention at a tiny size: every head's K and V come from a 32-feature
# latent plus an 8-feature rope key; the value dim (16) differs from the q/k dim (24).
_DEEPSEEK_MLA = dict(
    num_key_value_heads=TINY_HF_DIMS["num_attention_heads"],  # MLA has no GQA
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    moe_intermediate_size=32,
)


def _deepseek_yarn(mscale: float) -> dict:
    return {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": mscale,
        "mscale_all_dim": mscale,
        "beta_fast": 32,
        "beta_slow": 1,
    }


KINDS = (
    "mistral",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
    "phi3_longrope",
    "mixtral",
    "qwen3_moe",
    "llama4",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
)


def make_tiny_family_model(kind: str, seed: int = 0, **config_overrides):
    """A tiny HF model of `kind` (one of KINDS) in eval mode with random weights drawn large
    enough for peaked logits (greedy ties cannot flip between our model and HF's)."""
    config_class, model_class, fields = _kinds()[kind]
    norm_mean = 0.0 if kind.startswith("gemma") else 1.0  # Gemma's norms scale by 1 + weight
    model = random_hf_model(
        config_class, model_class, _COMMON | fields | config_overrides, seed, norm_mean
    )
    if kind == "deepseek_v3":  # a buffer, not drawn above: a bias that moves the choice
        generator = torch.Generator().manual_seed(seed)
        for layer in model.model.layers[model.config.first_k_dense_replace :]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(torch.randn(bias.shape, generator=generator) * 0.3)
    return model


# Prompts for the family tests: a 40-token shared prefix, far longer than the sliding windows,
# so a second round is served from the prefix cache and its chunks start mid-sequence.
NUM_TOKENS = 10
_PREFIX = [(7 * i + 3) % VOCAB_SIZE for i in range(40)]
PROMPTS = [_PREFIX + [5, 17, 99], _PREFIX + [8] * 6, _PREFIX[:21]]


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int]) -> list[int]:
    """NUM_TOKENS greedy tokens after prompt, a full HF forward each step."""
    tokens = list(prompt)
    for _ in range(NUM_TOKENS):
        tokens.append(int(hf_model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]
