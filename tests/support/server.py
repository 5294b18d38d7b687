"""`kvserve` CLI processes as a user runs them: launch, wait for /health, stream, stop.

Every launch goes through `start_kvserve` (`python -m kvserve.cli ARGS`, stdout and stderr in
a log file that failure messages quote). On top of it:

- `start_serve`: `kvserve serve` of a tiny model, handled as a plain Popen;
- `serving`: a context manager around `kvserve serve ARGS` that yields its base URL;
- `ServeProcess`: `kvserve serve` in a session of its own, with /health, per-engine
  /metrics and a stop that checks no descendant outlives it (the data-parallel tests).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterator

import httpx
import openai
import psutil

from tests.support.engine import ENGINE_READY_TIMEOUT_S
from tests.support.http import http_get
from tests.support.metrics import metrics_text, read_metric
from tests.support.models import TINY_KV_CACHE_MEMORY
from tests.support.ports import free_port
from tests.support.processes import wait_gone
from tests.support.waiting import wait_until

# The tiny model's engines answer in milliseconds: take a silent one for suspect after 3 s
# (dead only once hung: KVSERVE_ENGINE_HUNG_TIMEOUT_S, 30 s by default).
FAST_HEARTBEAT_ENV = {"KVSERVE_ENGINE_HEARTBEAT_TIMEOUT_S": "3"}
DP_MODEL_NAME = "tiny-dp"
NUM_DP_ENGINES = 2


def start_kvserve(
    args: list[str], log_path: str, env: dict[str, str] | None = None, new_session: bool = False
) -> subprocess.Popen:
    """`kvserve ARGS`, its stdout and stderr in log_path.

    Args:
        args: everything after `kvserve`, as in ["serve", model_dir, "--port", "8000"].
        log_path: the log file (overwritten).
        env: its environment (default: this process's).
        new_session: start it in a session of its own, so os.killpg reaches every
            descendant.
    """
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "kvserve.cli", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=new_session,
        )


def read_log(log_path: str) -> str:
    """A launched process's log so far, for failure messages."""
    with open(log_path) as f:
        return f.read()


def health_status(port: int) -> int | None:
    """/health's status on 127.0.0.1:port, or None when nothing answers."""
    try:
        return http_get(f"http://127.0.0.1:{port}/health", timeout=2).status_code
    except httpx.TransportError:
        return None


def wait_healthy(
    process: subprocess.Popen, port: int, log_path: str, timeout_s: float = ENGINE_READY_TIMEOUT_S
) -> None:
    """Wait until /health answers 200; fails the test, quoting the log, if the process exits
    first or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"kvserve exited early:\n{read_log(log_path)}"
        if health_status(port) == 200:
            return
        # The suite starts ~90 servers: a 0.5 s poll added ~0.25 s to each start.
        time.sleep(0.1)
    raise AssertionError(f"kvserve not healthy in {timeout_s} s:\n{read_log(log_path)}")


def start_serve(model_dir: str, port: int, log_path: str) -> subprocess.Popen:
    """`kvserve serve MODEL` of a tiny model on 127.0.0.1:port, not waited for."""
    # A generous drain: a loaded 2-core machine may need long for one request's tokens.
    args = [
        "serve",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kv-cache-memory",
        str(TINY_KV_CACHE_MEMORY),
        "--shutdown-timeout",
        "120",
    ]
    return start_kvserve(args, log_path, env={**os.environ, **FAST_HEARTBEAT_ENV})


@contextlib.contextmanager
def serving(serve_args: list[str], log_path: str) -> Iterator[str]:
    """`kvserve serve --host 127.0.0.1 --port P *serve_args`, healthy; yields its base URL and
    stops it (SIGTERM, then SIGKILL after a minute) on exit."""
    port = free_port()
    process = start_kvserve(
        ["serve", "--host", "127.0.0.1", "--port", str(port), *serve_args], log_path
    )
    try:
        wait_healthy(process, port, log_path)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def serving_default_model(tmp_path_factory, name: str, *flags: str) -> Iterator[str]:
    """`serving` of the embedded default model as `name`, with the e2e tests' small footprint
    (max_model_len 1024, a 256 MiB KV cache, uvicorn's warnings only); `flags` come after
    and win. The log goes to a new temporary folder named after `name`."""
    log_path = str(tmp_path_factory.mktemp(name) / "serve.log")
    common = ["--served-model-name", name, "--max-model-len", "1024", "--kv-cache-memory", "256M"]
    with serving([*common, "--uvicorn-log-level", "warning", *flags], log_path) as url:
        yield url


class ServeProcess:
    """`kvserve serve ARGS` in a session of its own, so cleanup reaches every descendant.

    Under pytest-xdist, its engines take this test worker's OMP_NUM_THREADS (its share of
    the cores, tests/conftest.py), as the suite's other engines do: a lone engine given
    every core beside the other worker's tests oversubscribes them. Run alone, or with
    split_cores, OMP_NUM_THREADS is unset, so the launcher splits the cores among its
    engines (the product default).

    Args:
        args: the flags after `kvserve serve`.
        log_path: where its stdout and stderr go.
        port: its HTTP port (None: a headless node).
        served_model_name: the model name its completions ask for.
        env: environment variables that win over this process's and FAST_HEARTBEAT_ENV.
        split_cores: unset OMP_NUM_THREADS (the tests of the launcher's split).
    """

    def __init__(
        self,
        args: list[str],
        log_path: str,
        port: int | None,
        served_model_name: str = DP_MODEL_NAME,
        env: dict[str, str] | None = None,
        split_cores: bool = False,
    ):
        self.port, self.log_path = port, log_path
        self.served_model_name = served_model_name
        env = {**os.environ, **FAST_HEARTBEAT_ENV, **(env or {})}
        if split_cores or int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) < 2:
            env.pop("OMP_NUM_THREADS", None)
        self.process = start_kvserve(["serve", *args], log_path, env=env, new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return read_log(self.log_path)

    def wait_healthy(self) -> None:
        wait_healthy(self.process, self.port, self.log_path)

    def health(self) -> tuple[int, dict]:
        """/health's status and JSON body."""
        response = http_get(self.url + "/health", timeout=5)
        return response.status_code, response.json()

    def metric(self, name: str, engine: int) -> float:
        """A per-engine sample of /metrics (0 when absent)."""
        return read_metric(metrics_text(self.url), name, default=0.0, engine=str(engine))

    def complete(self, prompt: str, max_tokens: int = 6) -> str:
        """A greedy completion that ignores EOS, so it must end by length; its text."""
        client = openai.OpenAI(
            base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60
        )
        response = client.completions.create(
            model=self.served_model_name,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert response.choices[0].finish_reason == "length"
        return response.choices[0].text

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL the whole session if it lingers; the exit code of SIGTERM.

        Fails the test if a descendant outlives it.
        """
        descendants = []
        try:
            descendants = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        exit_code = None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                exit_code = self.process.wait(timeout=40)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        alive = wait_gone(descendants, timeout_s=10)
        assert not alive, alive
        return exit_code


def start_tiny_server(
    model_dir: str,
    log_dir,
    *extra: str,
    env: dict[str, str] | None = None,
    split_cores: bool = False,
) -> ServeProcess:
    """`kvserve serve` of a tiny model (one engine core unless `extra` says otherwise) on a
    free port, served as DP_MODEL_NAME, not waited for.

    Args:
        log_dir: a folder (pathlib) for its log.
        extra: more flags.
        env: environment variables to set for it, over ServeProcess's.
        split_cores: as ServeProcess's.
    """
    port = free_port()
    return ServeProcess(
        [
            model_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--kv-cache-memory",
            str(TINY_KV_CACHE_MEMORY),
            "--served-model-name",
            DP_MODEL_NAME,
            "--uvicorn-log-level",
            "warning",
            *extra,
        ],
        str(log_dir / f"serve-{port}.log"),
        port,
        env=env,
        split_cores=split_cores,
    )


def start_dp_front_end(
    model_dir: str, log_dir, *extra: str, split_cores: bool = False
) -> ServeProcess:
    """start_tiny_server with NUM_DP_ENGINES engine cores."""
    return start_tiny_server(
        model_dir,
        log_dir,
        "--data-parallel-size",
        str(NUM_DP_ENGINES),
        *extra,
        split_cores=split_cores,
    )


def stream_completion(
    url: str, body: dict, events: list, first_data: threading.Event | None = None
) -> None:
    """POST a streaming /v1/completions (run it in a thread) and record what comes back.

    Args:
        url: the server's base URL.
        body: the request; "stream": true is added.
        events: gets (time.monotonic(), item) for the status code, then each SSE data line
            (the error body instead when the status is not 200), or the repr of an httpx
            error.
        first_data: set at the first data line, and when the stream ends in any way.
    """
    try:
        with httpx.stream(
            "POST", url + "/v1/completions", json=body | {"stream": True}, timeout=60
        ) as response:
            events.append((time.monotonic(), response.status_code))
            if response.status_code != 200:
                events.append((time.monotonic(), response.read().decode()))
                return
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append((time.monotonic(), line.removeprefix("data: ")))
                    if first_data is not None:
                        first_data.set()
    except httpx.HTTPError as exc:
        events.append((time.monotonic(), repr(exc)))
    finally:
        if first_data is not None:
            first_data.set()


class Generating:
    """Which engine core is mid-stream now, by the api's own counts (/health): the tokens
    each engine sent back since this object was made, and the requests it holds. A kill
    point taken from these is the server's state; the client's chunks are not (a loaded
    client reads far behind the server, and the tiny model streams 300 tokens in about a
    second).

    Args:
        server: the server under test (make this before its streams start).
        engines: the candidate engine indices (None: every engine).
    """

    MID_STREAM_TOKENS = 8  # a few tokens per stream: each on it has started, none ended

    def __init__(self, server: ServeProcess, engines: Collection[int] | None = None):
        self.server = server
        _, body = server.health()
        self.before = {
            e["engine"]: e["num_generated_tokens"]
            for e in body["engines"]
            if engines is None or e["engine"] in engines
        }

    def busiest(self, min_tokens: int = MID_STREAM_TOKENS) -> dict:
        """The /health entry of the candidate engine holding the most requests (ties: the
        highest index) once it holds some and sent `min_tokens` since the start (60 s at
        most)."""
        found: dict = {}

        def generating() -> bool:
            _, body = self.server.health()
            for entry in sorted(
                (e for e in body["engines"] if e["engine"] in self.before),
                key=lambda e: (e["num_in_flight"], e["engine"]),
                reverse=True,
            ):
                generated = entry["num_generated_tokens"] - self.before[entry["engine"]]
                if entry["num_in_flight"] and generated >= min_tokens:
                    found.update(entry)
                    return True
            return False

        assert wait_until(generating, timeout_s=60, interval_s=0.005), self.server.health()
        return found
