"""/v1/embeddings with --runner pooling against a real `kvserve serve` of the default model,
through the official `openai` client: the vectors are HF transformers' last hidden states of
the same tokens (last-token pooling, L2-normalised, as vLLM's --convert embed pools a
generative model) within 1e-4 in float32, also while generation requests run in the same
engine's batches.
"""

from __future__ import annotations

import base64
import threading

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.support.server import serving_default_model

pytestmark = pytest.mark.slow

MODEL = "smollm2-embed"
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France.",
    "Embeddings turn text into vectors.",
]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with serving_default_model(
        tmp_path_factory,
        MODEL,
        "--runner",
        "pooling",
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def hf(default_model_dir):
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(default_model_dir)


def hf_embedding(hf, token_ids: list[int]) -> np.ndarray:
    model, _ = hf
    with torch.inference_mode():
        hidden = model(torch.tensor([token_ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=0).numpy()


def test_embeddings_equal_hf_last_token_pooling(client, hf):
    _, tokenizer = hf
    response = client.embeddings.create(model=MODEL, input=TEXTS)
    assert response.model == MODEL and [d.index for d in response.data] == [0, 1, 2]
    ids = [tokenizer.encode(text) for text in TEXTS]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, ids))
    for data, token_ids in zip(response.data, ids):
        ours = np.array(data.embedding, dtype=np.float32)
        assert abs(np.linalg.norm(ours) - 1) < 1e-5
        np.testing.assert_allclose(ours, hf_embedding(hf, token_ids), atol=1e-4)
    # Token ids in, base64 out: the same vector.
    encoded = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="base64")
    again = np.frombuffer(base64.b64decode(encoded.data[0].embedding), dtype=np.float32)
    np.testing.assert_allclose(again, np.array(response.data[1].embedding), atol=1e-6)


def test_embeddings_while_generation_runs_in_the_same_batches(client, hf):
    _, tokenizer = hf
    done = []

    def generate():
        reply = client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=64, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        done.append(reply.usage.completion_tokens)

    threads = [threading.Thread(target=generate) for _ in range(3)]
    for thread in threads:
        thread.start()
    texts = [f"{text} Number {i}." for i, text in enumerate(TEXTS * 4)]
    response = client.embeddings.create(model=MODEL, input=texts)
    for thread in threads:
        thread.join()
    assert done == [64, 64, 64]
    for data, text in zip(response.data, texts):
        expected = hf_embedding(hf, tokenizer.encode(text))
        np.testing.assert_allclose(np.array(data.embedding), expected, atol=1e-4)


def test_bad_embedding_requests_are_refused_by_name(client):
    cases = [
        ({"input": []}, "input"),
        ({"input": [""]}, "empty"),
        ({"input": [{"text": "x"}]}, "token ids"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": 10**6}, "dimensions must be at most"),
        ({"input": "x", "extra_body": {"truncate_prompt_tokens": 0}}, "truncate_prompt_tokens"),
        ({"input": "word " * 600}, "maximum context length is 512 tokens"),
        ({"input": [[10**9]]}, "token ids must be in"),
    ]
    for fields, named in cases:
        with pytest.raises(openai.BadRequestError, match=named):
            client.embeddings.create(model=MODEL, **fields)


def test_dimensions_keep_the_first_values_renormalised(client, hf):
    _, tokenizer = hf
    response = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=32)
    ours = np.array(response.data[0].embedding, dtype=np.float32)
    full = hf_embedding(hf, tokenizer.encode(TEXTS[0]))[:32]
    np.testing.assert_allclose(ours, full / np.linalg.norm(full), atol=1e-4)


def test_truncate_prompt_tokens_cuts_an_over_long_input(client, hf):
    _, tokenizer = hf
    text = "word " * 600  # over max_model_len: refused without truncation (above)
    response = client.embeddings.create(
        model=MODEL, input=text, extra_body={"truncate_prompt_tokens": 16}
    )
    assert response.usage.prompt_tokens == 16
    expected = hf_embedding(hf, tokenizer(text, truncation=True, max_length=16)["input_ids"])
    np.testing.assert_allclose(np.array(response.data[0].embedding), expected, atol=1e-4)


def test_score_of_an_embedding_model_is_the_cosine(url, hf):
    _, tokenizer = hf
    body = {"model": MODEL, "text_1": TEXTS[0], "text_2": TEXTS[1:]}
    result = httpx.post(url + "/v1/score", json=body, timeout=120).json()
    first = hf_embedding(hf, tokenizer.encode(TEXTS[0]))
    expected = [float(first @ hf_embedding(hf, tokenizer.encode(t))) for t in TEXTS[1:]]
    assert [d["score"] for d in result["data"]] == pytest.approx(expected, abs=1e-4)
    assert result["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(t)) for t in TEXTS)
