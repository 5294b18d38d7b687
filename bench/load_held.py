"""Load held: N concurrent streams, a disconnect storm in the middle, and nothing leaked after.

    .venv/bin/python bench/load_held.py [--model DIR] [--num-streams 512] [--max-tokens 64]
        [--disconnect-fraction 0.5] [--output-json load_held.json]

It starts `kvserve serve` (the default model unless --model) on a free port in a session of its
own, warms it up, and takes a baseline of its process tree (RSS, open fds, TCP and Unix
sockets, /dev/shm). Each round then:

1. opens --num-streams streaming chat (or --endpoint completions) requests at once, each
   generating --max-tokens tokens (ignore_eos), and reads no body until every one has its
   response headers: all of them are open at once, however busy the machine;
2. once every stream has its response headers and the running batch is --storm-at of the way
   through its tokens, cuts --disconnect-fraction of the open streams at once, half with a
   FIN and half with a RST (SO_LINGER 0), running and still-waiting ones alike;
3. waits for the rest, then runs --steady-requests more at --steady-concurrency;
4. closes its connections, waits until the engine is idle, and snapshots the tree again.

Finally the server is stopped (SIGTERM, SIGKILL of its session after 40 s) and must leave no
process and no /dev/shm segment behind. Checks, each printed and in the JSON:
- nothing lost: every request the server accepted ended in a finish_reason and [DONE], or in
  an error the client received (an error status, or an error event in the stream); the
  disconnected ones are counted apart, and the server's request_success{finished_reason}
  counters must agree;
- zero leaked KV blocks and requests: kv_cache_usage_perc, num_requests_running and _waiting 0;
- fds and sockets back to the baseline (--fd-tolerance, 0 by default: the baseline is taken
  after the warm-up, with the client's connections closed, so whatever the server opens
  lazily is in it), no TCP connection left but the listening one;
- no new /dev/shm segment of the server's, while it runs and after it stopped; no orphans;
- RSS bounded: after the last round, at most --max-rss-growth-mib above the baseline.
Exit status 1 when a check fails. 429s (past --max-waiting-requests) are reported apart.

RSS: torch keeps oneDNN primitives per linear input shape in two LRU caches (ideep's and
oneDNN's, 1024 entries each by default), so batches of every size grow the engine by tens
to ~150 MiB before they are full; run with LRU_CACHE_CAPACITY=16
ONEDNN_PRIMITIVE_CACHE_CAPACITY=16 to see the growth that is not theirs (--rounds 3: flat
after the first round). The soft RLIMIT_NOFILE is raised to the hard limit, here and so in
the server it starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable

if __package__ in (None, ""):  # run as a script: the repository root on sys.path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402
import msgspec  # noqa: E402

from tests.support.metrics import engine_idle, metrics_text  # noqa: E402
from tests.support.models import TINY_KV_CACHE_MEMORY, build_tiny_llama  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.processes import wait_gone  # noqa: E402
from tests.support.resources import (  # noqa: E402
    TreeSnapshot,
    new_shm_segments,
    shm_entries,
    snapshot_tree,
    tree_rss_and_fds,
)
from tests.support.server import ServeProcess  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

MODEL_NAME = "load-held"
TOPICS = [
    "a lighthouse", "the moon", "a train", "bread", "a storm", "rivers", "chess", "a violin",
    "glaciers", "a market", "owls", "the desert", "bicycles", "volcanoes", "tea", "a library",
]  # fmt: skip
MIB = 1 << 20


class Stream(msgspec.Struct, kw_only=True):
    """One streamed request, as the client saw it."""

    index: int
    sent_at: float
    status: int | None = None
    first_token_at: float | None = None
    num_chunks: int = 0  # chunks that carried text
    num_tokens: int | None = None  # usage.completion_tokens of the last chunk
    finish_reason: str | None = None
    done: bool = False  # saw data: [DONE]
    error: str | None = None  # an error status's body or an error event: the client got it
    exception: str | None = None  # a transport failure
    disconnect: str | None = None  # "fin" or "rst" when the storm cut it
    ended_at: float | None = None

    @property
    def is_open(self) -> bool:
        return self.status == 200 and self.ended_at is None

    def outcome(self) -> str:
        if self.status == 200 and self.finish_reason and self.done and self.error is None:
            return "completed"
        if self.disconnect is not None:
            return "disconnected"
        if self.status == 429:
            return "rejected_429"
        if self.error is not None:
            return "error_received"
        return "lost"


class LoadState:
    """Counters the storm trigger and the report read while the streams run.

    With `hold_until` set, every stream waits with its body unread until that many requests
    have their response: the client holds all of them open at once, as a slow reader would,
    however long the server took to answer the last (on a busy machine the first streams
    could otherwise end before the last are answered). An armed storm runs in the reader
    that brings its trigger: a client starved of CPU reads bodies in bursts, and a storm
    polled for would come after the whole burst.
    """

    def __init__(self, hold_until: int | None = None):
        self.num_answered = self.num_open = self.peak_open = self.num_chunks = 0
        self.hold_until = hold_until
        self.all_answered = asyncio.Event()
        self.all_answered_at: float | None = None
        self.responses: dict[int, aiohttp.ClientResponse] = {}
        self._storm: tuple[int, float, Callable[[], None]] | None = None

    def answered(self, stream: Stream, response: aiohttp.ClientResponse) -> None:
        stream.status = response.status
        self.responses[stream.index] = response
        self.num_answered += 1
        if response.status == 200:
            self.num_open += 1
            self.peak_open = max(self.peak_open, self.num_open)
        if self.hold_until is not None and self.num_answered >= self.hold_until:
            self.all_answered.set()
            self.all_answered_at = time.monotonic()
        self._check_storm()

    def chunk(self) -> None:
        self.num_chunks += 1
        self._check_storm()

    def arm_storm(self, num_streams: int, num_chunks: float, storm: Callable[[], None]) -> None:
        """Run `storm` once `num_streams` requests have their response and `num_chunks` text
        chunks are read: in the reader that reads the last of them, before its next line."""
        self._storm = (num_streams, num_chunks, storm)
        self._check_storm()

    def disarm_storm(self) -> bool:
        """Whether the storm was still armed (it has not run and now will not)."""
        armed, self._storm = self._storm is not None, None
        return armed

    def _check_storm(self) -> None:
        if self._storm is None:
            return
        num_streams, num_chunks, storm = self._storm
        if self.num_answered >= num_streams and self.num_chunks >= num_chunks:
            self._storm = None
            storm()

    async def hold(self, timeout: float) -> None:
        """Wait until every request held for has its response (at most `timeout` s: one
        that never gets an answer is reported as lost, not waited for forever)."""
        if self.hold_until is None:
            return
        try:
            await asyncio.wait_for(self.all_answered.wait(), timeout)
        except TimeoutError:
            self.hold_until = None

    def ended(self, stream: Stream) -> None:
        stream.ended_at = time.monotonic()
        if stream.status == 200:
            self.num_open -= 1


def request_body(args, index: int) -> tuple[str, dict]:
    """(path, body) of request `index`: short distinct prompts, exactly --max-tokens out."""
    topic = TOPICS[index % len(TOPICS)]
    text = f"Request {index}. Write a few sentences about {topic}, in plain words."
    body = {
        "model": MODEL_NAME,
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint == "chat":
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": text}]}
    return "/v1/completions", body | {"prompt": text}


def _take_event(stream: Stream, data: bytes, state: LoadState) -> None:
    if data == b"[DONE]":
        stream.done = True
        return
    event = json.loads(data)
    if "error" in event:
        stream.error = json.dumps(event["error"])[:300]
        return
    for choice in event.get("choices") or ():
        text = choice.get("text") or (choice.get("delta") or {}).get("content")
        if text:
            if stream.first_token_at is None:
                stream.first_token_at = time.monotonic()
            stream.num_chunks += 1
            state.chunk()
        stream.finish_reason = choice.get("finish_reason") or stream.finish_reason
    if event.get("usage"):
        stream.num_tokens = event["usage"]["completion_tokens"]


async def run_stream(session, url: str, args, stream: Stream, state: LoadState) -> None:
    """POST one streaming request and read it to its end, unless the storm cuts it: then its
    connection is closed (with a RST when stream.disconnect is "rst") and the task stops."""
    path, body = request_body(args, stream.index)
    try:
        async with session.post(url + path, json=body) as response:
            state.answered(stream, response)
            if response.status != 200:
                stream.error = (await response.text())[:300]
                return
            try:
                await state.hold(args.storm_timeout)
                async for line in response.content:
                    line = line.strip()
                    if line.startswith(b"data: "):
                        _take_event(stream, line[len(b"data: ") :], state)
                    if stream.disconnect is not None:  # this chunk set off the storm
                        return
            except asyncio.CancelledError:
                if stream.disconnect is None:
                    raise
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        stream.exception = repr(exc)[:300]
    finally:
        state.ended(stream)


def _cut(response: aiohttp.ClientResponse, reset: bool) -> None:
    """Close the response's connection now, mid-body: a FIN, or a RST with SO_LINGER 0."""
    if reset and response.connection is not None:
        sock = response.connection.transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    response.close()


