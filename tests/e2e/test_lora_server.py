"""LoRA through `kvserve serve` and the official openai client: `model` picks an adapter,
/v1/models lists them, adapters load and unload at run time, /metrics shows them.

Tokens are compared with PEFT's merged models (as token ids: `return_tokens_as_token_ids`
with logprobs, so no detokenization gets in the way).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.support.lora import hf_greedy, make_peft_adapter, merged_model
from tests.support.metrics import metrics_text, read_metric
from tests.support.models import TINY_KV_CACHE_MEMORY, build_tiny_llama
from tests.support.server import serving
from tests.support.waiting import wait_until

SERVED = "tiny"
PROMPT = list(b"hello world")  # as token ids: the references need no tokenizer
MAX_TOKENS = 10
TOKEN_IDS = {"ignore_eos": True, "return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    model_dir = build_tiny_llama(str(root / "model"))
    paths = {
        "full": make_peft_adapter(model_dir, str(root / "full"), seed=11),
        "narrow": make_peft_adapter(
            model_dir, str(root / "narrow"), seed=12, rank=4, targets=["v_proj", "gate_proj"]
        ),
    }
    references = {
        name: hf_greedy(merged_model(model_dir, path), PROMPT, MAX_TOKENS)
        for name, path in {SERVED: None, **paths}.items()
    }
    return model_dir, paths, references


@pytest.fixture(scope="module")
def server(setup, tmp_path_factory):
    model_dir, paths, _ = setup
    narrow = json.dumps({"name": "narrow", "path": paths["narrow"], "base_model_name": "tiny-b"})
    args = [
        model_dir,
        "--served-model-name",
        SERVED,
        "--dtype",
        "float32",
        "--kv-cache-memory",
        str(TINY_KV_CACHE_MEMORY),
        "--chat-template",
        "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"full={paths['full']}",
        narrow,
    ]
    log = str(tmp_path_factory.mktemp("lora_server_log") / "serve.log")
    with serving(args, log) as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def completion_ids(choice) -> list[int]:
    return [int(token.removeprefix("token_id:")) for token in choice.logprobs.tokens]


def greedy_request(model: str) -> dict:
    """The completion request whose tokens the references hold, for `model`."""
    return dict(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logprobs=0,
        extra_body=TOKEN_IDS,
    )


def complete(client: OpenAI, model: str) -> list[int]:
    response = client.completions.create(**greedy_request(model))
    assert response.model == model
    return completion_ids(response.choices[0])


def wait_idle(server: str) -> None:
    """No request left and every KV block back (none leaked)."""

    def idle() -> bool:
        text = metrics_text(server)
        return (
            read_metric(text, "kvserve:num_requests_running") == 0
            and read_metric(text, "kvserve:kv_cache_usage_perc") == 0
        )

    wait_until(idle, timeout_s=30)


def test_models_lists_the_adapters(client, setup):
    _, paths, _ = setup
    cards = {card.id: card for card in client.models.list().data}
    assert list(cards) == [SERVED, "full", "narrow"]
    assert (cards["full"].root, cards["full"].parent) == (paths["full"], SERVED)
    assert (cards["narrow"].root, cards["narrow"].parent) == (paths["narrow"], "tiny-b")
    assert cards[SERVED].parent is None


def test_model_name_picks_the_adapter(client, server, setup):
    _, _, references = setup
    assert references["full"] != references[SERVED] != references["narrow"]
    for model in (SERVED, "full", "narrow"):
        assert complete(client, model) == references[model], model
    chat = client.chat.completions.create(
        model="full", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat.model == "full" and chat.choices[0].message.content is not None
    wait_idle(server)


def test_concurrent_requests_of_every_adapter_share_batches(server, setup):
    _, _, references = setup
    models = [SERVED, "full", "narrow"] * 3

    async def run() -> list[list[int]]:
        async with AsyncOpenAI(base_url=server + "/v1", api_key="x", max_retries=0) as aclient:
            responses = await asyncio.gather(
                *(
                    aclient.completions.create(**greedy_request(model), stream=False)
                    for model in models
                )
            )
        return [completion_ids(r.choices[0]) for r in responses]

    for model, ids in zip(models, asyncio.run(run())):
        assert ids == references[model], model
    wait_idle(server)


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist."):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)


def test_load_and_unload_at_run_time(client, server, setup):
    _, paths, references = setup
    load = httpx.post(
        server + "/v1/load_lora_adapter",
        json={"lora_name": "extra", "lora_path": paths["narrow"]},
        timeout=10,
    )
    assert load.status_code == 200, load.text
    assert "extra" in [card.id for card in client.models.list().data]
    assert complete(client, "extra") == references["narrow"]

    again = httpx.post(
        server + "/v1/load_lora_adapter",
        json={"lora_name": "extra", "lora_path": paths["narrow"]},
        timeout=10,
    )
    assert again.status_code == 400
    assert again.json()["error"]["message"] == "The lora adapter 'extra' has already been loaded."
    bad = httpx.post(
        server + "/v1/load_lora_adapter",
        json={"lora_name": "bad", "lora_path": "/nonexistent"},
        timeout=10,
    )
    assert bad.status_code == 400 and "adapter_config.json not found" in bad.text

    unload = httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "extra"}, timeout=10)
    assert unload.status_code == 200, unload.text
    assert "extra" not in [card.id for card in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="extra", prompt=PROMPT, max_tokens=2)
    gone = httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "extra"}, timeout=10)
    assert gone.status_code == 404
    assert gone.json()["error"]["type"] == "NotFoundError"
    wait_idle(server)


def test_metrics_show_lora_requests_info(client, server):
    complete(client, "full")
    text = metrics_text(server)
    (line,) = [ln for ln in text.splitlines() if ln.startswith("kvserve:lora_requests_info{")]
    assert 'max_lora="2"' in line
    assert 'running_lora_adapters=""' in line and 'waiting_lora_adapters=""' in line
