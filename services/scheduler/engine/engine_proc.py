"""EngineCoreProc: an EngineCore in its own process, between two IO threads.

    api ROUTER ──▶ input thread (DEALER) ──▶ input_queue ──▶ busy loop ──▶ output_queue
                                                          (EngineCore)        │
    api PULL   ◀──────────────────────────── output thread (PUSH) ◀───────────┘
    DP coordinator PULL ◀── (waiting, running) ─┘ (PUSH, with data parallelism)

The busy loop owns the EngineCore and touches no socket; the IO threads own one socket each
and do all encoding and decoding, overlapping with the forward pass (torch drops the GIL).
The loop blocks on the input queue when it has nothing to do: it never spins.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from kvserve.services.scheduler.core.queue_delay import predicted_queue_delay_s
from kvserve.shared.config import EngineConfig
from kvserve.shared.env import (
    CPU_THREADS_BIND,
    ENGINE_HEARTBEAT_INTERVAL_S,
    FRONTEND_TIMEOUT_S,
    OMP_NUM_THREADS,
)
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
from kvserve.shared.progress import ProcessProgress
from kvserve.shared.transport import (
    EngineAddresses,
    MessageDecoder,
    MessageEncoder,
    engine_identity,
    make_socket,
)
from kvserve.shared.wire import (
    EngineDead,
    EngineHeartbeat,
    EngineLoad,
    EngineReady,
    EngineStats,
    GetStats,
    IsSleeping,
    MsgType,
    Ping,
    ResetPrefixCache,
    Sleep,
    UtilityCall,
    UtilityOutput,
    UtilityResult,
    WakeUp,
)

if TYPE_CHECKING:
    from kvserve.services.scheduler.engine.engine_core import (
        EngineCore,  # torch: imported in start()
    )

logger = init_logger(__name__)

# How long the output socket may take to deliver what is queued (a DEAD sentinel) at exit.
_OUTPUT_LINGER_MS = 2000
# How often the input thread wakes up to check for shutdown and a dead parent (a stopping
# engine waits up to this long for it).
_INPUT_POLL_MS = 200
_SHUTDOWN = object()  # the output queue's stop sentinel
_IDLE_WAKEUP_S = 0.5  # an idle busy loop wakes this often so signal handlers can run
# A busy engine reports a load change to the DP coordinator at most this often.
_LOAD_REPORT_INTERVAL_S = 0.05


class EngineFailure(RuntimeError):
    """Raised in the busy loop when something outside it (the input thread) failed."""


class EngineCoreProc:
    """The engine-core process's state: queues, IO threads, progress counters.

    Args:
        addresses: the api's input (ROUTER) and output (PULL) addresses.
        engine_index: this engine's index (its DEALER identity).
        parent_pid: shut down when this process is no longer our parent (None: never).
        stats_addr: the DP coordinator's load address (None: no coordinator).
        frontend_timeout_s: shut down after this long without a message from the api
            (which beats every heartbeat interval), for engines that are not its children
            (None: never).
    """

    def __init__(
        self,
        addresses: EngineAddresses,
        engine_index: int = 0,
        parent_pid: int | None = None,
        stats_addr: str | None = None,
        frontend_timeout_s: float | None = None,
    ):
        self.addresses = addresses
        self.engine_index = engine_index
        self.parent_pid = parent_pid
        self.stats_addr = stats_addr
        self.frontend_timeout_s = frontend_timeout_s
        self.engine_core: EngineCore | None = None  # start() builds it, once output IO runs
        self.input_queue: queue.Queue[tuple[MsgType | None, Any]] = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        # Progress, read by the output thread for heartbeats (plain ints: GIL-atomic).
        self.num_iterations = 0
        self.num_steps = 0
        self.idle = False
        self.queue_delay_ms = 0.0  # for the load reports (DP): _update_queue_delay
        # CPU time and run-queue wait, in every heartbeat: a remote api's view of this host.
        self._progress = ProcessProgress(os.getpid())
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        # The output thread starts first: it heartbeats through a long model load, and can
        # carry the DEAD sentinel if the load fails.
        self.output_thread = threading.Thread(
            target=self._process_output_queue, name="EngineCoreOutputIO", daemon=True
        )
        self.output_thread.start()
        self.input_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ life cycle

    def start(self, config: EngineConfig, model_dir: str) -> None:
        """Build the EngineCore (model load, KV profile), then say READY to the api."""
        from kvserve.services.scheduler.engine.engine_core import EngineCore

        self.engine_core = EngineCore(config, model_dir, self.engine_index, bound_waiting=True)
        handshake = self.engine_core.ready
        self.input_thread = threading.Thread(
            target=self._process_input_socket,
            args=(handshake,),
            name="EngineCoreInputIO",
            daemon=True,
        )
        self.input_thread.start()

    def send_dead(self, reason: str) -> None:
        self.output_queue.put_nowait((MsgType.DEAD, EngineDead(self.engine_index, reason)))

    def shutdown(self) -> None:
        """Flush the output queue, stop both IO threads, then the workers."""
        self._stop.set()
        self.output_queue.put_nowait(_SHUTDOWN)
        self.output_thread.join(timeout=_OUTPUT_LINGER_MS / 1000 + 1)
        if self.input_thread is not None:
            self.input_thread.join(timeout=_INPUT_POLL_MS / 1000 + 1)
        if self.engine_core is not None:
            self.engine_core.shutdown()
        if not self.output_thread.is_alive() and not (
            self.input_thread and self.input_thread.is_alive()
        ):
            self._ctx.term()  # every socket is closed: term() returns at once

    # ------------------------------------------------------------------ busy loop

    @property
    def _core(self) -> EngineCore:
        """The engine core, for the busy loop (which only runs once start() built it)."""
        assert self.engine_core is not None, "start() builds the engine core"
        return self.engine_core

    def run_busy_loop(self) -> None:
        """Handle inputs and step the engine, forever; raises on a fatal error."""
        while True:
            self._process_input_queue()
            self._update_queue_delay()
            self._process_engine_step()
            self._update_queue_delay()
            self.num_iterations += 1

    def _update_queue_delay(self) -> None:
        """Predict the queue delay for the next load report (DP only: it walks the queues).
        Computed here, in the busy loop, because the output thread must not iterate them."""
        if self.stats_addr is None:
            return
        scheduler = self._core.scheduler
        delay_s = predicted_queue_delay_s(
            scheduler.latency.model,
            scheduler.requests.values(),
            scheduler.scheduler_config.max_num_batched_tokens,
        )
        # Whole ms: a finer figure would change, and be reported, at every step.
        self.queue_delay_ms = float(round(delay_s * 1000.0))

    def _process_input_queue(self) -> None:
        if not self._core.has_work():
            self.idle = True
            item = None
            while item is None:
                # Blocks, but wakes every interval: a SIGTERM delivered to another thread
                # (IO or OpenMP threads) would never interrupt an untimed wait, and its
                # Python handler only runs once this thread executes bytecode again.
                try:
                    item = self.input_queue.get(timeout=_IDLE_WAKEUP_S)
                except queue.Empty:
                    self._core.executor.check_health()  # an idle engine's workers, too
            self.idle = False
            self._handle_input(*item)
        while True:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle_input(*item)

    def _handle_input(self, msg_type: MsgType | None, payload: Any) -> None:
        if msg_type == MsgType.ADD:
            self._core.add_request(payload)
        elif msg_type == MsgType.ABORT:
            self._core.abort_requests(payload)
        elif msg_type == MsgType.UTILITY:
            self.output_queue.put_nowait((MsgType.UTILITY_OUTPUT, self._run_utility(payload)))
        elif msg_type == MsgType.TENANT_SERVICE:
            self._core.scheduler.policy.set_remote_tenant_service(payload.remote)
        else:
            assert msg_type is None, msg_type
            raise EngineFailure(payload)

    def _process_engine_step(self) -> None:
        if not self._core.has_work():
            return
        outputs = self._core.step()
        self.num_steps += 1
        outputs.engine_index = self.engine_index
        self.output_queue.put_nowait((MsgType.OUTPUTS, outputs))

    def _run_utility(self, call: UtilityCall) -> UtilityOutput:
        """Utilities run between steps, so they see a consistent scheduler."""
        result: UtilityResult
        try:
            match call.method:
                case ResetPrefixCache():
                    result = self._core.reset_prefix_cache()
                case GetStats():
                    result = self._make_stats()
                case Ping():
                    result = self.make_heartbeat()
                case Sleep(level=level):
                    result = self._core.sleep(level)
                case WakeUp(tags=tags):
                    self._core.wake_up(tags)
                    result = True
                case IsSleeping():
                    result = bool(self._core.sleep_level)
                case _:
                    raise AssertionError(f"unhandled utility {call.method_name}")
        except Exception as exc:  # noqa: BLE001 - a failed utility must not kill the engine
            logger.exception("utility %s failed", call.method_name)
            return UtilityOutput(call.call_id, failure_message=f"{type(exc).__name__}: {exc}")
        return UtilityOutput(call.call_id, result=result)

    def _make_stats(self) -> EngineStats:
        scheduler = self._core.scheduler
        manager = scheduler.kv_cache_manager
        return EngineStats(
            num_blocks=manager.num_total_blocks,
            num_free_blocks=manager.num_free_blocks,
            num_running_reqs=len(scheduler.running),
            num_waiting_reqs=len(scheduler.waiting) + len(scheduler.waiting_for_grammar),
            num_steps=self.num_steps,
            num_preemptions_total=scheduler.num_preemptions_total,
        )

    def make_heartbeat(self) -> EngineHeartbeat:
        core = self.engine_core
        num_unfinished = core.scheduler.get_num_unfinished_requests() if core else 0
        progress = self._progress.sample()
        return EngineHeartbeat(
            self.engine_index,
            self.num_iterations,
            self.num_steps,
            self.idle,
            num_unfinished,
            progress.cpu_ns,
            progress.wait_ns,
        )

    def make_load(self) -> EngineLoad:
        """Queue lengths for the DP coordinator (read from the output thread: len() of the
        scheduler's queues is atomic under the GIL, and a stale value is corrected next)."""
        scheduler = self.engine_core.scheduler if self.engine_core is not None else None
        if scheduler is None:
            return EngineLoad(self.engine_index, 0, 0)
        num_waiting = len(scheduler.waiting) + len(scheduler.waiting_for_grammar)
        tenant_service = scheduler.policy.tenant_service()
        return EngineLoad(
            self.engine_index,
            num_waiting,
            len(scheduler.running),
            tenant_service,
            self.queue_delay_ms,
        )

    # ------------------------------------------------------------------ IO threads

    def _process_input_socket(self, handshake: EngineReady) -> None:
        """Send READY, then decode every message into the input queue."""
        decoder = MessageDecoder(
            (
                MsgType.ADD,
                MsgType.ABORT,
                MsgType.UTILITY,
                MsgType.FRONTEND_HEARTBEAT,
                MsgType.TENANT_SERVICE,
            )
        )
        sock = make_socket(
            self._ctx,
            self.addresses.input_addr,
            zmq.DEALER,
            bind=False,
            identity=engine_identity(self.engine_index),
        )
        try:
            sock.send_multipart(MessageEncoder().encode(MsgType.READY, handshake))
            last_frontend_time = time.monotonic()
            while not self._stop.is_set():
                if not sock.poll(_INPUT_POLL_MS):
                    self._check_parent_alive()
                    self._check_frontend_alive(time.monotonic() - last_frontend_time)
                    continue
                last_frontend_time = time.monotonic()
                frames = sock.recv_multipart(copy=False)
                try:
                    msg_type, payload = decoder.decode(frames)
                except (ValueError, msgspec.ValidationError) as exc:
                    self._reject_malformed(frames, exc)
                    continue
                if msg_type != MsgType.FRONTEND_HEARTBEAT:
                    self.input_queue.put_nowait((msg_type, payload))
        except Exception as exc:  # noqa: BLE001 - a deaf engine must die loudly
            logger.exception("input thread failed")
            self.input_queue.put_nowait((None, f"input thread failed: {exc!r}"))
        finally:
            sock.close()

    def _check_parent_alive(self) -> None:
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            logger.error("parent process %d is gone; shutting down", self.parent_pid)
            self.parent_pid = None
            os.kill(os.getpid(), signal.SIGTERM)  # the main thread's handler exits cleanly

    def _check_frontend_alive(self, silence_s: float) -> None:
        if self.frontend_timeout_s is not None and silence_s > self.frontend_timeout_s:
            logger.error(
                "engine core %d heard nothing from the api at %s for %.0f s (limit %g s, "
                "%s); shutting down",
                self.engine_index,
                self.addresses.input_addr,
                silence_s,
                self.frontend_timeout_s,
                FRONTEND_TIMEOUT_S.name,
            )
            self.frontend_timeout_s = None
            os.kill(os.getpid(), signal.SIGTERM)  # the main thread's handler exits cleanly

    def _reject_malformed(self, frames: list[zmq.Frame], exc: Exception) -> None:
        """A request that does not decode ends with an ERROR output when its id is readable."""
        logger.error("dropped a malformed message: %s", exc)
        if len(frames) < 2 or frames[0].bytes != MsgType.ADD.frame:
            return
        try:
            fields = msgspec.msgpack.decode(frames[1].buffer)
        except msgspec.DecodeError:
            return
        # EngineCoreRequest is array_like: its first field is the request id.
        if isinstance(fields, list) and fields and isinstance(fields[0], str):
            error = EngineCoreOutput(
                request_id=fields[0],
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                error=f"invalid request: {exc}",
            )
            self.output_queue.put_nowait(
                (
                    MsgType.OUTPUTS,
                    EngineCoreOutputs(
                        outputs=[error], timestamp=time.monotonic(), engine_index=self.engine_index
                    ),
                )
            )

    def _process_output_queue(self) -> None:
        """Encode and send outputs; send a heartbeat (and the load, to the DP coordinator)
        whenever one is due."""
        encoder = MessageEncoder()
        interval = ENGINE_HEARTBEAT_INTERVAL_S.get()
        sock = make_socket(
            self._ctx, self.addresses.output_addr, zmq.PUSH, bind=False, linger_ms=_OUTPUT_LINGER_MS
        )
        load_reporter = None
        if self.stats_addr is not None:
            load_reporter = _LoadReporter(
                make_socket(self._ctx, self.stats_addr, zmq.PUSH, bind=False)
            )
        next_heartbeat = time.monotonic()
        try:
            while True:
                # A busy engine's load changes between outputs too (requests arrive).
                wakeup = (
                    next_heartbeat
                    if self.idle or load_reporter is None
                    else min(next_heartbeat, time.monotonic() + _LOAD_REPORT_INTERVAL_S)
                )
                try:
                    item = self.output_queue.get(timeout=max(wakeup - time.monotonic(), 0))
                except queue.Empty:
                    item = None
                if item is _SHUTDOWN:
                    return
                if item is not None:
                    sock.send_multipart(encoder.encode(*item), copy=False)
                heartbeat_due = time.monotonic() >= next_heartbeat
                if heartbeat_due:
                    sock.send_multipart(encoder.encode(MsgType.HEARTBEAT, self.make_heartbeat()))
                    next_heartbeat = time.monotonic() + interval
                if load_reporter is not None:
                    load_reporter.maybe_send(self.make_load(), force=heartbeat_due)
        except Exception:  # noqa: BLE001 - nothing else can report it; the api sees silence
            logger.exception("output thread failed")
        finally:
            sock.close()  # lingers until the queued messages (a DEAD sentinel) are out
            if load_reporter is not None:
                load_reporter.socket.close()


class _LoadReporter:
    """Sends the engine's load to the DP coordinator when it changed, at most every
    _LOAD_REPORT_INTERVAL_S, and with every heartbeat (the coordinator's liveness signal).

    Args:
        socket: a PUSH connected to the coordinator's stats address.
    """

    def __init__(self, socket: zmq.Socket):
        self.socket = socket
        self._encoder = msgspec.msgpack.Encoder()
        self._last_load: EngineLoad | None = None
        self._last_send_time = 0.0

    def maybe_send(self, load: EngineLoad, force: bool) -> None:
        now = time.monotonic()
        changed = load != self._last_load
        if force or (changed and now - self._last_send_time >= _LOAD_REPORT_INTERVAL_S):
            # NOBLOCK: a coordinator that is gone must never stall the outputs.
            try:
                self.socket.send(self._encoder.encode(load), zmq.NOBLOCK)
            except zmq.Again:
                return
            self._last_load, self._last_send_time = load, now


# ---------------------------------------------------------------------- process entry point


def run_engine_core(
    config: EngineConfig,
    model_dir: str,
    addresses: EngineAddresses,
    engine_index: int = 0,
    watch_parent: bool = False,
    stats_addr: str | None = None,
    num_local_engines: int = 1,
    frontend_timeout_s: float | None = None,
) -> int:
    """Run one engine core until SIGTERM (exit code 0) or a fatal error (DEAD sent, 1).

    Args:
        config: the engine config.
        model_dir: a resolved HF-style model folder.
        addresses: the api's ROUTER (input) and PULL (output) addresses.
        engine_index: this engine's index.
        watch_parent: exit when the launching process dies (children of `kvserve serve`).
        stats_addr: the DP coordinator's load address (data parallelism), else None.
        num_local_engines: engine cores on this host, which share its CPU cores.
        frontend_timeout_s: exit (code 0) after this long without a message from the api
            (engines that are not the api's children), None: never.
    """
    _install_signal_handlers(ignore_sigint=watch_parent)
    _configure_torch_threads(num_local_engines)
    proc = EngineCoreProc(
        addresses,
        engine_index,
        parent_pid=os.getppid() if watch_parent else None,
        stats_addr=stats_addr,
        frontend_timeout_s=frontend_timeout_s,
    )
    exit_code = 0
    try:
        proc.start(config, model_dir)
        if config.parallel.executor == "uni" and CPU_THREADS_BIND.get():
            from kvserve.kernels.cpu import bind_threads_to_share

            bind_threads_to_share(engine_index % num_local_engines, num_local_engines)
        proc.run_busy_loop()
    except SystemExit:
        logger.info("engine core %d shutting down", engine_index)
    except Exception as exc:  # noqa: BLE001 - report every failure to the api, then exit 1
        logger.exception("engine core %d failed", engine_index)
        proc.send_dead(f"{type(exc).__name__}: {exc}")
        exit_code = 1
    finally:
        proc.shutdown()
    return exit_code


def _install_signal_handlers(ignore_sigint: bool) -> None:
    def _exit(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _exit)
    # Ctrl+C reaches the whole process group: under a launcher, the launcher decides when
    # the engine stops (after draining); alone, Ctrl+C stops it.
    signal.signal(signal.SIGINT, signal.SIG_IGN if ignore_sigint else _exit)


def _configure_torch_threads(num_local_engines: int = 1) -> None:
    """Share the cores this process may run on among the host's engine cores (torch counts
    physical cores only); OMP_NUM_THREADS overrides."""
    import torch

    num_cores = len(os.sched_getaffinity(0))
    num_threads = OMP_NUM_THREADS.get() or max(1, num_cores // num_local_engines)
    torch.set_num_threads(num_threads)
    logger.info("engine core uses %d torch threads", num_threads)
