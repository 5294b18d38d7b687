"""Images in the prompt through `kvserve serve` and the official clients: a tiny random
Qwen2.5-VL served from a folder (its processor loaded offline), chat `image_url` parts as
data: URLs and local files under --allowed-local-media-path, equal to HF's greedy output
with the same pixels; the same image again hits the prefix cache (usage and /metrics) with
the output unchanged; --limit-mm-per-prompt, remote URLs and bad images are 400s; an
Anthropic image block takes the same path.
"""

from __future__ import annotations

import base64
import io
import json

import anthropic
import openai
import pytest

from kvserve.services.api.serving.multimodal import load_image_processor
from tests.support.metrics import metrics_text, read_metric
from tests.support.server import serving
from tests.support.vlm_models import MAX_TOKENS, chat_prompt, hf_greedy, random_image, save_tiny_vlm

MODEL = "tiny-vlm"
QUESTION = "What is in it?"
BLOCK_SIZE = 16


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(base URL, media folder, {name: image}, {name: HF greedy tokens}, model_dir)."""
    root = tmp_path_factory.mktemp("vision")
    model_dir = str(root / "model")
    hf_model = save_tiny_vlm(model_dir)
    media = root / "media"
    media.mkdir()
    images = {"a": random_image(112, 168, seed=1), "b": random_image(140, 112, seed=2)}
    for name, image in images.items():
        (media / f"{name}.png").write_bytes(png_bytes(image))
    processor = load_image_processor(model_dir)
    prompt = chat_prompt(model_dir, 1, QUESTION)
    # The images as the server gets them: decoded from PNG (lossless), then preprocessed.
    expected = {
        name: hf_greedy(hf_model, *processor.expand(prompt, [image]))[0]
        for name, image in images.items()
    }
    args = [
        model_dir,
        "--served-model-name",
        MODEL,
        "--kv-cache-memory",
        "16M",
        "--max-model-len",
        "1024",
        "--allowed-local-media-path",
        str(media),
        "--limit-mm-per-prompt",
        json.dumps({"image": 2}),
        "--enable-prompt-tokens-details",
        "--return-tokens-as-token-ids",
        "--uvicorn-log-level",
        "warning",
    ]
    with serving(args, str(root / "serve.log")) as url:
        yield url, media, images, expected, model_dir


def ask(client: openai.OpenAI, image_url: str, *more_urls: str, ignore_eos: bool = True):
    content = [{"type": "image_url", "image_url": {"url": u}} for u in (image_url, *more_urls)]
    content.append({"type": "text", "text": QUESTION})
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logprobs=True,
        extra_body={"ignore_eos": ignore_eos},
    )


def token_ids(response) -> list[int]:
    # --return-tokens-as-token-ids: each logprob entry names its token as "token_id:N".
    return [int(entry.token.split(":")[1]) for entry in response.choices[0].logprobs.content]


@pytest.fixture(scope="module")
def client(setup):
    return openai.OpenAI(base_url=setup[0] + "/v1", api_key="unused", max_retries=0)


def test_two_images_give_hf_greedy_output(setup, client):
    _, media, images, expected, _ = setup
    from_data = ask(client, data_url(images["a"]))
    from_file = ask(client, f"file://{media / 'b.png'}")
    assert token_ids(from_data) == expected["a"]
    assert token_ids(from_file) == expected["b"]
    assert expected["a"] != expected["b"]


def test_the_same_image_twice_hits_the_prefix_cache(setup, client):
    url, media, images, expected, _ = setup
    hits_before = read_metric(metrics_text(url), "kvserve:prefix_cache_hits_total")
    image_path = str(media / "a.png")  # a plain path under the allowed folder
    first = ask(client, image_path)
    second = ask(client, image_path)
    hits = read_metric(metrics_text(url), "kvserve:prefix_cache_hits_total") - hits_before
    prompt_tokens = second.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Every full block but the one holding the last prompt token (a run of the first test
    # may have cached it already: the first request can hit too).
    assert cached == (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert hits >= cached > 24  # past the image's 24 tokens
    assert token_ids(first) == token_ids(second) == expected["a"]


def test_refusals_are_400s_naming_why(setup, client):
    _, media, images, _, _ = setup
    a = data_url(images["a"])
    cases = [
        ((a, a, a), "at most 2 are allowed (--limit-mm-per-prompt)"),
        (("https://example.com/cat.png",), "remote image URLs are not fetched"),
        (("data:image/png;base64," + base64.b64encode(b"not a png").decode(),), "decoded"),
        (("data:text/plain;base64,aGk=",), "is no image"),
        (("file:///etc/hostname",), "outside --allowed-local-media-path"),
        ((f"file://{media / 'missing.png'}",), "no image file"),
    ]
    for urls, why in cases:
        with pytest.raises(openai.BadRequestError) as info:
            ask(client, *urls)
        assert why in str(info.value), (urls[0][:40], str(info.value))


def test_an_anthropic_image_block_takes_the_same_path(setup):
    url, _, images, expected, _ = setup
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    data = base64.b64encode(png_bytes(images["b"])).decode()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    reply = client.messages.create(
        model=MODEL,
        messages=[{"role": "user", "content": [image, {"type": "text", "text": QUESTION}]}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
    )
    openai_client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    chat = ask(openai_client, data_url(images["b"]), ignore_eos=False)
    # Anthropic's input_tokens leave out the prefix-cache reads.
    usage = reply.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert reply.content[0].text == chat.choices[0].message.content