async def disconnect_storm(
    args, streams: list[Stream], tasks, state: LoadState, rng, chunks_per_token: float
) -> dict:
    """Wait for the middle of the load, then cut --disconnect-fraction of the streams at once.

    The middle: every stream has its headers, and the running batch is --storm-at of the way
    through its tokens (counted in text chunks, chunks_per_token of them a token: a
    detokenizer holds back bytes of an unfinished character). By --storm-timeout, or when
    every stream ended first, it cuts what is open then.
    """
    num_running = min(len(streams), args.max_num_seqs)
    target_chunks = args.storm_at * num_running * args.max_tokens * chunks_per_token
    start = time.monotonic()
    figures: dict = {}
    cut_done = asyncio.Event()

    def storm() -> None:
        figures.update(_cut_victims(args, streams, tasks, state, rng))
        figures["storm_after_s"] = round(time.monotonic() - start, 2)
        cut_done.set()

    state.arm_storm(len(streams), target_chunks, storm)
    while not cut_done.is_set():
        if time.monotonic() - start > args.storm_timeout or all(t.done() for t in tasks):
            if state.disarm_storm():
                storm()
            break
        try:
            await asyncio.wait_for(cut_done.wait(), 0.05)
        except TimeoutError:
            pass
    answered_at = state.all_answered_at
    return {
        "all_answered_after_s": None if answered_at is None else round(answered_at - start, 2),
        "target_chunks": round(target_chunks),
    } | figures


