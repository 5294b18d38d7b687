"""/rerank, /v1/rerank (Jina), /v2/rerank (Cohere v2), /v1/score and /classify against a
real `kvserve serve --runner pooling` of a tiny random-weight BERT cross-encoder (one label):
scores equal HF AutoModelForSequenceClassification's sigmoid of the pair's logit to 1e-4,
ordered best first, top_n kept, usage counted; hostile inputs are 4xx, never a 500.

The Cohere v2 shape is checked raw and through the `cohere` SDK's ClientV2.rerank.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.support.encoders import build_cross_encoder, hf_pair_scores
from tests.support.server import serving

pytestmark = pytest.mark.slow

MODEL = "tiny-reranker"
QUERY = "what is a fox"
DOCUMENTS = [
    "a fox is an animal",
    "paris is in france",
    "x",
    "the quick brown fox jumps over the lazy dog",
    "foxes live in forests and eat mice",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_cross_encoder(str(tmp_path_factory.mktemp("reranker")), "bert", num_labels=1)


@pytest.fixture(scope="module")
def url(folder, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("rerank-serve") / "serve.log")
    args = [folder, "--runner", "pooling", "--dtype", "float32", "--served-model-name", MODEL]
    with serving([*args, "--uvicorn-log-level", "warning"], log_path) as url:
        yield url


@pytest.fixture(scope="module")
def expected(folder) -> np.ndarray:
    """HF's relevance of each document: the sigmoid of its pair's one logit."""
    logits = hf_pair_scores(folder, QUERY, DOCUMENTS)[:, 0].numpy()
    return 1.0 / (1.0 + np.exp(-logits))


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank"])
def test_jina_rerank_equals_hf_sorted_with_top_n(url, expected, path):
    body = {"model": MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 3}
    response = _post(url, path, body)
    assert response.status_code == 200, response.text
    result = response.json()
    order = list(np.argsort(-expected))[:3]
    assert [r["index"] for r in result["results"]] == order
    for r in result["results"]:
        assert r["relevance_score"] == pytest.approx(float(expected[r["index"]]), abs=1e-4)
        assert r["document"] == {"text": DOCUMENTS[r["index"]]}
    assert result["model"] == MODEL and result["usage"]["total_tokens"] > len(DOCUMENTS)


def test_jina_documents_as_objects_without_echo(url, expected):
    documents = [{"text": text} for text in DOCUMENTS]
    body = {"query": QUERY, "documents": documents, "return_documents": False}
    results = _post(url, "/v1/rerank", body).json()["results"]
    assert len(results) == len(DOCUMENTS) and all("document" not in r for r in results)
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)


def test_cohere_v2_shape(url, expected):
    body = {"model": MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 2}
    result = _post(url, "/v2/rerank", body).json()
    assert result["id"] and result["meta"]["billed_units"]["search_units"] == 1
    assert result["meta"]["billed_units"]["input_tokens"] > 0
    assert [r["index"] for r in result["results"]] == list(np.argsort(-expected))[:2]


def test_cohere_sdk_rerank(url, expected):
    import cohere

    client = cohere.ClientV2(api_key="unused", base_url=url)
    response = client.rerank(model=MODEL, query=QUERY, documents=DOCUMENTS, top_n=3)
    assert [r.index for r in response.results] == list(np.argsort(-expected))[:3]
    for r in response.results:
        assert r.relevance_score == pytest.approx(float(expected[r.index]), abs=1e-4)


def test_score_one_to_n_and_n_to_n_equal_hf(url, folder, expected):
    body = {"model": MODEL, "text_1": QUERY, "text_2": DOCUMENTS}
    result = _post(url, "/v1/score", body).json()
    scores = [d["score"] for d in sorted(result["data"], key=lambda d: d["index"])]
    np.testing.assert_allclose(scores, expected, atol=1e-4)
    assert result["usage"]["prompt_tokens"] > 0
    pairs = {"text_1": ["what is a fox", "where is paris"], "text_2": DOCUMENTS[:2]}
    got = [d["score"] for d in _post(url, "/score", pairs).json()["data"]]
    second = hf_pair_scores(folder, "where is paris", DOCUMENTS[1:2])[0, 0].item()
    assert got == pytest.approx([float(expected[0]), 1 / (1 + np.exp(-second))], abs=1e-4)


def test_classify_one_label_is_its_sigmoid(url, folder):
    result = _post(url, "/classify", {"input": ["a fox", "paris"]}).json()
    assert [d["index"] for d in result["data"]] == [0, 1]
    assert all(d["num_classes"] == 1 and d["label"] == "label_0" for d in result["data"])
    assert all(0.0 < d["probs"][0] < 1.0 for d in result["data"])
    assert result["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/rerank", {"query": QUERY, "documents": []}),
        ("/v1/rerank", {"query": QUERY, "documents": ["a fox"] * 10_000}),
        ("/v1/rerank", {"query": "fox " * 200, "documents": ["a fox"]}),
        ("/v2/rerank", {"query": QUERY}),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}),
        ("/v1/score", {"text_1": [], "text_2": "a"}),
        ("/classify", {"input": []}),
        ("/v1/embeddings", {"input": "a fox"}),
        ("/v1/completions", {"prompt": "a fox"}),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"], "truncate_prompt_tokens": 0}),
    ],
)
def test_hostile_inputs_are_4xx(url, path, body):
    response = _post(url, path, body)
    assert 400 <= response.status_code < 500, response.text
    assert "error" in response.json()


def test_a_long_document_is_cut_when_truncation_is_asked(url):
    long_document = "fox " * 200
    refused = _post(url, "/v1/rerank", {"query": QUERY, "documents": [long_document]})
    assert refused.status_code == 400
    body = {"query": QUERY, "documents": [long_document], "truncate_prompt_tokens": -1}
    response = _post(url, "/v1/rerank", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["total_tokens"] < 128  # max_model_len
