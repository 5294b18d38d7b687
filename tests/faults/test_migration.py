"""Request migration: an engine core's death costs no request
(services/api/engine_client/migration.py).

Real `kvserve serve` processes of the tiny random Llama, real HTTP through the official
openai client, real SIGKILLs. Each test first runs its requests on an undisturbed server
(the reference), then again with a death in the middle of the streams, and asserts that
every stream ended as it does without the death: no error, the same tokens (greedy and
seeded sampling alike), logprobs for every token, a structured output that validates, and
no KV block left on the engines that served on.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from unittest import mock

import httpx
import jsonschema
import openai
import psutil
import pytest

from tests.support.metrics import metrics_text, read_metric
from tests.support.otlp import Receiver
from tests.support.server import (
    DP_MODEL_NAME,
    Generating,
    ServeProcess,
    start_dp_front_end,
    start_tiny_server,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}assistant:"
MAX_TOKENS = 300  # the tiny model holds 512 tokens
# A long bounded string of ASCII letters (the byte-level tiny tokenizer would write invalid
# UTF-8 otherwise): the random model's answer is mid-stream at the kill.
LONG_TEXT = {
    "type": "object",
    "properties": {"text": {"type": "string", "pattern": "^[a-z]{150,180}$"}},
    "required": ["text"],
    "additionalProperties": False,
}


@dataclass
class Stream:
    """One streamed request and what came back."""

    kind: str  # greedy, seeded or json
    index: int
    prompt: str | list[int] | None = None  # None: "stream {index}: once upon a time"
    max_tokens: int = MAX_TOKENS
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    request_id: str = ""


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _run(url: str, stream: Stream) -> None:
    """Stream one request into `stream` (in a thread): three kinds, each with its checks."""
    client = _client(url)
    try:
        if stream.kind == "json":
            chunks = client.chat.completions.create(
                model=DP_MODEL_NAME,
                messages=[{"role": "user", "content": f"JSON number {stream.index}"}],
                max_tokens=MAX_TOKENS,
                temperature=1.0,
                seed=1000 + stream.index,
                stream=True,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "long_text", "schema": LONG_TEXT},
                },
            )
            for chunk in chunks:
                stream.request_id = chunk.id
                if chunk.choices:
                    stream.text += chunk.choices[0].delta.content or ""
                    stream.finish_reason = chunk.choices[0].finish_reason or stream.finish_reason
            return
        seeded = stream.kind == "seeded"
        chunks = client.completions.create(
            model=DP_MODEL_NAME,
            prompt=stream.prompt or f"stream {stream.index}: once upon a time",
            max_tokens=stream.max_tokens,
            temperature=1.0 if seeded else 0.0,
            seed=stream.index if seeded else None,
            logprobs=2,
            stream=True,
            # top_k: the random model's flat distribution puts a token boundary of the draw
            # every 1/257; float32 rounding between the original decode and the recompute
            # moves them (~1e-7), which a draw at a boundary would feel. 8 of them are few.
            extra_body={"ignore_eos": True, **({"top_k": 8} if seeded else {})},
        )
        for chunk in chunks:
            stream.request_id = chunk.id
            choice = chunk.choices[0]
            stream.text += choice.text
            if choice.logprobs is not None:
                stream.tokens += choice.logprobs.tokens or []
                stream.logprobs += choice.logprobs.token_logprobs or []
            stream.finish_reason = choice.finish_reason or stream.finish_reason
    except openai.OpenAIError as exc:
        stream.error = repr(exc)


def _streams() -> list[Stream]:
    return [Stream(kind, i) for i in range(4) for kind in ("greedy", "seeded")] + [
        Stream("json", 0),
        Stream("json", 1),
    ]


class KillMidStream:
    """Once the engine core running the most requests is mid-stream (Generating), SIGSTOP
    it: none of its streams can end now, and those that were to start there wait there.
    SIGKILL it half a second later (`victim`: its /health entry)."""

    def __init__(self, server: ServeProcess):
        self.generating = Generating(server)
        self.victim: dict = {}

    def __call__(self) -> None:
        self.victim = self.generating.busiest()
        pid = self.victim["pid"]
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)


def _run_all(url: str, on_started: Callable[[], None] | None = None) -> list[Stream]:
    """Run every stream at once, and `on_started()` (a kill) in a thread beside them."""
    return _run_beside(url, _streams(), on_started)


def _run_beside(
    url: str, streams: list[Stream], on_started: Callable[[], None] | None
) -> list[Stream]:
    """Run `streams` at once; `on_started()`, if any, in a thread of its own as they are
    sent (it waits for its own moment, from the server's state)."""
    with concurrent.futures.ThreadPoolExecutor(len(streams) + 1) as pool:
        started = pool.submit(on_started) if on_started is not None else None
        for future in [pool.submit(_run, url, stream) for stream in streams]:
            future.result(timeout=180)
        if started is not None:
            started.result(timeout=180)  # its own failure fails the test
    return streams


def _assert_same(streams: list[Stream], reference: list[Stream]) -> None:
    for stream, expected in zip(streams, reference):
        name = f"{stream.kind} stream {stream.index}"
        assert stream.error is None, f"{name}: {stream.error}"
        assert stream.finish_reason == expected.finish_reason, name
        assert stream.text == expected.text, f"{name} differs from the undisturbed run"
        if stream.kind == "json":
            jsonschema.validate(json.loads(stream.text), LONG_TEXT)
            continue
        assert stream.finish_reason == "length"
        assert len(stream.tokens) == len(stream.logprobs) == stream.max_tokens, name
        assert stream.tokens == expected.tokens, name
        # The same positions' logprobs (a shifted or repeated token would be off by O(1)).
        # A moved stream decodes in other batches than the undisturbed run, so its steps
        # can take other float32 kernel paths (decode stack, torch, oneDNN by row count):
        # they agree to ~1e-6, with a rare position measured 4e-4 apart (relative), far
        # after the resume point; the resume itself is exact to ~3e-6 (engine side).
        assert stream.logprobs == pytest.approx(expected.logprobs, rel=1e-3, abs=1e-5), name


def _engine_pids(server: ServeProcess) -> list[int]:
    _, body = server.health()
    return [engine["pid"] for engine in body["engines"]]


def _assert_engine_idle(server: ServeProcess, engine: int) -> None:
    """The engine holds no request and no KV block (cached ones are free)."""

    def idle() -> bool:
        text = metrics_text(server.url)
        return all(
            read_metric(text, name, engine=str(engine)) == 0
            for name in (
                "kvserve:num_requests_running",
                "kvserve:num_requests_waiting",
                "kvserve:kv_cache_usage_perc",
            )
        )

    assert wait_until(idle, timeout_s=30), f"engine {engine} still holds requests or blocks"


@contextlib.contextmanager
def _healthy(server: ServeProcess) -> Iterator[ServeProcess]:
    """The server once healthy; stopped on the way out."""
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def _moved_kinds(server: ServeProcess, streams: list[Stream]) -> set[str]:
    log = server.log()
    return {s.kind for s in streams if f"request {s.request_id} moved" in log}


def _summed(text: str, name: str, **labels: str) -> float:
    """The sum of a series' samples that carry `labels`, over every engine."""
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and all(label in line for label in wanted)
    )


