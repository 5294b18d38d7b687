"""The OpenAI API through the official `openai` client, over real HTTP, against a real engine.

The server is uvicorn on 127.0.0.1 in a background thread; the engine is a real EngineCore
with the default model (InprocEngineClient), shared by the whole test session.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError, OpenAI

from tests.support.api_server import MAX_MODEL_LEN, SERVED_MODEL_NAME, shared_api_server
from tests.support.kv import assert_no_leaked_blocks
from tests.support.metrics import metrics_text, read_metric
from tests.support.waiting import wait_until

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    return shared_api_server()[1]


@pytest.fixture(scope="module")
def engine_client():
    return shared_api_server()[0]


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def num_tokens(engine_client, text: str) -> int:
    return len(engine_client.tokenizer_info.encode(text))


def wait_for_idle_engine(server, engine_client) -> None:
    """Everything finished or aborted: no running request and no KV block in use."""

    def idle() -> bool:
        text = metrics_text(server.url)
        return (
            read_metric(text, "kvserve:num_requests_running") == 0
            and read_metric(text, "kvserve:num_requests_waiting") == 0
            and read_metric(text, "kvserve:kv_cache_usage_perc") == 0
        )

    assert wait_until(idle, timeout_s=10), metrics_text(server.url)
    assert not engine_client.output_processor.has_unfinished_requests()
    assert_no_leaked_blocks(engine_client.engine_core.scheduler)


# --------------------------------------------------------------------------- shapes


def test_models_health_tokenize(server, client, engine_client):
    models = client.models.list()
    assert [m.id for m in models.data] == [SERVED_MODEL_NAME]
    assert models.data[0].max_model_len == MAX_MODEL_LEN
    assert httpx.get(server.url + "/health").status_code == 200

    tokenized = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert tokenized["tokens"] == engine_client.tokenizer_info.encode(PROMPT)
    assert tokenized["count"] == len(tokenized["tokens"])
    assert tokenized["max_model_len"] == MAX_MODEL_LEN
    detokenized = httpx.post(
        server.url + "/detokenize", json={"tokens": tokenized["tokens"]}
    ).json()
    assert detokenized == {"prompt": PROMPT}
    chat_ids = httpx.post(server.url + "/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert chat_ids == engine_client.tokenizer_info.apply_chat_template(CHAT)


def test_completion_shape_and_usage(client, engine_client):
    response = client.completions.create(
        model=SERVED_MODEL_NAME, prompt=PROMPT, max_tokens=7, temperature=0, extra_body=IGNORE_EOS
    )
    assert response.object == "text_completion"
    assert response.id.startswith("cmpl-")
    assert response.model == SERVED_MODEL_NAME
    (choice,) = response.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert choice.logprobs is None
    num_prompt = num_tokens(engine_client, PROMPT)
    assert (
        response.usage.prompt_tokens,
        response.usage.completion_tokens,
        response.usage.total_tokens,
    ) == (num_prompt, 7, num_prompt + 7)


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(model=SERVED_MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage == full.usage


def test_token_id_prompt_matches_text_prompt(client, engine_client):
    kwargs = dict(model=SERVED_MODEL_NAME, max_tokens=6, temperature=0)
    by_text = client.completions.create(prompt=PROMPT, **kwargs)
    by_ids = client.completions.create(prompt=engine_client.tokenizer_info.encode(PROMPT), **kwargs)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage == by_text.usage


def test_chat_shape_and_stream_equals_non_stream(client, engine_client):
    kwargs = dict(model=SERVED_MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kwargs)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    (choice,) = full.choices
    assert choice.message.role == "assistant" and choice.message.content
    # The model answers in fewer than 16 tokens, so it ended on EOS.
    assert choice.finish_reason == "stop" and full.usage.completion_tokens < 16
    num_prompt = len(engine_client.tokenizer_info.apply_chat_template(CHAT))
    assert full.usage.prompt_tokens == num_prompt
    assert full.usage.total_tokens == num_prompt + full.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finish_reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish_reasons[-1] == choice.finish_reason and not any(finish_reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_n2_and_several_prompts_usage(client, engine_client):
    response = client.completions.create(
        model=SERVED_MODEL_NAME,
        prompt=PROMPT,
        max_tokens=5,
        n=2,
        temperature=1.0,
        seed=3,
        extra_body=IGNORE_EOS,
    )
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert response.usage.completion_tokens == 2 * 5
    assert response.usage.prompt_tokens == num_tokens(engine_client, PROMPT)

    prompts = [PROMPT, "Once upon a time"]
    response = client.completions.create(
        model=SERVED_MODEL_NAME,
        prompt=prompts,
        max_tokens=3,
        n=2,
        temperature=0.7,
        seed=1,
        extra_body=IGNORE_EOS,
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    assert response.usage.completion_tokens == 4 * 3
    assert response.usage.prompt_tokens == sum(num_tokens(engine_client, p) for p in prompts)

    chat = client.chat.completions.create(
        model=SERVED_MODEL_NAME,
        messages=CHAT,
        n=2,
        max_completion_tokens=4,
        temperature=1.0,
        extra_body=IGNORE_EOS,
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage.completion_tokens == 8


def test_n2_stream_collects_both_choices(client):
    kwargs = dict(
        model=SERVED_MODEL_NAME,
        prompt=PROMPT,
        max_tokens=5,
        n=2,
        temperature=0,
        extra_body=IGNORE_EOS,
    )
    full = client.completions.create(**kwargs)
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {c.index: c.text for c in full.choices}


def test_completion_logprobs(client):
    kwargs = dict(
        model=SERVED_MODEL_NAME,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body=IGNORE_EOS,
    )
    response = client.completions.create(**kwargs)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == 6
    for i, (token, value, top) in enumerate(
        zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs)
    ):
        # Greedy: the chosen token is the most likely one, so it is among the top 3 and adds
        # no fourth entry.
        assert value <= 0 and len(top) == 3
        assert value == pytest.approx(max(top.values()), abs=1e-5)
        assert top[token] == pytest.approx(value)
        if i:
            assert logprobs.text_offset[i] == (
                logprobs.text_offset[i - 1] + len(logprobs.tokens[i - 1])
            )
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(**kwargs, stream=True):
        for key in streamed:
            streamed[key] += getattr(chunk.choices[0].logprobs, key)
    assert streamed["tokens"] == logprobs.tokens
    assert streamed["text_offset"] == logprobs.text_offset
    assert streamed["token_logprobs"] == pytest.approx(logprobs.token_logprobs)


def test_chat_logprobs(client):
    response = client.chat.completions.create(
        model=SERVED_MODEL_NAME,
        messages=CHAT,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=IGNORE_EOS,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 5
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_stop_strings_streamed_and_not(client):
    kwargs = dict(model=SERVED_MODEL_NAME, prompt=PROMPT, temperature=0, max_tokens=24)
    text = client.completions.create(**kwargs, extra_body=IGNORE_EOS).choices[0].text
    assert len(text) > 12, text
    # A stop string from the middle of the text, likely straddling tokens.
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.find(stop)
    for include in (False, True):
        expected = text[: cut + len(stop)] if include else text[:cut]
        extra = {"include_stop_str_in_output": include, "ignore_eos": True}
        response = client.completions.create(**kwargs, stop=[stop, "@@never@@"], extra_body=extra)
        choice = response.choices[0]
        assert (choice.text, choice.finish_reason) == (expected, "stop")
        assert choice.model_extra["stop_reason"] == stop
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(**kwargs, stop=stop, stream=True, extra_body=extra)
        )
        assert streamed == expected


def test_echo(client, engine_client):
    response = client.completions.create(
        model=SERVED_MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1
    )
    choice = response.choices[0]
    plain = client.completions.create(
        model=SERVED_MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0
    )
    assert choice.text == PROMPT + plain.choices[0].text
    num_prompt = num_tokens(engine_client, PROMPT)
    assert len(choice.logprobs.tokens) == num_prompt + 4
    assert choice.logprobs.token_logprobs[0] is None  # nothing predicts the first token
    assert all(v is not None for v in choice.logprobs.token_logprobs[1:])
    assert response.usage.completion_tokens == 4
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=SERVED_MODEL_NAME,
            prompt=PROMPT,
            max_tokens=4,
            temperature=0,
            echo=True,
            stream=True,
        )
    )
    assert streamed == choice.text


def test_sampling_knobs_are_accepted(client):
    knobs = dict(
        model=SERVED_MODEL_NAME,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0.8,
        top_p=0.9,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="tester",
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "priority": 1,
            "skip_special_tokens": True,
            "stop_token_ids": [2],
        },
    )
    response = client.completions.create(**knobs)
    again = client.completions.create(**knobs)
    assert response.choices[0].text == again.choices[0].text  # same seed, same text
    assert 2 <= response.usage.completion_tokens <= 4  # min_tokens .. max_tokens


def test_default_max_tokens_fills_the_context(client, engine_client):
    # A prompt 10 tokens short of max_model_len: without max_tokens, all 10 are generated.
    prompt_ids = (engine_client.tokenizer_info.encode(" one two three") * 200)[: MAX_MODEL_LEN - 10]
    response = client.completions.create(
        model=SERVED_MODEL_NAME, prompt=prompt_ids, temperature=0, extra_body=IGNORE_EOS
    )
    assert response.usage.completion_tokens == 10
    assert response.choices[0].finish_reason == "length"


# --------------------------------------------------------------------------- load and aborts


def test_64_concurrent_streams_finish(server, engine_client):
    async def one(client: AsyncOpenAI, i: int) -> tuple[int, str, int]:
        stream = await client.completions.create(
            model=SERVED_MODEL_NAME,
            prompt=f"{i} {PROMPT}",
            max_tokens=4,
            temperature=0.5,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        finish_reason, usage = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish_reason = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                usage = chunk.usage
        return i, finish_reason, usage.completion_tokens

    async def run_all():
        async with AsyncOpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run_all())
    assert sorted(i for i, _, _ in results) == list(range(64))
    assert all(reason == "length" and n == 4 for _, reason, n in results), results
    wait_for_idle_engine(server, engine_client)


def test_client_disconnect_mid_stream_aborts(server, engine_client):
    body = {
        "model": SERVED_MODEL_NAME,
        "prompt": PROMPT,
        "stream": True,
        "temperature": 0,
        "max_tokens": MAX_MODEL_LEN - 8,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[len("data: ") :])["choices"][0]["text"] is not None
            assert wait_until(
                lambda: read_metric(metrics_text(server.url), "kvserve:num_requests_running") == 1
            )
        # Leaving the block closed the connection mid-stream.
    wait_for_idle_engine(server, engine_client)


def test_client_disconnect_while_waiting_for_full_response_aborts(server, engine_client):
    body = {
        "model": SERVED_MODEL_NAME,
        "prompt": PROMPT,
        "temperature": 0,
        "max_tokens": MAX_MODEL_LEN - 8,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    wait_for_idle_engine(server, engine_client)


# --------------------------------------------------------------------------- metrics


def test_metrics_count_tokens_and_latencies(server, client, engine_client):
    before = metrics_text(server.url)
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 6  # > 2 KV blocks
    num_prompt = num_tokens(engine_client, long_prompt)
    for _ in range(2):  # the second one hits the prefix cache
        client.completions.create(
            model=SERVED_MODEL_NAME,
            prompt=long_prompt,
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    after = metrics_text(server.url)

    def delta(name: str) -> float:
        return read_metric(after, name) - read_metric(before, name)

    assert delta("kvserve:prompt_tokens_total") == 2 * num_prompt
    assert delta("kvserve:generation_tokens_total") == 2 * 5
    assert delta("kvserve:time_to_first_token_seconds_count") == 2
    assert delta("kvserve:e2e_request_latency_seconds_count") == 2
    assert delta("kvserve:request_queue_time_seconds_count") == 2
    assert delta("kvserve:inter_token_latency_seconds_count") == 2 * 4
    # One lookup per request, of its whole prompt; the second hits every full block but the
    # one holding the last prompt token, which is always recomputed.
    block_size = engine_client.engine_core.ready.block_size
    assert delta("kvserve:prefix_cache_queries_total") == 2 * num_prompt
    assert delta("kvserve:prefix_cache_hits_total") == (num_prompt - 1) // block_size * block_size
    assert delta("kvserve:num_preemptions_total") == 0  # two requests, room for many more
    finished = [
        read_metric(text, "kvserve:request_success_total", finished_reason="length")
        for text in (before, after)
    ]
    assert finished[1] - finished[0] == 2
    # vLLM's labels, engine "0" for the one engine core.
    assert (
        read_metric(after, "kvserve:num_requests_running", model_name="smollm2-test", engine="0")
        == 0
    )


@pytest.fixture(scope="module")
def hf_causal_lm(default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def _hf_beams(hf_causal_lm, prompt_ids: list[int], width: int) -> list[list[int]]:
    import torch

    with torch.inference_mode():
        rows = hf_causal_lm.generate(
            torch.tensor([prompt_ids]),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=8,
            length_penalty=1.0,
            early_stopping=False,
        )
    return [row[len(prompt_ids) :].tolist() for row in rows]


@pytest.mark.parametrize("width", [2, 3])
def test_beam_search_equals_hf_generate_num_beams(client, engine_client, hf_causal_lm, width):
    tokenizer = engine_client.tokenizer_info.tokenizer
    prompt_ids = engine_client.tokenizer_info.encode(PROMPT)
    reply = client.completions.create(
        model=SERVED_MODEL_NAME, prompt=PROMPT, max_tokens=8, n=width,
        extra_body={"use_beam_search": True},
    )  # fmt: skip
    expected = _hf_beams(hf_causal_lm, prompt_ids, width)
    got = [choice.text for choice in sorted(reply.choices, key=lambda c: c.index)]
    assert got == [tokenizer.decode(ids, skip_special_tokens=True) for ids in expected]
    assert reply.usage.completion_tokens == sum(len(ids) for ids in expected)
    messages = [{"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(
        model=SERVED_MODEL_NAME, messages=messages, max_tokens=8, n=width,
        extra_body={"use_beam_search": True},
    )  # fmt: skip
    chat_ids = engine_client.tokenizer_info.apply_chat_template(messages)
    best = _hf_beams(hf_causal_lm, chat_ids, width)[0]
    assert chat.choices[0].message.content == tokenizer.decode(best, skip_special_tokens=True)


def test_beam_search_refuses_streaming_and_stop_strings(client):
    for extra in ({"stream": True}, {"stop": ["."]}, {"logprobs": 2}):
        with pytest.raises(BadRequestError, match="use_beam_search does not take"):
            client.completions.create(
                model=SERVED_MODEL_NAME, prompt=PROMPT, max_tokens=4, n=2,
                extra_body={"use_beam_search": True, **extra},
            )  # fmt: skip
