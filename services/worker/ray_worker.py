"""RayWorker: one TP/PP rank as a Ray actor, for the ray executor (scheduler/ray_executor.py).

The actor wraps the Worker the mp worker processes run (services/worker/worker.py); only the
transport differs: every call is a Ray remote call, and the hot bodies are msgspec bytes.

    engine core (RayExecutor)                      RayWorker actor, rank r
    -------------------------                      -----------------------
    placement()                 ---------------->  (node id, node ip, hostname, pid)
    free_port()                 ---------------->  a free TCP port on its node (rank 0 only)
    start(config, rank, ...)    ---------------->  Worker(...): WorkerReady bytes
    rpc(WorkerCall bytes)       ---------------->  the named Worker method's answer, bytes
    execute_model(step bytes)   ---------------->  ModelRunnerOutput bytes (driver), else None
    ping()                      ---------------->  None: liveness, answered mid-step too

The ranks meet over torch.distributed exactly as the mp workers do (gloo on CPU, nccl on
CUDA), at rank 0's node. ping() runs in a concurrency group of its own, so it answers while
a step runs; a process that answers nothing (killed, frozen) is found by the executor.
Exceptions need no protocol of their own: Ray hands each one, with its traceback, to the
caller as a RayTaskError.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

import msgspec
import ray

from kvserve.shared.config import EngineConfig
from kvserve.shared.messages import SchedulerOutput, WorkerCall

if TYPE_CHECKING:
    from kvserve.services.worker.worker import Worker

HEALTH_GROUP = "health"


class RayActorPlacement(msgspec.Struct, frozen=True):
    """Where an actor landed, before it is given a rank."""

    node_id: str
    node_ip: str
    hostname: str
    pid: int


@ray.remote(concurrency_groups={HEALTH_GROUP: 1})  # type: ignore[call-overload]  # Ray's stubs lack it
class RayWorker:
    """A worker rank inside a Ray actor. The constructor only records the process: the
    model is loaded by start(), once the executor knows every actor's node."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.is_driver = False
        self.encoder = msgspec.msgpack.Encoder()
        self.step_decoder = msgspec.msgpack.Decoder(SchedulerOutput)
        self.call_decoder = msgspec.msgpack.Decoder(WorkerCall)

    def placement(self) -> bytes:
        context = ray.get_runtime_context()
        placement = RayActorPlacement(
            context.get_node_id(), ray.util.get_node_ip_address(), socket.gethostname(), os.getpid()
        )
        return self.encoder.encode(placement)

    def free_port(self) -> int:
        """A port free on this node now, for the torch.distributed store rank 0 binds."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((ray.util.get_node_ip_address(), 0))
            return sock.getsockname()[1]

    def start(
        self,
        config_bytes: bytes,
        model_dir: str,
        rank: int,
        distributed_init_method: str | None,
        num_host_ranks: int,
    ) -> bytes:
        """Build this rank's Worker (joining its peers when TP x PP > 1); WorkerReady bytes.

        Args:
            config_bytes: the msgpack-encoded EngineConfig.
            model_dir: the model folder, at the same path on every node.
            rank: this actor's global rank.
            distributed_init_method: the ranks' rendezvous, tcp://HOST:PORT.
            num_host_ranks: ranks on this host, which share its cores.
        """
        # torch and the model code load here, not at import: the executor's process, which
        # imports this module to define the actor class, need not import them.
        from kvserve.services.worker.parallel_state import driver_rank
        from kvserve.services.worker.worker import Worker
        from kvserve.services.worker.worker_proc import configure_torch_threads

        config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        configure_torch_threads(num_host_ranks)
        parallel = config.parallel
        self.is_driver = rank == driver_rank(
            parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        )
        self.worker = Worker(config, model_dir, rank, distributed_init_method)
        return self.encoder.encode(self.worker.ready_message())

    def rpc(self, call: bytes) -> bytes:
        """Run a msgpack-encoded WorkerCall (RayExecutor.collective_rpc); the msgpack-encoded
        answer of the Worker method it names."""
        assert self.worker is not None, "start() comes first"
        request = self.call_decoder.decode(call)
        return self.encoder.encode(self.worker.call(request.method, request.args, request.kwargs))

    def execute_model(self, step: bytes) -> bytes | None:
        """Run one msgpack-encoded SchedulerOutput; the driver rank returns its output."""
        assert self.worker is not None, "start() comes first"
        output = self.worker.execute_model(self.step_decoder.decode(step))
        return self.encoder.encode(output) if self.is_driver else None

    @ray.method(concurrency_group=HEALTH_GROUP)
    def ping(self) -> None:
        return None
