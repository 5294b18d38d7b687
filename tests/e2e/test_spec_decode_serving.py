"""Speculative decoding through the whole serving stack: `kvserve serve --speculative-config`,
HTTP and the official openai client on the default model (float32). Greedy completions,
streamed or not, equal the engine's own without speculation; stop strings and max_tokens
cut drafts short; /metrics carries vLLM's spec_decode counters."""

from __future__ import annotations

import json

import openai
import pytest

from kvserve import LLM, SamplingParams
from tests.support.metrics import metrics_text, read_metric
from tests.support.models import DEFAULT_MODEL_KV_CACHE_MEMORY
from tests.support.server import serving

pytestmark = pytest.mark.slow

PROMPTS = [
    "Repeat exactly: one two three four five, one two three four five, one two three",
    "The alphabet is: a b c d e f g h i j k l m n o p",
]
MAX_TOKENS = 24
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "adaptive": False}  # fmt: skip


@pytest.fixture(scope="module")
def reference(default_model_dir) -> list[str]:
    llm = LLM(dtype="float32", kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_served_speculation_equals_plain_greedy(reference, tmp_path):
    args = ["--dtype", "float32", "--speculative-config", json.dumps(SPEC),
            "--kv-cache-memory", str(DEFAULT_MODEL_KV_CACHE_MEMORY)]  # fmt: skip
    with serving(args, str(tmp_path / "serve.log")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        reply = client.completions.create(
            model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0.0
        )
        assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == reference

        # Streamed: the same text, however many tokens each step brought.
        chunks = client.completions.create(
            model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, stream=True
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == reference[0]

        # A stop string inside an accepted run of drafts ends the text right before it.
        stop = reference[0].split()[3]
        cut = client.completions.create(
            model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop]
        )
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == reference[0][: reference[0].index(stop)]

        short = client.completions.create(
            model=model, prompt=PROMPTS[1], max_tokens=3, temperature=0.0
        )
        assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"

        text = metrics_text(url)
        drafts = read_metric(text, "kvserve:spec_decode_num_draft_tokens_total")
        accepted = read_metric(text, "kvserve:spec_decode_num_accepted_tokens_total")
        assert read_metric(text, "kvserve:spec_decode_num_drafts_total") > 0
        assert 0 < accepted <= drafts
        first = read_metric(
            text, "kvserve:spec_decode_num_accepted_tokens_per_pos_total", position="0"
        )
        assert 0 < first <= accepted
