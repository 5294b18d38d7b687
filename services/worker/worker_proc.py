"""The worker process: one per rank, fed by the engine core's shared-memory ring.

    engine core (MpExecutor)                       worker rank r (this module)
    ------------------------                       ---------------------------
    PULL bind    <-- READY  WorkerReady ---------   PUSH connect       every rank, once
    ring writer  --- CALL WorkerCall ----------->   ring reader r  ->  Worker.call
    PULL         <-- REPLY WorkerCallResult ----                       each rank called
    ring writer  --- EXECUTE SchedulerOutput --->   ring reader r  ->  Worker.execute_model
    PULL         <-- OUTPUT ModelRunnerOutput --                       driver rank only
    ring writer  --- SHUTDOWN ------------------>                      exit 0
                 <-- FAILURE WorkerFailure -----   any rank, on any exception, then exit 1

The driver rank is TP rank 0 of the last pipeline stage (rank 0 without PP). The ranks also
talk among themselves through torch.distributed (gloo on CPU, nccl on CUDA), rendezvousing
at --distributed-init-method: all-reduces within a stage, hidden states between stages, and
the driver's sampled ids to every rank.

CALL is MpExecutor.collective_rpc (the KV cache allocation, the start-up facts): every rank
reads it, the ranks it lists run the named Worker method and answer.

Ring messages are one type byte and a msgpack body; result messages are two ZMQ frames,
the type byte and the msgpack body. A worker whose engine process is gone exits by itself.

Heartbeats: a daemon thread of every worker writes time.monotonic() (one clock for the whole
host) into its slot of a shared array every HEARTBEAT_INTERVAL_S, whatever the rank is doing;
the executor reads the slots while it waits: a worker silent for
KVSERVE_WORKER_HEARTBEAT_TIMEOUT_S is suspect, and hung once it also used no CPU time and
waited for none for KVSERVE_WORKER_HUNG_TIMEOUT_S (SIGSTOP, a stopped VM).

`worker_main(WorkerOptions)` is both the multiprocessing target and the `kvserve worker` entry
point.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from collections.abc import MutableSequence

import msgspec
import zmq

from kvserve.shared.config import EngineConfig
from kvserve.shared.env import CPU_THREADS_BIND
from kvserve.shared.launch_options import WorkerOptions
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import (
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerCall,
    WorkerCallResult,
    WorkerFailure,
)
from kvserve.shared.process_exit import exit_process
from kvserve.shared.shm_ring import ShmRingBuffer, ShmRingHandle
from kvserve.shared.transport import make_socket

logger = init_logger(__name__)

# Ring message types (engine core -> every rank).
EXECUTE = b"E"
CALL = b"C"
SHUTDOWN = b"S"
# Result message types (a rank -> engine core).
READY = b"R"
REPLY = b"A"
OUTPUT = b"O"
FAILURE = b"F"


HEARTBEAT_INTERVAL_S = 1.0


class EngineGoneError(Exception):
    """The engine-core process that started this worker has exited."""


def worker_main(options: WorkerOptions, worker_cls: type | None = None) -> int:
    """Run one worker rank until SHUTDOWN, an error, or the engine's exit; the exit code.

    worker_cls: the Worker class to run (services/worker/worker.py's by default).
    """
    config = options.engine_config
    # Ctrl-C reaches the whole process group: the engine core decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_torch_threads(config.parallel.world_size)
    proc = WorkerProc(
        config,
        options.model_dir,
        options.rank,
        options.ring_handle,
        options.result_addr,
        options.distributed_init_method,
        worker_cls,
    )
    return proc.run()


def configure_torch_threads(num_local_ranks: int) -> None:
    """Share the cores among the ranks on this host: max(1, cores // ranks) threads each.

    Cores are OMP_NUM_THREADS when set (the engine's budget), else the affinity mask. More
    threads than that only make the ranks preempt each other mid-matmul, and a rank that
    waits in a collective for a preempted peer wastes its whole step.
    """
    import torch

    from kvserve.shared.env import OMP_NUM_THREADS

    num_cores = OMP_NUM_THREADS.get() or len(os.sched_getaffinity(0))
    num_threads = max(1, num_cores // num_local_ranks)
    torch.set_num_threads(num_threads)
    logger.info(
        "worker uses %d torch threads (%d cores, %d ranks)", num_threads, num_cores, num_local_ranks
    )


def start_heartbeat(beats: MutableSequence[float], rank: int) -> None:
    """Beat into beats[rank] from a daemon thread, for as long as the process runs."""

    def beat() -> None:
        while True:
            beats[rank] = time.monotonic()
            time.sleep(HEARTBEAT_INTERVAL_S)

    threading.Thread(target=beat, name="WorkerHeartbeat", daemon=True).start()


def run_worker_process(
    options: WorkerOptions,
    beats: MutableSequence[float] | None = None,
    worker_cls: type | None = None,
) -> None:
    """multiprocessing target: worker_main, with its result as the process's exit code.

    Exits through shared/process_exit.py, skipping interpreter finalization: after
    torch.distributed was used, native destructors (gloo, the c10d store) hung there for
    seconds (torch 2.13 on CPU), until the executor killed the process. Everything the
    worker owns (sockets, the ring, the process groups) is already closed by then.
    """
    if beats is not None:
        start_heartbeat(beats, options.rank)
    exit_process(worker_main(options, worker_cls))


class WorkerProc:
    """The loop around one Worker: ring in, ZMQ out.

    Args:
        config: the engine config.
        model_dir: a resolved HF-style model folder.
        rank: this worker's global rank (also its reader index in the ring).
        ring_handle: the engine core's broadcast ring.
        result_addr: where to PUSH ready messages, outputs and failures.
        distributed_init_method: the torch.distributed rendezvous (TP x PP > 1).
        worker_cls: the Worker class to run (services/worker/worker.py's by default).
    """

    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        rank: int,
        ring_handle: ShmRingHandle,
        result_addr: str,
        distributed_init_method: str | None = None,
        worker_cls: type | None = None,
    ):
        from kvserve.services.worker.parallel_state import driver_rank  # torch: worker side only

        self.config = config
        self.distributed_init_method = distributed_init_method
        parallel = config.parallel
        self.is_driver = rank == driver_rank(
            parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        )
        self.model_dir = model_dir
        self.rank = rank
        self.ring_handle = ring_handle
        self.result_addr = result_addr
        self.worker_cls = worker_cls
        # Reparenting is how a process learns, without help, that its parent died.
        self.parent_pid = os.getppid()
        self.encoder = msgspec.msgpack.Encoder()

    def run(self) -> int:
        ctx = zmq.Context(io_threads=1)
        # Lingers so a last FAILURE gets out; never blocks exit for long on a dead engine.
        sock = make_socket(ctx, self.result_addr, zmq.PUSH, bind=False, linger_ms=2000)
        ring = ShmRingBuffer.attach(self.ring_handle, self.rank)
        try:
            self._serve(ring, sock)
            return 0
        except EngineGoneError:
            logger.warning("worker rank %d: the engine core is gone; exiting", self.rank)
            return 0
        except Exception:
            logger.exception("worker rank %d failed", self.rank)
            failure = WorkerFailure(self.rank, traceback.format_exc())
            sock.send_multipart([FAILURE, self.encoder.encode(failure)])
            return 1
        finally:
            ring.close()
            sock.close()
            ctx.term()

    def _serve(self, ring: ShmRingBuffer, sock: zmq.Socket) -> None:
        from kvserve.services.worker.worker import Worker

        worker_cls = self.worker_cls or Worker
        worker = worker_cls(self.config, self.model_dir, self.rank, self.distributed_init_method)
        if worker.device.type == "cpu" and CPU_THREADS_BIND.get():
            from kvserve.kernels.cpu import bind_threads_to_share

            bind_threads_to_share(self.rank, self.config.parallel.world_size)
        self._serve_steps(worker, ring, sock)
        # Only on SHUTDOWN: after a failure, a peer may sit in a collective with us, and
        # leaving the group could wait on it; process exit frees everything anyway.
        worker.shutdown()
        logger.info("worker rank %d shut down", self.rank)

    def _serve_steps(self, worker, ring: ShmRingBuffer, sock: zmq.Socket) -> None:
        ready = worker.ready_message()
        sock.send_multipart([READY, self.encoder.encode(ready)])
        scheduler_output_decoder = msgspec.msgpack.Decoder(SchedulerOutput)
        call_decoder = msgspec.msgpack.Decoder(WorkerCall)
        while True:
            message = ring.dequeue(check_alive=self._check_engine_alive)
            kind, body = message[:1], memoryview(message)[1:]
            if kind == EXECUTE:
                output: ModelRunnerOutput = worker.execute_model(
                    scheduler_output_decoder.decode(body)
                )
                if self.is_driver:
                    sock.send_multipart([OUTPUT, self.encoder.encode(output)], copy=False)
            elif kind == CALL:
                self._answer_call(worker, call_decoder.decode(body), sock)
            elif kind == SHUTDOWN:
                return
            else:
                raise ValueError(f"unknown ring message type {kind!r}")

    def _answer_call(self, worker, call: WorkerCall, sock: zmq.Socket) -> None:
        """Run the call if it names this rank, and send the answer back."""
        if self.rank not in call.ranks:
            return
        result = worker.call(call.method, call.args, call.kwargs)
        reply = WorkerCallResult(self.rank, msgspec.Raw(self.encoder.encode(result)))
        sock.send_multipart([REPLY, self.encoder.encode(reply)])

    def _check_engine_alive(self) -> None:
        if os.getppid() != self.parent_pid:
            raise EngineGoneError()
