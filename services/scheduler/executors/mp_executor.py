"""MpExecutor: one worker process per rank, fed through a shared-memory ring.

Every rank reads every SchedulerOutput from the ring (one write, N reads); only the driver
rank (TP rank 0 of the last pipeline stage) answers, with a msgspec-encoded
ModelRunnerOutput on a ZMQ PUSH -> PULL socket. collective_rpc goes the same way: one
WorkerCall on the ring, one WorkerCallResult from each rank it names. The protocol is drawn in
services/worker/worker_proc.py. Before spawning, the executor checks that the model splits
over TP x PP (a ValueError, not a worker traceback) and picks the torch.distributed
rendezvous the ranks meet at: --master-addr, and --master-port or a free port.

Every wait here polls the result socket together with the workers' process sentinels, so a
dead worker turns the next call into a RuntimeError naming its rank within a second or so,
never a hang; it also reads the workers' heartbeats (a shared array each rank writes every
second). A rank silent for KVSERVE_WORKER_HEARTBEAT_TIMEOUT_S is only suspect (logged): on a
busy host it may be slow or starved of CPU. It is hung, and fails the call as a dead one
does, once it went KVSERVE_WORKER_HUNG_TIMEOUT_S without using CPU time or waiting for a
CPU (shared/progress.py: stopped or blocked). Once a worker has died, hung or failed, the
executor stays dead: every later call raises the same error (the engine core then dies and
the api answers 503).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import shutil
import signal
import socket
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import psutil
import zmq

from kvserve.services.scheduler.executors.executor import RankedExecutor, Ranks
from kvserve.services.worker import worker_proc
from kvserve.services.worker.parallel_check import load_hf_config, verify_parallel_sizes
from kvserve.services.worker.parallel_state import driver_rank
from kvserve.shared.config import EngineConfig
from kvserve.shared.env import (
    WORKER_HEARTBEAT_TIMEOUT_S,
    WORKER_HUNG_TIMEOUT_S,
    read_hung_timeout_s,
)
from kvserve.shared.launch_options import WorkerOptions
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import (
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerCall,
    WorkerCallResult,
    WorkerFailure,
    WorkerReady,
)
from kvserve.shared.progress import ProcessProgress, SilenceWatch
from kvserve.shared.shm_ring import ShmRingBuffer, ShmRingHandle
from kvserve.shared.transport import make_socket

logger = init_logger(__name__)

_POLL_INTERVAL_S = 1.0  # the longest a wait goes without looking at the deadline
# A rank silent this long has missed a beat: from then on each check samples its CPU use.
_SILENT_AFTER_S = 2 * worker_proc.HEARTBEAT_INTERVAL_S


class MpExecutor(RankedExecutor):
    """
    Args:
        config: the engine config; world_size = TP x PP worker processes are started.
        model_dir: a resolved HF-style model folder.
        start_timeout_s: limit for a worker to load its model and report ready, and for
            the KV cache allocation.
        execute_timeout_s: limit for one step; a slower step means a hung worker.
        worker_cls: the Worker class each process runs, importable by name (a subclass adds
            methods; tests use one); services/worker/worker.py's by default.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        start_timeout_s: float = 600.0,
        execute_timeout_s: float = 300.0,
        worker_cls: type | None = None,
    ):
        parallel = config.parallel
        self.world_size = parallel.world_size
        self.driver_rank = driver_rank(
            parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        )
        if self.world_size > 1:
            verify_parallel_sizes(
                load_hf_config(model_dir),
                parallel.tensor_parallel_size,
                parallel.pipeline_parallel_size,
            )
        self._init_timeouts(start_timeout_s, execute_timeout_s)
        self._encoder = msgspec.msgpack.Encoder()
        self._send_buf = bytearray()  # reused for every ring message
        self._output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
        self._reply_decoder = msgspec.msgpack.Decoder(WorkerCallResult)

        # The result socket lives in a private folder, removed on shutdown.
        # TODO(config): take the address from config once it has same-host ipc addresses.
        self._ipc_dir = tempfile.mkdtemp(prefix="kvserve-mp-")
        result_addr = self.result_addr = f"ipc://{self._ipc_dir}/results"
        self._zmq_ctx = zmq.Context(io_threads=1)
        self._results = make_socket(self._zmq_ctx, result_addr, zmq.PULL, bind=True)
        self._ring = ShmRingBuffer.create(num_readers=self.world_size)
        self._procs: list[BaseProcess] = []
        # Each rank's last heartbeat (time.monotonic(); 0 until its first).
        self._beats = multiprocessing.get_context("spawn").Array("d", self.world_size, lock=False)
        try:
            self._start_workers(config, model_dir, result_addr, worker_cls)
        except BaseException:
            _release(self._procs, self._ring, self._results, self._zmq_ctx, self._ipc_dir)
            raise
        # Each rank's silence: slow or starved, or hung (see the module docstring).
        self._silences = [SilenceWatch([ProcessProgress(pid)], now=0.0) for pid in self.worker_pids]
        self._suspect_ranks: set[int] = set()
        # Processes, socket and segment are released even if shutdown() is never called
        # (the object is collected, or the interpreter exits).
        self._finalizer = weakref.finalize(
            self, _release, self._procs, self._ring, self._results, self._zmq_ctx, self._ipc_dir
        )
        self._poller = zmq.Poller()
        self._poller.register(self._results, zmq.POLLIN)
        for proc in self._procs:
            self._poller.register(proc.sentinel, zmq.POLLIN)
        try:
            readies = self._wait_ready()
        except BaseException:
            self._finalizer()
            raise
        self._take_readies(readies)

    def _init_timeouts(self, start_timeout_s: float, execute_timeout_s: float) -> None:
        """How long a start, a step, a missing heartbeat and a hang may last (see the
        module docstring); none has run out yet."""
        self.start_timeout_s = start_timeout_s
        self.execute_timeout_s = execute_timeout_s
        self._heartbeat_timeout_s = WORKER_HEARTBEAT_TIMEOUT_S.get()
        self._hung_timeout_s = read_hung_timeout_s(
            WORKER_HUNG_TIMEOUT_S, WORKER_HEARTBEAT_TIMEOUT_S
        )
        self._dead_reason: str | None = None

    # ------------------------------------------------------------------ Executor API

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers, by rank."""
        pids = []
        for proc in self._procs:
            assert proc.pid is not None, "a worker is listed only once started"
            pids.append(proc.pid)
        return pids

    @property
    def ring_handle(self) -> ShmRingHandle:
        """The shared-memory ring the workers read (its segment name, for inspection)."""
        return self._ring.handle

    def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        ranks: Ranks = None,
        result_type: Any = Any,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """One WorkerCall on the ring; the answers of the ranks it names (see Executor)."""
        targets = self.resolve_ranks(ranks)
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        call = WorkerCall(method, list(args), dict(kwargs or {}), targets)
        self._broadcast(worker_proc.CALL, call, timeout_s)
        answers: dict[int, msgspec.Raw] = {}
        while len(answers) < len(targets):
            reply = self._receive(
                worker_proc.REPLY, self._reply_decoder, timeout_s, f"running {method} on {targets}"
            )
            answers[reply.rank] = reply.result
        return [msgspec.msgpack.decode(answers[rank], type=result_type) for rank in targets]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Broadcast one step to every rank and return the driver rank's answer."""
        self._broadcast(worker_proc.EXECUTE, scheduler_output, self.execute_timeout_s)
        return self._receive(
            worker_proc.OUTPUT, self._output_decoder, self.execute_timeout_s, "executing a step"
        )

    def check_health(self) -> None:
        self._raise_if_dead()
        self._check_workers()

    def shutdown(self) -> None:
        """Ask the workers to exit, then release processes, socket and shared memory."""
        self._finalizer()

    # ------------------------------------------------------------------ start-up

    def _start_workers(
        self, config: EngineConfig, model_dir: str, result_addr: str, worker_cls: type | None
    ) -> None:
        # spawn, not fork: a forked child would inherit this process's threads (ZMQ IO,
        # torch pools) in whatever state they were in.
        mp_ctx = multiprocessing.get_context("spawn")
        init_method = distributed_init_method(config) if self.world_size > 1 else None
        for rank in range(self.world_size):
            options = WorkerOptions(
                rank=rank,
                model_dir=model_dir,
                engine_config=config,
                ring_handle=self._ring.handle,
                result_addr=result_addr,
                distributed_init_method=init_method,
            )
            proc = mp_ctx.Process(
                target=worker_proc.run_worker_process,
                args=(options, self._beats, worker_cls),
                name=f"kvserve-worker-{rank}",
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)  # as it starts, so a failure releases the earlier ones
        logger.info("started %d worker process(es): pids %s", self.world_size, self.worker_pids)

    def _wait_ready(self) -> list[WorkerReady]:
        decoder = msgspec.msgpack.Decoder(WorkerReady)
        readies: dict[int, WorkerReady] = {}
        while len(readies) < self.world_size:
            ready = self._receive(
                worker_proc.READY,
                decoder,
                self.start_timeout_s,
                "waiting for the workers to load the model",
            )
            assert ready.rank not in readies, f"rank {ready.rank} reported ready twice"
            readies[ready.rank] = ready
        return [readies[rank] for rank in range(self.world_size)]

    # ------------------------------------------------------------------ transport

    def _broadcast(self, kind: bytes, body, timeout_s: float) -> None:
        self._raise_if_dead()
        buf = self._send_buf
        buf[:] = kind
        if body is not None:
            self._encoder.encode_into(body, buf, 1)
        try:
            self._ring.enqueue(buf, timeout=timeout_s, check_alive=self._check_workers)
        except TimeoutError:
            self._die(f"the workers took no message from the ring for {timeout_s:.0f} s")

    def _receive(
        self, kind: bytes, decoder: msgspec.msgpack.Decoder, timeout_s: float, doing: str
    ) -> Any:
        """The decoded body of the next result message of type `kind`; any other message
        that is not a FAILURE is dropped (logged), and the wait goes on."""
        self._raise_if_dead()
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._die(f"no answer from the workers within {timeout_s:.0f} s while {doing}")
            # Whole milliseconds: what Poller.poll makes of a float anyway.
            events = dict(self._poller.poll(int(1000 * min(remaining, _POLL_INTERVAL_S))))
            if self._results in events:
                # Messages first: a failing worker's traceback beats "it died".
                result = self._accept(kind, decoder, self._results.recv_multipart(copy=False))
                if result is not None:
                    return result
            self._check_workers()

    def _accept(
        self, expected: bytes, decoder: msgspec.msgpack.Decoder, frames: list[zmq.Frame]
    ) -> Any:
        """One result message's decoded body, or None for a malformed one (the wrong frame
        count or type, a body that does not decode): dropped with one log line, as anything
        a peer on the result socket may send must never bring the engine down."""
        if len(frames) != 2:
            logger.error("mp executor: dropped a result message of %d frames", len(frames))
            return None
        kind_frame, body_frame = frames
        kind = kind_frame.bytes
        if kind == worker_proc.FAILURE:
            self._raise_failure(body_frame)
        if kind != expected:
            logger.error(
                "mp executor: dropped a %r message from the workers while waiting for %r",
                kind[:8],
                expected,
            )
            return None
        try:
            return decoder.decode(body_frame.buffer)
        except msgspec.DecodeError as exc:
            logger.error("mp executor: dropped an undecodable %r message: %s", kind, exc)
            return None

    def _raise_failure(self, body_frame: zmq.Frame) -> None:
        try:
            failure = msgspec.msgpack.decode(body_frame.buffer, type=WorkerFailure)
        except msgspec.DecodeError as exc:
            logger.error("mp executor: dropped an undecodable FAILURE message: %s", exc)
            return
        self._die(f"worker rank {failure.rank} failed:\n{failure.message}")

    # ------------------------------------------------------------------ liveness

    def _check_workers(self) -> None:
        """Raise RuntimeError naming the first dead (or hung) rank, if any."""
        now = time.monotonic()
        for rank, proc in enumerate(self._procs):
            if proc.exitcode is None:
                self._check_silence(rank, now)
                continue
            # It may have sent its traceback just before dying: prefer that message.
            if self._results.poll(100):
                frames = self._results.recv_multipart(copy=False)
                if len(frames) == 2 and frames[0].bytes == worker_proc.FAILURE:
                    self._raise_failure(frames[1])
            self._die(f"worker rank {rank} (pid {proc.pid}) died: {_describe_exit(proc)}")

    def _check_silence(self, rank: int, now: float) -> None:
        """Log a rank silent past the heartbeat timeout as suspect, and again when it beats
        again; die once it is hung."""
        last_beat, silence = self._beats[rank], self._silences[rank]
        if not last_beat:
            return  # not started beating yet
        silence.heard(last_beat)
        silent_s = silence.silent_s(now)
        if silent_s > _SILENT_AFTER_S:  # a beat is missing: the window of no progress opens
            silence.look(now)
        if silent_s <= self._heartbeat_timeout_s:
            if rank in self._suspect_ranks:
                self._suspect_ranks.discard(rank)
                logger.warning("worker rank %d beats again: healthy", rank)
            return
        pid = self._procs[rank].pid
        if silence.is_hung(now, self._hung_timeout_s):
            self._die(
                f"worker rank {rank} (pid {pid}) has not beaten for {silent_s:.0f} s and used "
                f"no CPU time and waited for none for {silence.quiet_s(now):.0f} s (limit "
                f"{self._hung_timeout_s:g} s, {WORKER_HUNG_TIMEOUT_S.name}): it is hung "
                f"(stopped or blocked)"
            )
        if rank not in self._suspect_ranks:
            self._suspect_ranks.add(rank)
            logger.warning(
                "worker rank %d (pid %s) has not beaten for %.0f s (limit %g s, %s): suspect; "
                "%s; it fails its engine core once it made no progress for %g s (%s)",
                rank,
                pid,
                silent_s,
                self._heartbeat_timeout_s,
                WORKER_HEARTBEAT_TIMEOUT_S.name,
                silence.finding or "looking at its CPU use",
                self._hung_timeout_s,
                WORKER_HUNG_TIMEOUT_S.name,
            )

    def _raise_if_dead(self) -> None:
        if self._dead_reason is not None:
            raise RuntimeError(self._dead_reason)

    def _die(self, reason: str) -> None:
        self._dead_reason = reason
        logger.error("mp executor: %s", reason)
        raise RuntimeError(reason)


