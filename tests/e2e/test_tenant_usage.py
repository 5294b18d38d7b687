"""Usage per tenant, end to end: a real `kvserve serve` of the tiny model with an API key file
(admin, alpha, beta); alpha and beta send completions and chats through the openai SDK,
streamed (with include_usage) and not, several prompts and n > 1. The per-tenant series of
/metrics and GET /v1/usage must equal, per tenant, the sum of the `usage` the clients got;
/v1/usage answers the admin key only (403 for another key, 401 for none)."""

from __future__ import annotations

import collections

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.metrics import metrics_text
from tests.support.server import DP_MODEL_NAME, start_tiny_server

pytestmark = pytest.mark.slow

KEYS = {"admin": "sk-admin-1", "alpha": "sk-alpha-1", "beta": "sk-beta-1"}
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tenant-usage")
    key_file = folder / "keys"
    key_file.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
    process = start_tiny_server(
        tiny_llama_dir, folder, "--api-key-file", str(key_file), "--chat-template", CHAT_TEMPLATE
    )
    try:
        process.wait_healthy()
        yield process
    finally:
        process.stop()


class Seen:
    """What one tenant's clients were told: the sums of their `usage`, and their choices."""

    def __init__(self):
        self.prompt_tokens = self.completion_tokens = self.num_choices = 0

    def add(self, usage, num_choices: int) -> None:
        assert usage is not None
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.num_choices += num_choices


def send_traffic(client: openai.OpenAI, seen: Seen, num_prompts: int, n: int) -> None:
    """A completion of `num_prompts` prompts with n choices each, then a streamed one, a chat
    and a streamed chat (n choices each)."""
    common = {"model": DP_MODEL_NAME, "max_tokens": 5, "temperature": 0.8, "seed": 1}
    prompts = [f"prompt number {i} of the batch" for i in range(num_prompts)]
    response = client.completions.create(prompt=prompts, n=n, **common)
    seen.add(response.usage, len(response.choices))

    choices: set[tuple[int, int]] = set()
    usage = None
    for chunk in client.completions.create(
        prompt="a streamed prompt",
        n=n,
        stream=True,
        stream_options={"include_usage": True},
        **common,
    ):
        choices.update((0, c.index) for c in chunk.choices)
        usage = chunk.usage or usage
    seen.add(usage, len(choices))

    messages = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(messages=messages, n=n, **common)
    seen.add(chat.usage, len(chat.choices))

    choices.clear()
    usage = None
    for chunk in client.chat.completions.create(
        messages=messages, n=n, stream=True, stream_options={"include_usage": True}, **common
    ):
        choices.update((0, c.index) for c in chunk.choices)
        usage = chunk.usage or usage
    seen.add(usage, len(choices))


def tenant_samples(text: str) -> dict[str, collections.Counter]:
    """tenant -> series name -> value, the finished reasons summed."""
    by_tenant: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("kvserve:tenant_") and "tenant" in sample.labels:
                by_tenant[sample.labels["tenant"]][sample.name] += sample.value
    return by_tenant


def test_tenant_series_and_usage_route_equal_what_clients_were_told(server):
    seen = {"alpha": Seen(), "beta": Seen()}
    for tenant, (num_prompts, n) in {"alpha": (2, 2), "beta": (1, 3)}.items():
        client = openai.OpenAI(
            base_url=server.url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=60
        )
        send_traffic(client, seen[tenant], num_prompts, n)
    assert seen["alpha"].num_choices == 2 * 2 + 3 * 2

    series = tenant_samples(metrics_text(server.url))
    admin = {"Authorization": f"Bearer {KEYS['admin']}"}
    response = httpx.get(server.url + "/v1/usage", headers=admin, timeout=10)
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["object"] == "usage"
    assert set(report["tenants"]) == {"alpha", "beta"}  # admin only read
    for tenant, told in seen.items():
        assert series[tenant]["kvserve:tenant_prompt_tokens_total"] == told.prompt_tokens
        assert series[tenant]["kvserve:tenant_generation_tokens_total"] == told.completion_tokens
        assert series[tenant]["kvserve:tenant_requests_total"] == told.num_choices
        assert series[tenant]["kvserve:tenant_time_to_first_token_seconds_count"] > 0
        assert report["tenants"][tenant] == {
            "requests": told.num_choices,
            "prompt_tokens": told.prompt_tokens,
            "completion_tokens": told.completion_tokens,
            "total_tokens": told.prompt_tokens + told.completion_tokens,
        }
    # A range that ends before the traffic holds nothing.
    early = httpx.get(
        server.url + "/v1/usage", params={"end": 60}, headers=admin, timeout=10
    ).json()
    assert early["tenants"] == {}


def test_usage_route_needs_the_admin_key(server):
    alpha = {"Authorization": f"Bearer {KEYS['alpha']}"}
    forbidden = httpx.get(server.url + "/v1/usage", headers=alpha, timeout=10)
    assert forbidden.status_code == 403
    assert forbidden.json()["error"]["message"].startswith("GET /v1/usage needs an admin key")
    assert httpx.get(server.url + "/v1/usage", timeout=10).status_code == 401
    with pytest.raises(openai.PermissionDeniedError):
        openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS["beta"], max_retries=0).get(
            "/usage", cast_to=object
        )
