"""MTP speculation (`method: "deepseek_mtp"`, vLLM's name, or "mtp") through the whole serving
stack: `kvserve serve --speculative-config` on tiny float32 DeepSeek-V3 checkpoints with a
multi-token-prediction layer (tests/support/models.py), HTTP and the official openai client.

Greedy completions with MTP equal the server's own without speculation, token for token: over
a random target with a random MTP layer (its drafts mostly rejected), and over a `successor`
target whose MTP layer is built to guess its next tokens (drafts accepted: /metrics counts
them). k > 1 drafts run the one layer again on its own guesses. A checkpoint without the
layer stops `kvserve serve` at start-up with a message that says so.
"""

from __future__ import annotations

import json
import subprocess

import openai
import pytest

from tests.support.metrics import metrics_text, read_metric
from tests.support.models import TINY_KV_CACHE_MEMORY, build_tiny_deepseek_v3
from tests.support.ports import free_port
from tests.support.server import read_log, serving, start_kvserve

NAME = "tiny-v3"
PROMPTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "abc",
    "Rewrite: the cat sat on the mat, the cat sat on the hat.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def random_model(tmp_path_factory) -> str:
    return build_tiny_deepseek_v3(str(tmp_path_factory.mktemp("random")), seed=5)


@pytest.fixture(scope="module")
def successor_model(tmp_path_factory) -> str:
    return build_tiny_deepseek_v3(str(tmp_path_factory.mktemp("successor")), successor=True)


def _args(model_dir: str, spec: dict | None = None) -> list[str]:
    args = [model_dir, "--dtype", "float32", "--kv-cache-memory", str(TINY_KV_CACHE_MEMORY),
            "--max-model-len", "512", "--served-model-name", NAME,
            "--return-tokens-as-token-ids"]  # fmt: skip
    return args + (["--speculative-config", json.dumps(spec)] if spec else [])


def _greedy_token_ids(url: str) -> list[list[int]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    reply = client.completions.create(
        model=NAME,
        prompt=PROMPTS,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    # --return-tokens-as-token-ids: each logprobs token reads "token_id:N".
    return [
        [int(token.split(":")[1]) for token in choice.logprobs.tokens]
        for choice in sorted(reply.choices, key=lambda c: c.index)
    ]


def _served(model_dir: str, log_path: str, spec: dict | None = None):
    """(greedy token ids of PROMPTS, (drafted, accepted) from /metrics) of one server."""
    with serving(_args(model_dir, spec), log_path) as url:
        out = _greedy_token_ids(url)
        text = metrics_text(url)
    counts = (
        read_metric(text, "kvserve:spec_decode_num_draft_tokens_total", 0.0),
        read_metric(text, "kvserve:spec_decode_num_accepted_tokens_total", 0.0),
    )
    return out, counts


def test_random_layer_greedy_equals_unspeculated(random_model, tmp_path):
    reference, _ = _served(random_model, str(tmp_path / "plain.log"))
    assert all(len(out) == MAX_TOKENS for out in reference)
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": 3, "adaptive": False}
    out, (drafted, _) = _served(random_model, str(tmp_path / "mtp.log"), spec)
    assert out == reference
    assert drafted > 0


def test_built_layer_drafts_are_accepted_and_output_unchanged(successor_model, tmp_path):
    reference, _ = _served(successor_model, str(tmp_path / "plain.log"))
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    out, (drafted, accepted) = _served(successor_model, str(tmp_path / "mtp.log"), spec)
    assert out == reference
    assert drafted > 0 and accepted > 0.5 * drafted, f"{accepted} of {drafted} accepted"


def test_a_checkpoint_without_the_layer_fails_at_start_up(tmp_path):
    model_dir = build_tiny_deepseek_v3(str(tmp_path / "no-mtp"), mtp=False)
    log_path = str(tmp_path / "serve.log")
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": 1}
    args = ["serve", "--host", "127.0.0.1", "--port", str(free_port()), *_args(model_dir, spec)]
    process = start_kvserve(args, log_path)
    try:
        assert process.wait(timeout=120) != 0, read_log(log_path)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    log = read_log(log_path)
    assert "multi-token-prediction layers" in log and "num_nextn_predict_layers=0" in log, log