def distributed_init_method(config: EngineConfig) -> str:
    """tcp://master_addr:port for the ranks' torch.distributed rendezvous.

    Without --master-port, the OS picks a free port; it is released again before rank 0
    binds it, a short window in which another process could take it (vLLM does the same).
    """
    parallel = config.parallel
    port = parallel.master_port
    if port is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((parallel.master_addr, 0))
            port = sock.getsockname()[1]
    return f"tcp://{parallel.master_addr}:{port}"


def _describe_exit(proc: BaseProcess) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _release(
    procs: list[BaseProcess],
    ring: ShmRingBuffer,
    results: zmq.Socket,
    zmq_ctx: zmq.Context,
    ipc_dir: str,
) -> None:
    """Stop every worker (politely, then not), close the socket, unlink the ring.

    A module function, not a method: weakref.finalize must not hold the executor itself.
    """
    try:
        # Live ranks take SHUTDOWN from the ring and exit; a dead rank only keeps its chunk
        # unread, so the write still succeeds while free chunks remain.
        ring.enqueue(worker_proc.SHUTDOWN, timeout=0.5)
    except (RuntimeError, TimeoutError):
        pass  # the ring is out of step or full: the workers get terminated below
    for proc in procs:  # a frozen (stopped) rank would only eat the polite wait below
        with contextlib.suppress(psutil.NoSuchProcess, ValueError):
            if proc.pid is not None and psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED:
                logger.warning("worker %s is stopped (frozen); killing it", proc.name)
                proc.kill()
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            logger.warning("worker %s did not exit; terminating it", proc.name)
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    results.close(linger=0)
    zmq_ctx.term()
    ring.close()
    shutil.rmtree(ipc_dir, ignore_errors=True)