def _migrations(server: ServeProcess, reason: str) -> float:
    """Requests moved off any engine core that died for `reason`."""
    return _summed(metrics_text(server.url), "kvserve:request_migrations_total", reason=reason)


# The streams' JSON kind needs a compact grammar; the chat kind, a template.
JSON_AND_CHAT_FLAGS = (
    "--structured-outputs-config",
    '{"disable_any_whitespace": true}',
    "--chat-template",
    CHAT_TEMPLATE,
)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """An OTLP collector for the server's --otlp-traces-endpoint."""
    receiver = Receiver()
    yield receiver
    receiver.server.shutdown()


@pytest.fixture
def dp_server(tiny_llama_dir, tmp_path_factory, receiver):
    # Traced, exporting every 50 ms: a moved request's trace gets its `migrate` span.
    with mock.patch.dict(os.environ, {"OTEL_BSP_SCHEDULE_DELAY": "50"}):
        server = start_dp_front_end(
            tiny_llama_dir,
            tmp_path_factory.mktemp("migration-dp"),
            *JSON_AND_CHAT_FLAGS,
            # Two streams at a time an engine: the rest wait in it, so an engine stays mid-
            # stream for several of the tiny model's 300-token runs, a window a loaded
            # machine's /health poller (KillMidStream) cannot miss.
            "--max-num-seqs",
            "2",
            "--otlp-traces-endpoint",
            receiver.url,
        )
    with _healthy(server):
        yield server


