"""HTTP options as vLLM's users set them, on a real `kvserve serve`: CORS (a browser's
preflight), TLS with a self-signed pair, --root-path, --chat-template, --generation-config."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import time

import httpx
import openai
import pytest

from tests.support.models import TINY_KV_CACHE_MEMORY
from tests.support.ports import free_port
from tests.support.server import read_log, serving, start_kvserve

pytestmark = pytest.mark.slow

ORIGIN = "https://app.example"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
API_KEY = "sk-test"


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    gen_dir = tmp_path_factory.mktemp("generation-config")
    (gen_dir / "generation_config.json").write_text(
        json.dumps({"max_new_tokens": 5, "temperature": 0.0})
    )
    log = str(tmp_path_factory.mktemp("logs") / "serve.log")
    args = [
        tiny_llama_dir,
        "--kv-cache-memory",
        str(TINY_KV_CACHE_MEMORY),
        "--api-key",
        API_KEY,
        "--allowed-origins",
        json.dumps([ORIGIN]),
        "--chat-template",
        TEMPLATE,
        "--generation-config",
        str(gen_dir),
        "--root-path",
        "/llm",
    ]
    with serving(args, log) as url:
        yield url


def test_cors_preflight_with_a_browsers_headers(server):
    headers = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    # No API key: a browser sends none on a preflight, and it must still pass.
    response = httpx.options(f"{server}/v1/chat/completions", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in response.headers["access-control-allow-methods"]
    assert "authorization" in response.headers["access-control-allow-headers"].lower()
    refused = httpx.options(
        f"{server}/v1/chat/completions", headers={**headers, "Origin": "https://evil.example"}
    )
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers


def test_cors_headers_on_the_actual_request_and_the_key_still_required(server):
    body = {"prompt": "hi", "max_tokens": 1}
    ok = httpx.post(
        f"{server}/v1/completions",
        json=body,
        headers={"Origin": ORIGIN, "Authorization": f"Bearer {API_KEY}"},
    )
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert (
        httpx.post(f"{server}/v1/completions", json=body, headers={"Origin": ORIGIN}).status_code
        == 401
    )


def test_root_path_behind_a_proxy_that_strips_it_and_the_key_still_guards_v1(server):
    # uvicorn puts --root-path in front of each request's path; routes and the API key check
    # must both see through it.
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{server}/v1/models", headers=auth).status_code == 200
    assert httpx.get(f"{server}/v1/models").status_code == 401
    assert httpx.get(f"{server}/health").status_code == 200


def test_chat_template_flag_replaces_the_tokenizers(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY)
    tokens = httpx.post(
        f"{server}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()["tokens"]
    text = httpx.post(f"{server}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text == "<user>hi"
    chat = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "hi"}]
    )
    assert chat.usage.prompt_tokens == len(tokens)


def test_generation_config_supplies_defaults_and_the_request_wins(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY)
    model = client.models.list().data[0].id
    default = client.completions.create(
        model=model, prompt="hello", extra_body={"ignore_eos": True}
    )
    assert default.usage.completion_tokens == 5  # max_new_tokens of the generation config
    assert default.choices[0].finish_reason == "length"
    own = client.completions.create(
        model=model, prompt="hello", max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert own.usage.completion_tokens == 7


def _self_signed_pair(folder) -> tuple[str, str]:
    key, cert = str(folder / "key.pem"), str(folder / "cert.pem")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            key,
            "-out",
            cert,
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return key, cert


@pytest.mark.skipif(
    shutil.which("openssl") is None,
    reason="the openssl command, which makes the self-signed pair, is missing",
)
def test_tls_with_a_self_signed_pair(tiny_llama_dir, tmp_path):
    key, cert = _self_signed_pair(tmp_path)
    port = free_port()
    log = str(tmp_path / "serve.log")
    process = start_kvserve(
        [
            "serve",
            tiny_llama_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--kv-cache-memory",
            str(TINY_KV_CACHE_MEMORY),
            "--ssl-keyfile",
            key,
            "--ssl-certfile",
            cert,
        ],
        log,
    )
    url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, read_log(log)
            try:
                if (
                    httpx.get(
                        f"{url}/health", verify=ssl.create_default_context(cafile=cert), timeout=2
                    ).status_code
                    == 200
                ):
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, read_log(log)
            time.sleep(0.5)
        with openai.OpenAI(
            base_url=f"{url}/v1",
            api_key="unused",
            http_client=httpx.Client(verify=ssl.create_default_context(cafile=cert)),
        ) as client:
            done = client.completions.create(
                model=client.models.list().data[0].id,
                prompt="hi",
                max_tokens=3,
                extra_body={"ignore_eos": True},
            )
        assert done.usage.completion_tokens == 3
        with pytest.raises(httpx.TransportError):  # plain http is not served
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        process.terminate()
        process.wait(timeout=60)