def _cut_victims(args, streams: list[Stream], tasks, state: LoadState, rng) -> dict:
    """Pick the victims among the open streams, close their connections and stop their
    readers (all but the running one, which stops itself on seeing its cut)."""
    open_streams = [s for s in streams if s.is_open]
    num_victims = min(len(open_streams), round(args.disconnect_fraction * len(streams)))
    victims = rng.sample(open_streams, num_victims)
    num_mid_stream = sum(v.num_chunks > 0 for v in victims)
    for i, victim in enumerate(victims):
        victim.disconnect = "rst" if i % 2 else "fin"
        _cut(state.responses[victim.index], reset=victim.disconnect == "rst")
        if tasks[victim.index] is not asyncio.current_task():
            tasks[victim.index].cancel()
    return {
        "chunks_at_storm": state.num_chunks,
        "open_at_storm": len(open_streams),
        "victims": num_victims,
        "victims_mid_stream": num_mid_stream,
        "victims_before_first_token": num_victims - num_mid_stream,
    }


async def watch_server(session, url: str, root_pid: int, peaks: dict, stop: asyncio.Event):
    """Peaks of the server's in-flight requests, KV usage, RSS and fds, every half second."""
    while not stop.is_set():
        try:
            async with session.get(url + "/metrics") as response:
                text = await response.text()
            in_flight = metric_sum(text, "kvserve:num_requests_running") + metric_sum(
                text, "kvserve:num_requests_waiting"
            )
            peaks["in_flight"] = max(peaks["in_flight"], in_flight)
            peaks["kv_usage"] = max(
                peaks["kv_usage"], metric_sum(text, "kvserve:kv_cache_usage_perc")
            )
        except aiohttp.ClientError:
            pass
        rss, fds = await asyncio.to_thread(tree_rss_and_fds, root_pid)
        peaks["rss_bytes"], peaks["fds"] = max(peaks["rss_bytes"], rss), max(peaks["fds"], fds)
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of every sample `name{...}` whose labels include `labels` (all engines)."""
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(w in line for w in wanted):
            total += float(line.rsplit(" ", 1)[1])
    return total


def finished_counts(url: str) -> dict[str, float]:
    text = metrics_text(url)
    return {
        reason: metric_sum(text, "kvserve:request_success_total", finished_reason=reason)
        for reason in ("stop", "length", "abort", "error")
    }


async def run_streams(session, url, args, indices, state, concurrency=None) -> list[Stream]:
    """Streams for `indices`, all at once or `concurrency` at a time."""
    limit = asyncio.Semaphore(concurrency or len(indices))
    streams = []

    async def one(index: int) -> None:
        async with limit:
            stream = Stream(index=index, sent_at=time.monotonic())
            streams.append(stream)
            await run_stream(session, url, args, stream, state)

    await asyncio.gather(*(one(i) for i in indices))
    return sorted(streams, key=lambda s: s.index)


def _session(args) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60, sock_read=args.read_timeout)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)


async def load_round(url: str, root_pid: int, args, rng, chunks_per_token: float) -> dict:
    """One round: the storm load, then the steady phase; the client's figures."""
    peaks = {"in_flight": 0.0, "kv_usage": 0.0, "rss_bytes": 0, "fds": 0}
    async with _session(args) as session, _session(args) as watch_session:
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch_server(watch_session, url, root_pid, peaks, stop))
        state = LoadState(hold_until=args.num_streams)
        start = time.monotonic()
        streams = [Stream(index=i, sent_at=start) for i in range(args.num_streams)]
        tasks = [asyncio.create_task(run_stream(session, url, args, s, state)) for s in streams]
        storm = await disconnect_storm(args, streams, tasks, state, rng, chunks_per_token)
        await asyncio.gather(*tasks, return_exceptions=True)
        load_s = time.monotonic() - start

        steady_state = LoadState()
        start = time.monotonic()
        steady = await run_streams(
            session,
            url,
            args,
            range(args.num_streams, args.num_streams + args.steady_requests),
            steady_state,
            args.steady_concurrency,
        )
        steady_s = time.monotonic() - start
        stop.set()
        await watcher
    return {
        "storm": storm,
        "load": phase_figures(streams, load_s) | {"peak_open_streams": state.peak_open},
        "steady": phase_figures(steady, steady_s),
        "server_peaks": peaks,
    }


