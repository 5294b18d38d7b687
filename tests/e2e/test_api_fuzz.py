"""Schemathesis against a real `kvserve serve` of the tiny model, from its /openapi.json:
a bounded run (~160 cases, positive and negative, every operation) that must give no 5xx,
no hang and no dropped connection, and leave the engine serving. bench/fuzz_api.py is the
same run at full length."""

from __future__ import annotations

import httpx
import pytest

from tests.support.fuzz import fuzz
from tests.support.models import TINY_KV_CACHE_MEMORY
from tests.support.server import read_log, serving

pytestmark = pytest.mark.slow

KEY = "sk-fuzz"
# Generation stays short: max_tokens left out fills the context.
FUZZ_SERVE_ARGS = [
    "--kv-cache-memory",
    str(TINY_KV_CACHE_MEMORY),
    "--max-model-len",
    "64",
    "--chat-template",
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    (folder / "keys").write_text(f"fuzzer:{KEY}\n")
    log = str(folder / "serve.log")
    args = [tiny_llama_dir, *FUZZ_SERVE_ARGS, "--api-key-file", str(folder / "keys")]
    with serving(args, log) as url:
        yield url, log


def test_fuzzed_requests_get_no_server_error_and_the_engine_lives(server):
    url, log = server
    report = fuzz(url, max_examples=20, headers={"Authorization": f"Bearer {KEY}"}, seed=0)
    assert report.num_requests >= 120, report.summary()
    assert not report.failures, "\n".join(map(str, report.failures[:10]))
    assert report.num_server_errors == 0, report.summary()
    assert sum(n for status, n in report.status_counts.items() if status == 200) > 0
    # The engine is alive and serves.
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "healthy"
    response = httpx.post(
        url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
    assert "Traceback" not in read_log(log)
