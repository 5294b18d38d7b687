"""Tiny random-weight HF models of every supported family beyond Llama/Qwen2 (those are in
tests/support/models.py), to compare our forward against and to save as checkpoints.

Every config is small (hidden 64, 2-3 layers, vocab 128) and sets what makes its family
differ at a size the tests reach: sliding windows of 5-7 tokens (prompts are longer), soft
caps small enough to bend the scores, a longrope switch at position 32.
"""

from __future__ import annotations

import torch

from tests.support.models import TINY_HF_DIMS, random_hf_model

VOCAB_SIZE = 128
SLIDING_WINDOW = 6
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
    "gpt_oss",
)


def make_tiny_family_model(kind: str, seed: int = 0, **config_overrides):
    """A tiny HF model of `kind` (one of KINDS) in eval mode with random weights drawn large
    enough for peaked logits (greedy ties cannot flip between our model and HF's)."""
    config_class, model_class, fields = _kinds()[kind]
    norm_mean = 0.0 if kind.startswith("gemma") else 1.0  # Gemma's norms scale by 1 + weight
    return random_hf_model(
        config_class, model_class, _COMMON | fields | config_overrides, seed, norm_mean
    )


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