def phase_figures(streams: list[Stream], seconds: float) -> dict:
    """Outcome counts, requests/s and output tokens/s of the completed, their TTFT."""
    outcomes = {k: 0 for k in ("completed", "disconnected", "rejected_429", "error_received")}
    outcomes["lost"] = 0
    for stream in streams:
        outcomes[stream.outcome()] += 1
    completed = [s for s in streams if s.outcome() == "completed"]
    ttfts = sorted(s.first_token_at - s.sent_at for s in completed if s.first_token_at)
    return {
        "num_requests": len(streams),
        **outcomes,
        "lost_examples": [msgspec.to_builtins(s) for s in streams if s.outcome() == "lost"][:5],
        "errors": sorted({s.error for s in streams if s.error})[:5],
        "text_chunks_per_token": round(
            sum(s.num_chunks for s in completed)
            / max(1, sum(s.num_tokens or 0 for s in completed)),
            3,
        ),
        "seconds": round(seconds, 2),
        "requests_per_s": round(len(completed) / seconds, 2),
        "output_tokens_per_s": round(sum(s.num_tokens or 0 for s in completed) / seconds, 1),
        "ttft_min_s": round(ttfts[0], 3) if ttfts else None,
        "ttft_p50_s": round(_percentile(ttfts, 50), 3),
        "ttft_p99_s": round(_percentile(ttfts, 99), 3),
        "ttft_max_s": round(ttfts[-1], 3) if ttfts else None,
    }


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def settle(url: str, root_pid: int, baseline: TreeSnapshot | None, args) -> TreeSnapshot:
    """Wait until the engine is idle and (given a baseline) the fds are back within
    --fd-tolerance with no TCP connection open; the snapshot that saw it (or the last one, at
    the timeout). Not a fresh one after: a process's heartbeat reads /proc and cgroup files
    every second, and a snapshot taken while one is open counts it (CI failed on that +1)."""
    wait_until(lambda: engine_idle(url), timeout_s=args.settle_timeout, interval_s=0.25)
    latest: list[TreeSnapshot] = []

    def settled() -> bool:
        latest[:] = [snapshot_tree(root_pid)]
        snapshot = latest[0]
        fds_back = baseline is None or snapshot.num_fds <= baseline.num_fds + args.fd_tolerance
        return fds_back and snapshot.num_tcp == 0

    wait_until(settled, timeout_s=args.settle_timeout, interval_s=0.25)
    return latest[0]


