"""compose.yaml for real: `make compose-up` builds the image and starts the stack (api,
coordinator, two engines), the official openai client talks to it on localhost, an engine is
killed, and `make compose-down` leaves no container or network of the project behind.

Where Docker Hub cannot be reached, `make compose-up` seeds the base image with debootstrap;
where PyPI's CPU torch index cannot, it builds from ./wheelhouse (both cached under
~/.cache/kvserve/docker). It runs as its own compose project, so a user's stack is left alone;
its model-cache volume is kept for the next run.

Without a Docker engine it skips, except in CI (CI=true), where it fails: `.ci/run` starts
dockerd.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.support import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.docker]

PROJECT = "kvserve-test"
PORT = int(os.environ.get("KVSERVE_TEST_COMPOSE_PORT", "8000"))
BASE_URL = f"http://127.0.0.1:{PORT}"
MODEL = "SmolLM2-135M-Instruct"
# compose.yaml as users run it, with the engines' start-up timings off (as for every engine
# of the suite): tests/data/compose/measure-off.yaml laid over it.
COMPOSE_FILES = ["compose.yaml", "tests/data/compose/measure-off.yaml"]
ENV = {
    **os.environ,
    "COMPOSE_PROJECT_NAME": PROJECT,
    "KVSERVE_PORT": str(PORT),
    "COMPOSE_FILE": os.pathsep.join(COMPOSE_FILES),
}
# Cold here: 170 s (seed the base image, make the wheelhouse, build, convert, load); the
# whole module stays under 8 minutes.
UP_TIMEOUT_S = 400


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _compose() -> list[str] | None:
    """The compose command `make` uses: the v2 plugin, else Debian's docker-compose."""
    if shutil.which("docker") and _run(["docker", "compose", "version"]).returncode == 0:
        return ["docker", "compose"]
    tool = shutil.which("docker-compose")
    return [tool] if tool else None


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def _docker_missing() -> str | None:
    """Why the stack cannot run here, or None."""
    if shutil.which("docker") is None:
        return "no docker client"
    info = _run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=30)
    if info.returncode != 0:
        return f"no Docker engine answers ({info.stderr.strip()[-200:]}); .ci/run starts dockerd"
    if _compose() is None:
        return "no docker compose (`make test` installs Debian's docker-compose)"
    return None


def _project_leftovers() -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={PROJECT}"
    return {
        kind: _run(["docker", *args, "--filter", label, "--format", "{{.Names}}"]).stdout.split()
        for kind, args in (("containers", ["ps", "-a"]), ("networks", ["network", "ls"]))
    }


def _logs(compose: list[str]) -> str:
    return (
        _run([*compose, "ps"]).stdout
        + _run([*compose, "logs", "--no-color", "--tail", "150"]).stdout
    )


def _make(target: str, timeout: float) -> subprocess.CompletedProcess:
    return _run(["make", "--no-print-directory", target], timeout=timeout)


@pytest.fixture(scope="module")
def compose() -> list[str]:
    reason = _docker_missing()
    if reason is not None:
        if _in_ci():
            pytest.fail(f"the compose stack test must run in CI: {reason}")
        pytest.skip(reason)
    compose = _compose()
    _make("compose-down", timeout=120)  # a stack a failed run left
    started = time.monotonic()
    try:
        up = _make("compose-up", timeout=UP_TIMEOUT_S)
        failure = None if up.returncode == 0 else f"{up.stdout[-6000:]}\n{up.stderr[-3000:]}"
    except subprocess.TimeoutExpired as exc:
        failure = f"no healthy stack within {UP_TIMEOUT_S} s:\n{exc.stdout!s:.6000}"
    if failure is not None:
        logs = _logs(compose)
        _make("compose-down", timeout=120)
        pytest.fail(f"make compose-up failed: {failure}\n{logs}")
    print(f"make compose-up: {time.monotonic() - started:.0f} s")
    yield compose
    _make("compose-down", timeout=120)


@pytest.fixture(autouse=True)
def logs_on_failure(request, compose):
    """Print the containers' logs after a failed test (pytest shows them with the failure)."""
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        print(_logs(compose))


@pytest.fixture(scope="module")
def client(compose) -> OpenAI:
    return OpenAI(base_url=BASE_URL + "/v1", api_key="unused", max_retries=0, timeout=120)


def _requests_by_engine() -> dict[str, float]:
    """kvserve:request_success summed per `engine` label, from the api's /metrics."""
    text = httpx.get(BASE_URL + "/metrics", timeout=10).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvserve:request_success_total":
                engine = sample.labels["engine"]
                counts[engine] = counts.get(engine, 0.0) + sample.value
    return counts


def test_completions_and_chat_plain_and_streamed(client):
    completion = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0
    )
    assert completion.choices[0].text and completion.usage.completion_tokens > 0
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
    )
    assert chat.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=16,
        stream=True,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    streamed = client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=8, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)


def test_a_json_schema_holds_in_the_image_without_triton(compose, client):
    # The CPU image leaves out Triton (the Dockerfile's deps stage): xgrammar asks for it only
    # for its CUDA kernel, and compiles and matches grammars without it.
    probe = "import importlib.util; print(importlib.util.find_spec('triton') is None)"
    found = _run([*compose, "exec", "-T", "engine-0", "python", "-c", probe])
    assert found.stdout.strip() == "True", (found.stdout, found.stderr)
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "enum": ["Paris", "Lyon", "Rome"]}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        max_tokens=32,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "capital", "schema": schema, "strict": True},
        },
    )
    answer = json.loads(chat.choices[0].message.content)
    assert set(answer) == {"capital"} and answer["capital"] in ("Paris", "Lyon", "Rome"), answer


def test_requests_reach_both_engines(client):
    for i in range(6):  # idle engines tie: the router takes them in turn
        client.completions.create(model=MODEL, prompt=f"Request {i}:", max_tokens=4)
    counts = _requests_by_engine()
    assert counts.get("0", 0) > 0 and counts.get("1", 0) > 0, counts


def test_killed_engine_degrades_health_and_the_other_serves_on(compose, client):
    killed = _run([*compose, "kill", "engine-1"])
    assert killed.returncode == 0, killed.stderr
    # Another container is another host to the api, which cannot watch its processes: it is
    # dead once the api finds it unreachable (its connection closed), at the latest after the
    # hung budget of silence (KVSERVE_ENGINE_HUNG_TIMEOUT_S, 30 s; suspect meanwhile).
    deadline = time.monotonic() + 45
    health = httpx.get(BASE_URL + "/health", timeout=10).json()
    while health["engines"][1]["state"] != "dead" and time.monotonic() < deadline:
        time.sleep(0.5)
        health = httpx.get(BASE_URL + "/health", timeout=10).json()
    assert health["status"] == "degraded", health
    states = {entry["engine"]: entry["state"] for entry in health["engines"]}
    assert states == {0: "serving", 1: "dead"}, health

    before = _requests_by_engine()
    for i in range(3):
        completion = client.completions.create(model=MODEL, prompt=f"Again {i}:", max_tokens=4)
        assert completion.choices[0].text is not None
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    after = _requests_by_engine()
    assert after["0"] - before.get("0", 0) == 4 and after.get("1") == before.get("1"), after


def test_compose_down_leaves_no_container_or_network(compose):
    down = _make("compose-down", timeout=120)
    assert down.returncode == 0, down.stderr
    assert _project_leftovers() == {"containers": [], "networks": []}