def _assert_moves_traced(
    receiver: Receiver, streams: list[Stream], log: str, victim: int, survivor: int
) -> None:
    """Each moved request's trace has one `migrate` span per move under its `generate` span,
    from the victim to the survivor; the others have none."""
    moved = {s.request_id for s in streams if f"request {s.request_id} moved" in log}
    ids = {s.request_id for s in streams}

    def generate_spans() -> dict[str, dict]:
        return {
            span["attributes"]["request_id"].string_value: span
            for span in list(receiver.spans)
            if span["name"] == "generate"
        }

    assert wait_until(lambda: ids <= set(generate_spans())), "traces were not exported"
    generate = generate_spans()
    migrates = [span for span in list(receiver.spans) if span["name"] == "migrate"]
    for request_id in ids:
        under = [m for m in migrates if m["parent_id"] == generate[request_id]["span_id"]]
        if request_id not in moved:
            assert under == [], request_id
            continue
        (move,) = under
        attributes = move["attributes"]
        assert attributes["from_engine"].int_value == victim
        assert attributes["to_engine"].int_value == survivor
        assert attributes["reason"].string_value == "engine_died"
        assert move["start"] <= move["end"]


def test_a_killed_engine_streams_resume_on_the_other(dp_server, receiver):
    reference = _run_all(dp_server.url)
    _assert_same(reference, reference)  # no errors, full lengths, valid JSON
    kill = KillMidStream(dp_server)

    streams = _run_all(dp_server.url, kill)
    assert kill.victim, "no engine got far enough to kill"

    _assert_same(streams, reference)
    victim = kill.victim["engine"]
    survivor = 1 - victim
    # Placement decides which kinds sat on the victim; the one-engine test moves them all.
    assert _moved_kinds(dp_server, streams), "no stream was on the killed engine"
    assert _migrations(dp_server, "engine_died") >= 1
    text = metrics_text(dp_server.url)
    assert read_metric(text, "kvserve:request_migrations_total", engine=str(survivor)) == 0
    resumed = read_metric(
        text, "kvserve:request_migration_resume_seconds_count", engine=str(victim)
    )
    assert resumed == _migrations(dp_server, "engine_died")  # each moved stream resumed
    _assert_engine_idle(dp_server, survivor)
    assert f"moved to engine core {survivor}" in dp_server.log()
    status, body = dp_server.health()
    assert status == 200 and body["engines"][victim]["state"] == "dead", body
    _assert_moves_traced(receiver, streams, dp_server.log(), victim, survivor)


@pytest.fixture
def restarting_server(tiny_llama_dir, tmp_path_factory):
    """One engine core, restarted when it dies."""
    server = start_tiny_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("migration-restart"),
        "--restart-dead-engines",
        *JSON_AND_CHAT_FLAGS,
    )
    with _healthy(server):
        yield server


def test_one_engine_streams_wait_for_its_restart(restarting_server):
    server = restarting_server
    reference = _run_all(server.url)
    (victim,) = _engine_pids(server)

    # The engine is paused before the streams are sent and killed once the api has sent it
    # every one (its own count): each kind is surely on it. (A kill timed from a loaded
    # client's chunks could come after the fast ones, the JSON streams, ended.)
    num_streams = len(_streams())

    def kill_once_sent() -> None:
        def sent() -> bool:
            (engine,) = server.health()[1]["engines"]
            return engine["num_in_flight"] == num_streams

        assert wait_until(sent, timeout_s=60), server.health()[1]
        os.kill(victim, signal.SIGKILL)

    killer = threading.Thread(target=kill_once_sent)
    os.kill(victim, signal.SIGSTOP)
    try:
        killer.start()
        streams = _run_all(server.url)
    finally:
        killer.join(timeout=120)
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)

    _assert_same(streams, reference)
    assert _moved_kinds(server, streams) == {"greedy", "seeded", "json"}
    assert _migrations(server, "engine_died") >= 1
    (pid,) = _engine_pids(server)
    assert pid != victim and psutil.pid_exists(pid)
    _assert_engine_idle(server, 0)


POISON_TOKEN_ID = 255  # the byte 0xff: no ASCII prompt holds it


@pytest.fixture
def poisoned_server(tiny_llama_dir, tmp_path_factory):
    """Two engine cores, restarted when they die, which die on a prompt holding
    POISON_TOKEN_ID (the test hook KVSERVE_FAULT_POISON_TOKEN_ID); a request moves once at
    most for a death it may have caused."""
    os.environ["KVSERVE_FAULT_POISON_TOKEN_ID"] = str(POISON_TOKEN_ID)
    try:
        server = start_dp_front_end(
            tiny_llama_dir,
            tmp_path_factory.mktemp("migration-poison"),
            "--restart-dead-engines",
            "--max-request-migrations",
            "1",
        )
    finally:
        del os.environ["KVSERVE_FAULT_POISON_TOKEN_ID"]
    with _healthy(server):
        yield server