def warm_up(url: str, root_pid: int, args) -> tuple[TreeSnapshot, float]:
    """A few streams, so that lazy allocations happen before the baseline; (the baseline,
    text chunks per token)."""
    warm_args = argparse.Namespace(**vars(args) | {"max_tokens": min(args.max_tokens, 16)})

    async def main() -> list[Stream]:
        async with _session(args) as session:
            return await run_streams(session, url, warm_args, range(-8, 0), LoadState())

    streams = asyncio.run(main())
    if not all(s.outcome() == "completed" for s in streams):
        raise RuntimeError(f"the warm-up failed: {streams}")
    num_tokens = sum(s.num_tokens or 0 for s in streams)
    chunks_per_token = sum(s.num_chunks for s in streams) / max(1, num_tokens)
    return settle(url, root_pid, None, args), chunks_per_token


def checks_of(summary: dict, args) -> list[dict]:
    """Pass/fail of each leak and loss rule, with the figures it read."""
    baseline, rounds = summary["baseline"], summary["rounds"]
    last = rounds[-1]["after"]
    lost = sum(r[p]["lost"] for r in rounds for p in ("load", "steady"))
    steady_ok = all(r["steady"]["completed"] == r["steady"]["num_requests"] for r in rounds)
    counters_ok = all(r["server_finished"]["agrees"] for r in rounds)
    rss_growth = (last["rss_bytes"] - baseline["rss_bytes"]) / MIB
    fd_deltas = [r["after"]["num_fds"] - baseline["num_fds"] for r in rounds]
    engine_idle_ok = all(r["engine_idle"] for r in rounds)
    checks = [
        ("nothing lost", lost == 0, f"{lost} lost"),
        (
            "server counters agree",
            counters_ok,
            "request_success deltas "
            + str(
                [
                    {k: int(v) for k, v in r["server_finished"].items() if k != "agrees"}
                    for r in rounds
                ]
            ),
        ),
        ("steady phase all completed", steady_ok, "every steady request completed"),
        ("zero KV blocks / requests left", engine_idle_ok, "running, waiting, kv usage 0"),
        ("fds back", max(fd_deltas) <= args.fd_tolerance, f"fd deltas {fd_deltas}"),
        ("no TCP connection left", all(r["after"]["num_tcp"] == 0 for r in rounds), ""),
        (
            "unix sockets back",
            all(r["after"]["num_unix"] == baseline["num_unix"] for r in rounds),
            f"{[r['after']['num_unix'] for r in rounds]} vs {baseline['num_unix']}",
        ),
        ("no shm left while running", not summary["shm_new_while_running"], ""),
        ("no shm left after stop", not summary["shm_left_after_stop"], ""),
        ("no orphans", not summary["orphans"], str(summary["orphans"])),
        ("RSS bounded", rss_growth <= args.max_rss_growth_mib, f"+{rss_growth:.1f} MiB"),
    ]
    return [{"check": name, "ok": bool(ok), "detail": detail} for name, ok, detail in checks]


def _tree_figures(snapshot: TreeSnapshot) -> dict:
    return {
        "rss_bytes": snapshot.rss_bytes,
        "num_fds": snapshot.num_fds,
        "num_tcp": snapshot.num_tcp,
        "num_unix": snapshot.num_unix,
        "shm_mapped": snapshot.shm_mapped,
        "processes": msgspec.to_builtins(snapshot.processes),
    }


