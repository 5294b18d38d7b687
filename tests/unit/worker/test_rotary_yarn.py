"""YaRN RoPE tables against transformers' `_compute_yarn_parameters` (gpt-oss, DeepSeek)."""

from __future__ import annotations

import pytest
import torch

from kvserve.services.worker.layers.rotary_embedding import get_rope, rope_parameters_from_config


@pytest.mark.parametrize(
    "rope",
    [
        # gpt-oss's published settings (truncate off).
        dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
             original_max_position_embeddings=4096),
        # mscale / mscale_all_dim (DeepSeek-style), truncated correction range.
        dict(factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.707,
             original_max_position_embeddings=4096),
        dict(factor=4.0, original_max_position_embeddings=64, attention_factor=1.3),
    ],
)  # fmt: skip
def test_yarn_tables_equal_transformers(rope):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, max_position = 64, 512
    config = GptOssConfig(
        head_dim=head_dim,
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=max_position,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, **rope},
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    expected = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor
    ours = get_rope(head_dim, max_position, rope_parameters_from_config(config))
    torch.testing.assert_close(ours.cos_sin_cache, expected, atol=1e-5, rtol=0)
    assert attention_factor != 1.0  # the scaling is part of what is compared