def _run_greedy(url: str, on_started=None, token_prompts: bool = False) -> list[Stream]:
    """Six greedy streams at once; `on_started()` runs in a thread beside them.

    Args:
        token_prompts: prompts of token ids below 100, and 200 tokens (for the
            tensor-parallel model, which borrows the default model's tokenizer for its 128
            ids and holds 256 tokens).
    """
    streams = [
        Stream("greedy", i, [1 + i, 2 + i, 3 + i], 200) if token_prompts else Stream("greedy", i)
        for i in range(6)
    ]
    return _run_beside(url, streams, on_started)


def test_a_poison_request_is_quarantined_and_the_others_finish(poisoned_server):
    server = poisoned_server
    reference = _run_greedy(server.url)
    first_pids = set(_engine_pids(server))
    poison: dict = {}

    def send_poison() -> None:
        try:
            _client(server.url).completions.create(
                model=DP_MODEL_NAME, prompt=[65, 66, POISON_TOKEN_ID], max_tokens=8
            )
            poison["error"] = None
        except openai.OpenAIError as exc:
            poison["error"] = exc

    pids = _engine_pids(server)

    def send_poison_once_all_run() -> None:
        # Sent once every bystander is on an engine and produced tokens there (the api's
        # own counts), so they move as bystanders: the engines are paused until all six
        # are sent, so each engine's first steps run all of its own.
        def all_sent() -> bool:
            return sum(e["num_in_flight"] for e in server.health()[1]["engines"]) == 6

        assert wait_until(all_sent, timeout_s=60, interval_s=0.01), server.health()
        engines = server.health()[1]["engines"]
        base = {e["engine"]: e["num_generated_tokens"] for e in engines}
        for pid in pids:
            os.kill(pid, signal.SIGCONT)

        def all_running() -> bool:
            return all(
                e["num_generated_tokens"] - base[e["engine"]] >= 2 * e["num_in_flight"]
                for e in server.health()[1]["engines"]
            )

        assert wait_until(all_running, timeout_s=60, interval_s=0.01), server.health()
        send_poison()

    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        streams = _run_greedy(server.url, on_started=send_poison_once_all_run)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    _assert_same(streams, reference)  # the bystanders moved (twice, some) and finished
    error = poison["error"]
    assert isinstance(error, openai.APIStatusError), poison
    assert error.status_code == 503
    assert "quarantined" in str(error) and "--max-request-migrations" in str(error)
    text = metrics_text(server.url)
    assert _summed(text, "kvserve:request_migrations_failed_total", cause="quarantined") == 1
    assert "is quarantined" in server.log()
    # Both engine cores died of it (the first one it landed on and the one it moved to), were
    # restarted, and serve again.
    assert wait_until(lambda: server.health()[1]["status"] == "healthy", timeout_s=60)
    assert not first_pids & set(_engine_pids(server))
    assert server.complete("still serving") != ""


@pytest.fixture
def tp_server(default_model_dir, tmp_path_factory):
    """Two engine cores of two tensor-parallel workers each."""
    from tests.support.models import save_tiny_parallel_llama

    model_dir = save_tiny_parallel_llama(str(tmp_path_factory.mktemp("tiny-tp-llama")))
    server = start_dp_front_end(
        model_dir,
        tmp_path_factory.mktemp("migration-tp"),
        "--tokenizer",
        default_model_dir,  # the TP model's 128 ids are the first of this vocabulary
        "--tensor-parallel-size",
        "2",
    )
    with _healthy(server):
        yield server


def test_a_killed_worker_streams_resume_on_the_other_engine(tp_server):
    reference = _run_greedy(tp_server.url, token_prompts=True)
    victim: dict = {}
    generating = Generating(tp_server)

    def kill_worker() -> None:
        victim.update(generating.busiest())
        psutil.Process(victim["pid"]).children()[-1].send_signal(signal.SIGKILL)

    streams = _run_greedy(tp_server.url, kill_worker, token_prompts=True)

    _assert_same(streams, reference)
    assert _moved_kinds(tp_server, streams) == {"greedy"}
    assert _migrations(tp_server, "worker_died") >= 1
    _assert_engine_idle(tp_server, 1 - victim["engine"])