def serve_args(args, port: int) -> list[str]:
    model = [args.model] if args.model else []
    flags = [
        "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", MODEL_NAME,
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-waiting-requests", str(args.max_waiting_requests),
        "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    if args.kv_cache_memory:
        flags += ["--kv-cache-memory", args.kv_cache_memory]
    return model + flags + args.serve_arg


def run_load_held(args) -> dict:
    """Start the server, run the rounds, stop it; the summary with its checks."""
    raise_fd_limit()
    rng = random.Random(args.seed)
    port = args.port or free_port()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="load-held-")
    os.makedirs(log_dir, exist_ok=True)
    args = argparse.Namespace(**vars(args))
    if args.tiny:
        args.model = build_tiny_llama(f"{log_dir}/tiny-llama")
        args.kv_cache_memory = args.kv_cache_memory or str(TINY_KV_CACHE_MEMORY)
    args.endpoint = args.endpoint or ("completions" if args.tiny else "chat")
    shm_before = shm_entries()
    server = ServeProcess(serve_args(args, port), f"{log_dir}/serve.log", port, MODEL_NAME)
    snapshots: list[TreeSnapshot] = []
    summary: dict = {"config": dict(vars(args)), "rounds": []}
    timings = summary["seconds"] = {}
    start = time.monotonic()
    try:
        server.wait_healthy()
        timings["start_to_healthy"] = round(time.monotonic() - start, 1)
        root = server.process.pid
        baseline, chunks_per_token = warm_up(server.url, root, args)
        snapshots.append(baseline)
        summary["baseline"] = _tree_figures(baseline)
        timings["warm_up_and_baseline"] = round(time.monotonic() - start, 1)
        for _ in range(args.rounds):
            before = finished_counts(server.url)
            figures = asyncio.run(load_round(server.url, root, args, rng, chunks_per_token))
            settle_start = time.monotonic()
            after = settle(server.url, root, baseline, args)
            figures["settle_s"] = round(time.monotonic() - settle_start, 2)
            snapshots.append(after)
            figures["engine_idle"] = engine_idle(server.url)
            figures["server_finished"] = _finished_delta(
                before, finished_counts(server.url), figures
            )
            figures["after"] = _tree_figures(after)
            summary["rounds"].append(figures)
        summary["shm_new_while_running"] = new_shm_segments(
            set(baseline.shm_mapped), set(snapshots[-1].shm_mapped), snapshots
        )
    finally:
        stop_start = time.monotonic()
        pids = [p.pid for s in snapshots for p in s.processes]
        summary["stop_exit_code"], summary["orphans"] = _stop(server, pids)
        timings["stop"] = round(time.monotonic() - stop_start, 1)
        timings["total"] = round(time.monotonic() - start, 1)
    summary["shm_left_after_stop"] = new_shm_segments(shm_before, shm_entries(), snapshots)
    summary["shm_other_new_entries"] = sorted(shm_entries() - shm_before)
    summary["log"] = server.log_path
    # The api logs each abort it sends the engine: one per cut stream the server still ran.
    summary["server_logged_aborts"] = server.log().count(" aborted\n")
    summary["checks"] = checks_of(summary, args)
    return summary


def _finished_delta(before: dict, after: dict, figures: dict) -> dict:
    """The server's finished-request counts over the round against the client's outcomes.

    The server counts each engine request once: stop or length when the engine finished it,
    abort when its client went away first. A cut stream the server had already finished,
    its last tokens still in flight to the client, counts "length" there: so stop + length
    lies between the completed and the completed plus the cut streams, stop + length +
    abort is exactly the completed plus the cut ones, and its errors are no more than the
    client got (429s included).
    """
    delta = {k: after[k] - before[k] for k in before}
    load, steady = figures["load"], figures["steady"]
    completed = load["completed"] + steady["completed"]
    disconnected = load["disconnected"] + steady["disconnected"]
    finished = delta["stop"] + delta["length"]
    agrees = (
        completed <= finished <= completed + disconnected
        and finished + delta["abort"] == completed + disconnected
        # An engine-side refusal is an error output there and a 429 here.
        and delta["error"] <= sum(p["error_received"] + p["rejected_429"] for p in (load, steady))
    )
    return delta | {"agrees": agrees, "cut_after_server_finished": finished - completed}


