"""Latency targets against a real `kvserve serve` of the tiny model: the `slo` body field,
the x-slo-* headers and the key file's slo_* columns each reach the request (its
kvserve:request_slo_total outcome is what the client saw: a 0.01 ms TTFT is always missed, a
10^9 ms one always met), bad targets are 400s through the official openai and anthropic
SDKs, and --slo-admission reject answers 503 for a target out of reach.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from tests.support.metrics import metrics_text, read_metric
from tests.support.server import DP_MODEL_NAME, ServeProcess, start_tiny_server

KEY_FILE = "fast:sk-fast slo_ttft_ms=0.01\nplain:sk-plain\n"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the tiny model has none
PROMPT_IDS = [5] * 10
UNMEETABLE = 0.01  # ms: no first token comes this fast
EASY = 1e9  # ms


def _serve(tiny_llama_dir, tmp_path_factory, *flags: str) -> Iterator[ServeProcess]:
    folder = tmp_path_factory.mktemp("slo")
    key_file = folder / "keys.txt"
    key_file.write_text(KEY_FILE)
    server = start_tiny_server(
        tiny_llama_dir,
        folder,
        "--api-key-file",
        str(key_file),
        "--chat-template",
        CHAT_TEMPLATE,
        *flags,
    )
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory) -> Iterator[ServeProcess]:
    yield from _serve(tiny_llama_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def rejecting_server(tiny_llama_dir, tmp_path_factory) -> Iterator[ServeProcess]:
    yield from _serve(tiny_llama_dir, tmp_path_factory, "--slo-admission", "reject")


def client(server: ServeProcess, key: str = "sk-plain") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def complete(server: ServeProcess, key: str = "sk-plain", max_tokens: int = 3, **kwargs):
    extra_body = {"ignore_eos": True} | kwargs.pop("extra_body", {})
    return client(server, key).completions.create(
        model=DP_MODEL_NAME,
        prompt=PROMPT_IDS,
        max_tokens=max_tokens,
        temperature=0,
        extra_body=extra_body,
        **kwargs,
    )


def outcomes(server: ServeProcess, **labels: str) -> dict[tuple[str, str], float]:
    text = metrics_text(server.url)
    return {
        (target, outcome): read_metric(
            text, "kvserve:request_slo_total", 0.0, target=target, outcome=outcome, **labels
        )
        for target in ("ttft", "tpot")
        for outcome in ("met", "missed")
    }


def counted(server: ServeProcess, send) -> dict[tuple[str, str], float]:
    """What `send()` added to kvserve:request_slo_total, by (target, outcome)."""
    before = outcomes(server)
    send()
    after = outcomes(server)
    return {key: after[key] - before[key] for key in after if after[key] != before[key]}


def test_header_body_and_key_file_targets_are_counted_as_clients_saw_them(server):
    assert counted(server, lambda: complete(server)) == {}
    header = {"x-slo-ttft-ms": str(UNMEETABLE), "x-slo-tpot-ms": str(EASY)}
    assert counted(server, lambda: complete(server, extra_headers=header)) == {
        ("ttft", "missed"): 1,
        ("tpot", "met"): 1,
    }
    body = {"slo": {"ttft_ms": EASY}}
    assert counted(server, lambda: complete(server, extra_body=body)) == {("ttft", "met"): 1}
    # The body wins over a header; the tenant's column applies where the request names none.
    both = {"extra_body": body, "extra_headers": {"x-slo-ttft-ms": str(UNMEETABLE)}}
    assert counted(server, lambda: complete(server, **both)) == {("ttft", "met"): 1}
    assert counted(server, lambda: complete(server, "sk-fast")) == {("ttft", "missed"): 1}
    assert counted(server, lambda: complete(server, "sk-fast", extra_body=body)) == {
        ("ttft", "met"): 1
    }
    tenant = outcomes(server)  # the per-tenant series holds the key file tenant's
    text = metrics_text(server.url)
    fast_missed = read_metric(
        text, "kvserve:tenant_request_slo_total", tenant="fast", target="ttft", outcome="missed"
    )
    assert fast_missed == 1 and tenant[("ttft", "missed")] >= 2
    assert read_metric(text, "kvserve:slo_goodput_requests_per_second") > 0
    assert read_metric(text, "kvserve:step_time_prediction_error") >= 0


def _step_sizes(server: ServeProcess) -> tuple[float, float]:
    """kvserve:iteration_tokens_total: (steps of at most 16 tokens, all steps)."""
    text = metrics_text(server.url)
    small = read_metric(text, "kvserve:iteration_tokens_total_bucket", le="16.0")
    return small, read_metric(text, "kvserve:iteration_tokens_total_count")


def test_a_key_file_target_stands_for_every_request_from_the_first_step(server):
    # The key file gives `fast` a TTFT target: the launcher turned on the engine's start-up
    # timing of prompt steps, and every request carries that target as its standing one, so
    # a request of a tenant without one (plain), alone on the engine, is prefilled in steps
    # that leave room for a `fast` request arriving: here the fewest prompt tokens a step
    # holds, 16 (0.01 ms is out of reach), where one step would otherwise take all 200.
    assert "prompt step costs for the latency targets" in server.log()
    small_before, all_before = _step_sizes(server)
    client(server).completions.create(
        model=DP_MODEL_NAME, prompt=[5] * 200, max_tokens=1, temperature=0
    )
    small_after, all_after = _step_sizes(server)
    assert all_after - all_before >= 200 / 16
    assert small_after - small_before == all_after - all_before


def test_every_surface_takes_the_body_field(server):
    slo = {"slo": {"ttft_ms": EASY, "tpot_ms": EASY}}
    messages = [{"role": "user", "content": "hello"}]

    def chat():
        client(server).chat.completions.create(
            model=DP_MODEL_NAME, messages=messages, max_tokens=3, extra_body=slo
        )

    def responses():
        client(server).responses.create(
            model=DP_MODEL_NAME, input="hello", max_output_tokens=3, extra_body=slo
        )

    def message():
        anthropic.Anthropic(base_url=server.url, api_key="sk-plain", max_retries=0).messages.create(
            model=DP_MODEL_NAME, messages=messages, max_tokens=3, extra_body=slo
        )

    for send in (chat, responses, message):
        added = counted(server, send)
        assert added.get(("ttft", "met")) == 1 and "ttft" not in {
            t for t, o in added if o == "missed"
        }


@pytest.mark.parametrize(
    "slo", [{"ttft_ms": 0}, {"ttft_ms": -5}, {"ttft_ms": "fast"}, {"deadline_ms": 5}, 250]
)
def test_bad_targets_are_400s(server, slo):
    with pytest.raises(openai.BadRequestError):
        complete(server, extra_body={"slo": slo})
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic.Anthropic(base_url=server.url, api_key="sk-plain", max_retries=0).messages.create(
            model=DP_MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            extra_body={"slo": slo},
        )
    assert info.value.response.json()["type"] == "error"


def test_a_bad_header_is_a_400(server):
    with pytest.raises(openai.BadRequestError) as info:
        complete(server, extra_headers={"x-slo-tpot-ms": "soon"})
    assert "x-slo-tpot-ms" in info.value.response.json()["error"]["message"]


def test_reject_answers_503_for_a_target_out_of_reach(rejecting_server):
    server = rejecting_server
    # Without history the estimate is 0: the first request is served, and gives it one.
    assert complete(server, extra_body={"slo": {"ttft_ms": UNMEETABLE}}).choices
    with pytest.raises(openai.InternalServerError) as info:
        complete(server, extra_body={"slo": {"ttft_ms": UNMEETABLE}})
    response = info.value.response
    assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1
    assert "TTFT target of 0.01 ms" in response.json()["error"]["message"]
    # A reachable target, and no target, are served as before.
    assert complete(server, extra_body={"slo": {"ttft_ms": EASY}}).choices
    assert complete(server).choices


def test_a_bad_key_file_target_stops_start_up_naming_the_line(tiny_llama_dir, tmp_path):
    key_file = tmp_path / "keys.txt"
    key_file.write_text("plain:sk-plain\nfast:sk-fast slo_ttft_ms=-3\n")
    server = start_tiny_server(tiny_llama_dir, tmp_path, "--api-key-file", str(key_file))
    try:
        exit_code = server.process.wait(timeout=120)
    finally:
        server.stop()
    assert exit_code != 0
    assert "line 2: slo_ttft_ms must be a positive number" in server.log()