@pytest.fixture
def pd_server(tiny_llama_dir, tmp_path_factory):
    """P/D: one prefill engine core and two decode engine cores, a KV store between them."""
    server = start_tiny_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("migration-pd"),
        "--prefill-size",
        "1",
        "--decode-size",
        "2",
        "--kv-store-size",
        "64M",
    )
    with _healthy(server):
        yield server


def test_pd_a_killed_decode_engine_streams_resume_through_the_store(pd_server):
    reference = _run_greedy(pd_server.url)
    _, body = pd_server.health()
    decode = [e for e in body["engines"] if e.get("kv_role") == "kv_consumer"]
    assert [e["engine"] for e in decode] == [1, 2], body
    loaded_before = {
        i: pd_server.metric("kvserve:external_prefix_cache_hits_total", i) for i in (1, 2)
    }
    pids = {e["engine"]: e["pid"] for e in decode}
    victim: dict = {}

    def kill_decode_engine() -> None:
        # Once every stream's prefill is done and its request sent to a paused decode engine
        # (the api's own count), the one sent the most dies; the other goes on.
        def routed() -> bool:
            _, body = pd_server.health()
            sent = [e for e in body["engines"] if e["engine"] in pids]
            victim.update(max(sent, key=lambda e: (e["num_in_flight"], e["engine"])))
            return sum(e["num_in_flight"] for e in sent) == 6

        assert wait_until(routed, timeout_s=60), victim
        os.kill(victim["pid"], signal.SIGKILL)
        os.kill(pids[3 - victim["engine"]], signal.SIGCONT)

    # Paused before the streams are sent: none can end before the kill. (A loaded client
    # reads far behind the server, and the tiny model ends 300 tokens in well under a second:
    # a kill timed from the streams could come after they all ended.)
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)
    try:
        streams = _run_greedy(pd_server.url, kill_decode_engine)
    finally:
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    _assert_same(streams, reference)
    assert _moved_kinds(pd_server, streams) == {"greedy"}
    # The moved streams' prompts and emitted tokens went through a prefill copy into the
    # store, and the surviving decode engine loaded them rather than computing them.
    survivor = 3 - victim["engine"]
    loaded = pd_server.metric("kvserve:external_prefix_cache_hits_total", survivor)
    assert loaded > loaded_before[survivor]
    _assert_engine_idle(pd_server, survivor)


@pytest.fixture
def shared_store_server(tiny_llama_dir, tmp_path_factory):
    """Two engine cores that both save to and load from one KV store (kv_both)."""
    from tests.support.kv_store import StoreProcess

    store = StoreProcess("--size", "64M")
    transfer = {
        "kv_connector": "KvStoreConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store_address": store.ipc, "timeout_s": 2.0},
    }
    server = start_dp_front_end(
        tiny_llama_dir,
        tmp_path_factory.mktemp("migration-kv-both"),
        "--kv-transfer-config",
        json.dumps(transfer),
    )
    try:
        with _healthy(server):
            yield server
    finally:
        store.stop()


def test_kv_both_a_moved_stream_loads_its_blocks_from_the_store(shared_store_server):
    server = shared_store_server
    reference = _run_greedy(server.url)
    # The engines forget their own prefixes: what the moved streams find comes from the store.
    assert httpx.post(server.url + "/reset_prefix_cache", timeout=30).status_code == 200
    victim: dict = {}
    generating = Generating(server)

    def kill_busiest() -> None:
        victim.update(generating.busiest())
        os.kill(victim["pid"], signal.SIGKILL)

    streams = _run_greedy(server.url, kill_busiest)

    _assert_same(streams, reference)
    log = server.log()
    moved = [s for s in streams if f"request {s.request_id} moved" in log]
    assert moved, "no stream was on the killed engine"
    block_size = 16
    for stream in moved:
        emitted = int(
            re.search(rf"request {stream.request_id} moved .* with (\d+) emitted", log)[1]
        )
        prompt, cached = map(
            int,
            re.search(
                rf"request {stream.request_id} finished \(length\): (\d+) prompt \+ \d+ output "
                rf"tokens, (\d+) cached",
                log,
            ).groups(),
        )
        # Every full block of prompt + emitted tokens but the last token's was a hit.
        assert cached >= (prompt + emitted - 1) // block_size * block_size, (prompt, emitted)
    survivor = 1 - victim["engine"]
    assert server.metric("kvserve:external_prefix_cache_hits_total", survivor) > 0
    _assert_engine_idle(server, survivor)