def _stop(server: ServeProcess, pids: list[int]) -> tuple[int | None, list[int]]:
    """SIGTERM, then SIGKILL of the session; (exit code of SIGTERM, pids still alive)."""
    try:
        exit_code = server.stop()
    except AssertionError:
        exit_code = server.process.returncode
    return exit_code, [p.pid for p in wait_gone(set(pids), timeout_s=5)]


def raise_fd_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit: 512 streams need 512 sockets here."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def table_row(summary: dict) -> str:
    """The hardening table's row: the first round's load figures and the leak figures."""
    r = summary["rounds"][0]
    load, steady, storm = r["load"], r["steady"], r["storm"]
    base, last = summary["baseline"], summary["rounds"][-1]["after"]
    peak_rss = max(round_["server_peaks"]["rss_bytes"] for round_ in summary["rounds"])
    ok = all(c["ok"] for c in summary["checks"])
    return (
        f"| load held | {summary['config']['num_streams']} streams, "
        f"peak {load['peak_open_streams']} open ({r['server_peaks']['in_flight']:.0f} in the "
        f"engine); storm cut {storm['victims']} ({storm['victims_mid_stream']} mid-stream, "
        f"the server logged {summary['server_logged_aborts']} aborts for "
        f"{sum(r['storm']['victims'] for r in summary['rounds'])} cuts); "
        f"{load['completed']} completed, {load['rejected_429']} 429, {load['lost']} lost; "
        f"{load['requests_per_s']} req/s under load, {steady['requests_per_s']} req/s steady; "
        f"survivors' TTFT p50 {load['ttft_p50_s']} s, p99 {load['ttft_p99_s']} s; "
        f"RSS {base['rss_bytes'] / MIB:.0f} -> {last['rss_bytes'] / MIB:.0f} MiB "
        f"(peak {peak_rss / MIB:.0f}); fds {base['num_fds']} -> "
        f"{last['num_fds']}, TCP {last['num_tcp']}, unix sockets {base['num_unix']} -> "
        f"{last['num_unix']}, shm left {len(summary['shm_left_after_stop'])}, orphans "
        f"{len(summary['orphans'])} | {'**met**' if ok else 'missed'} |"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", help="model folder or file (default: the embedded default model)")
    add("--port", type=int, default=0, help="the server's port (default: a free one)")
    add("--tiny", action="store_true", help="serve the tiny random model (tests/support/models)")
    add("--endpoint", choices=("chat", "completions"), help="default: chat (completions: --tiny)")
    add("--num-streams", type=int, default=512)
    add("--max-tokens", type=int, default=64, help="tokens each stream generates")
    add("--disconnect-fraction", type=float, default=0.5, help="share of streams the storm cuts")
    add("--storm-at", type=float, default=0.5, help="how far the running batch is at the storm")
    add("--storm-timeout", type=float, default=600.0, help="storm by then at the latest (s)")
    add("--steady-requests", type=int, default=64)
    add("--steady-concurrency", type=int, default=16)
    add("--rounds", type=int, default=1)
    add("--max-num-seqs", type=int, default=256, help="the server's --max-num-seqs")
    add("--max-waiting-requests", type=int, default=2048, help="the server's flag")
    add("--kv-cache-memory", help="the server's --kv-cache-memory (default: its own)")
    add("--serve-arg", action="append", default=[], help="one more server flag (repeatable)")
    add("--read-timeout", type=float, default=600.0, help="seconds a stream may go silent")
    add("--settle-timeout", type=float, default=60.0)
    add("--fd-tolerance", type=int, default=0, help="fds above the baseline still counted back")
    add("--max-rss-growth-mib", type=float, default=256.0)
    add("--seed", type=int, default=0)
    add("--log-dir", help="where the server's log goes (default: a new temporary folder)")
    add("--output-json", help="write the summary here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    summary = run_load_held(args)
    for check in summary["checks"]:
        print(f"{'ok  ' if check['ok'] else 'FAIL'} {check['check']}: {check['detail']}")
    print(json.dumps({k: summary[k] for k in ("baseline", "rounds")}, indent=1, default=str))
    print(table_row(summary))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return 0 if all(c["ok"] for c in summary["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
