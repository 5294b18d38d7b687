"""New model families through the whole serving stack: `kvserve serve` processes, HTTP and the
official openai client; greedy tokens equal HF transformers' (tiny random weights, float32).

Gemma 2 brings sliding windows, soft caps and its norms; Mixtral the fused expert path. The
prompts are longer than the windows, and the second round is served from the prefix cache.
"""

from __future__ import annotations

import openai
import pytest

from tests.support.hf_models import NUM_TOKENS, PROMPTS, hf_greedy, make_tiny_family_model
from tests.support.server import serving

pytestmark = pytest.mark.slow


def _token_ids(choice) -> list[int]:
    # --return-tokens-as-token-ids: each logprobs token reads "token_id:N".
    return [int(token.split(":")[1]) for token in choice.logprobs.tokens]


@pytest.mark.parametrize("kind", ["gemma2", "mixtral"])
def test_served_greedy_equals_hf(kind, default_model_dir, tmp_path):
    hf_model = make_tiny_family_model(kind, max_position_embeddings=256)
    model_dir = str(tmp_path / kind)
    hf_model.save_pretrained(model_dir)
    expected = [hf_greedy(hf_model, prompt) for prompt in PROMPTS]
    args = [
        model_dir,
        "--tokenizer",
        default_model_dir,
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        str(32 << 20),
        "--served-model-name",
        kind,
        "--return-tokens-as-token-ids",
        "--enable-prefix-caching",
    ]
    with serving(args, str(tmp_path / "serve.log")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for _ in range(2):  # the second round hits the prefix cache
            reply = client.completions.create(
                model=kind,
                prompt=PROMPTS,
                max_tokens=NUM_TOKENS,
                temperature=0.0,
                logprobs=0,
                extra_body={"ignore_eos": True},
            )
            got = [_token_ids(c) for c in sorted(reply.choices, key=lambda c: c.index)]
            assert got == expected
