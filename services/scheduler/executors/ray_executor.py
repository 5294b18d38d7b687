"""RayExecutor: the worker ranks as Ray actors in a placement group of a running Ray cluster.

    engine core (this process, a Ray driver)
        │ ray.init(address): RAY_ADDRESS, else the cluster `ray start` recorded here
        │ placement group: TP x PP bundles of {"CPU": 1} ({"GPU": 1} on a GPU cluster), PACK
        ▼
    RayWorker actor per bundle (services/worker/ray_worker.py) ── node A: ranks 0 … k-1
                                                              └─ node B: ranks k … N-1
        ranks meet over torch.distributed at rank 0's node (a free port there)

Ranks follow the nodes: the engine core's node first, then by node address, so the TP
ranks of a stage share a node where the layout allows (TP within a node, PP across nodes,
as vLLM advises). Each step goes to every actor as one remote call carrying the
msgpack-encoded SchedulerOutput; the driver rank (TP rank 0 of the last stage) returns the
ModelRunnerOutput, the others None. collective_rpc is one remote `rpc` per rank named,
carrying the msgpack-encoded WorkerCall.

No cluster, no fallback: without a Ray cluster to join this fails at once, saying to run
`ray start --head`. A private Ray instance started here would spawn Ray's daemons inside the
engine, reach only this node, and hide a mistyped RAY_ADDRESS; on one node the mp executor
does the same work with less.

Liveness as in the mp executor: every wait polls at most a second at a time; a dead actor
(RayActorError) turns the call into a RuntimeError naming its rank. A rank that answers no
ping (a concurrency group of its own, so a busy rank answers) for
KVSERVE_WORKER_HEARTBEAT_TIMEOUT_S is suspect (logged), and hung, which fails the call the
same way, after KVSERVE_WORKER_HUNG_TIMEOUT_S: an actor may run on another node, whose CPU
use this process cannot read, so silence for the whole budget is all there is to go by.
Once dead, always dead: the engine core then dies and the api answers 503.
"""

from __future__ import annotations

import re
import socket
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import msgspec
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvserve.services.scheduler.executors.executor import RankedExecutor, Ranks
from kvserve.services.worker.parallel_check import load_hf_config, verify_parallel_sizes
from kvserve.services.worker.parallel_state import driver_rank
from kvserve.services.worker.ray_worker import RayActorPlacement, RayWorker
from kvserve.shared.config import EngineConfig
from kvserve.shared.env import (
    RAY_ADDRESS,
    WORKER_HEARTBEAT_TIMEOUT_S,
    WORKER_HUNG_TIMEOUT_S,
    read_hung_timeout_s,
)
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import ModelRunnerOutput, SchedulerOutput, WorkerCall, WorkerReady

logger = init_logger(__name__)

_POLL_INTERVAL_S = 1.0  # the longest a wait goes without looking at deadlines and pings
_INLINE_STEP_BYTES = 100 << 10  # larger steps go to the object store once, not once per rank
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
_WORKER_ACTOR: Any = RayWorker  # an actor class (@ray.remote); mypy sees the plain class


class RayExecutor(RankedExecutor):
    """
    Args:
        config: the engine config; world_size = TP x PP actors are started.
        model_dir: a resolved HF-style model folder, at the same path on every node.
        start_timeout_s: limit for the actors to load the model and allocate the KV cache.
        execute_timeout_s: limit for one step; a slower step means a hung rank.
        placement_timeout_s: limit for the cluster to find room for every bundle.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        start_timeout_s: float = 600.0,
        execute_timeout_s: float = 300.0,
        placement_timeout_s: float = 60.0,
    ):
        parallel = config.parallel
        self.world_size = parallel.world_size
        if self.world_size > 1:
            verify_parallel_sizes(
                load_hf_config(model_dir),
                parallel.tensor_parallel_size,
                parallel.pipeline_parallel_size,
            )
        self.start_timeout_s = start_timeout_s
        self.execute_timeout_s = execute_timeout_s
        self._heartbeat_timeout_s = WORKER_HEARTBEAT_TIMEOUT_S.get()
        self._hung_timeout_s = read_hung_timeout_s(
            WORKER_HUNG_TIMEOUT_S, WORKER_HEARTBEAT_TIMEOUT_S
        )
        self.driver_rank = driver_rank(
            parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        )
        self._dead_reason: str | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
        self._pings: dict[ray.ObjectRef, int] = {}  # unanswered ping -> rank
        self._pings_sent_at = 0.0
        self._suspect_rank: int | None = None  # logged as suspect in this round of pings
        self._actors: list[Any] = []  # RayWorker handles, by rank
        self.placements: list[RayActorPlacement] = []  # where each rank's actor runs

        owns_connection = connect_to_cluster()
        # Filled as they are made, so a failure half-way releases what exists.
        self._resources: dict[str, Any] = {"actors": [], "placement_group": None}
        self._finalizer = weakref.finalize(self, _release, self._resources, owns_connection)
        try:
            self._actors, self.placements = self._place_actors(
                parallel.ray_placement_strategy, placement_timeout_s
            )
            readies = self._start_actors(config, model_dir)
        except BaseException:
            self._finalizer()
            raise
        self._take_readies(readies)

    # ------------------------------------------------------------------ Executor API

    @property
    def worker_pids(self) -> list[int]:
        """None for the api to watch: an actor may run on another host, and Ray reports an
        actor's death to this executor at once, which names its rank (`placements` has
        every rank's node and pid)."""
        return []

    def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        ranks: Ranks = None,
        result_type: Any = Any,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """One remote `rpc` per rank named; their answers (see Executor)."""
        self._raise_if_dead()
        targets = self.resolve_ranks(ranks)
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        call = self._encoder.encode(WorkerCall(method, list(args), dict(kwargs or {}), targets))
        refs = [self._actors[rank].rpc.remote(call) for rank in targets]
        answers = self._wait(refs, timeout_s, f"running {method} on {targets}", targets)
        return [msgspec.msgpack.decode(answer, type=result_type) for answer in answers]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Send one step to every rank and return the driver rank's answer."""
        self._raise_if_dead()
        step: Any = self._encoder.encode(scheduler_output)
        if len(step) > _INLINE_STEP_BYTES:
            step = ray.put(step)
        refs = [actor.execute_model.remote(step) for actor in self._actors]
        outputs = self._wait(refs, self.execute_timeout_s, "executing a step")
        return self._output_decoder.decode(outputs[self.driver_rank])

    def check_health(self) -> None:
        self._raise_if_dead()
        self._check_pings()

    def shutdown(self) -> None:
        """Kill the actors, free their placement group, leave the cluster if we joined it."""
        self._finalizer()

    # ------------------------------------------------------------------ start-up

    def _place_actors(
        self, strategy: str, timeout_s: float
    ) -> tuple[list[Any], list[RayActorPlacement]]:
        """One actor per bundle of a fresh placement group; (actors, placements) by rank."""
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        bundle = {"GPU": 1.0} if use_gpu else {"CPU": 1.0}
        group = placement_group([dict(bundle)] * self.world_size, strategy=strategy)
        self._resources["placement_group"] = group
        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
        if not ready:
            raise RuntimeError(
                f"the Ray cluster found no room within {timeout_s:.0f} s for {self.world_size} "
                f"worker bundle(s) of {bundle} ({strategy}): it has "
                f"{_resource_summary(ray.available_resources())} free of "
                f"{_resource_summary(ray.cluster_resources())}; add nodes "
                f"(`ray start --address HEAD:PORT`) or lower TP x PP"
            )
        actors = [
            _WORKER_ACTOR.options(
                num_cpus=0 if use_gpu else 1,
                num_gpus=1 if use_gpu else 0,
                scheduling_strategy=_bundle(group, index),
            ).remote()
            for index in range(self.world_size)
        ]
        self._resources["actors"] += actors
        decoder = msgspec.msgpack.Decoder(RayActorPlacement)
        bodies = self._wait(
            [actor.placement.remote() for actor in actors], self.start_timeout_s, "placing"
        )
        placements = [decoder.decode(body) for body in bodies]
        here = ray.get_runtime_context().get_node_id()

        def node_order(i: int) -> tuple[bool, str, str, int]:
            return placements[i].node_id != here, placements[i].node_ip, placements[i].node_id, i

        order = sorted(range(self.world_size), key=node_order)
        return [actors[i] for i in order], [placements[i] for i in order]

    def _start_actors(self, config: EngineConfig, model_dir: str) -> list[WorkerReady]:
        init_method = None
        if self.world_size > 1:
            # torch.distributed's store lives in rank 0: the rendezvous is at rank 0's node.
            port = config.parallel.master_port
            if port is None:
                port = self._wait([self._actors[0].free_port.remote()], 60.0, "picking a port")[0]
            init_method = f"tcp://{_host_for_url(self.placements[0].node_ip)}:{port}"
        ranks_per_host: dict[str, int] = {}
        for placement in self.placements:
            ranks_per_host[placement.hostname] = ranks_per_host.get(placement.hostname, 0) + 1
        config_bytes = msgspec.msgpack.encode(config)
        refs = [
            actor.start.remote(
                config_bytes, model_dir, rank, init_method, ranks_per_host[placement.hostname]
            )
            for rank, (actor, placement) in enumerate(zip(self._actors, self.placements))
        ]
        logger.info("ray executor: %d rank(s), rendezvous %s", self.world_size, init_method)
        for rank in range(self.world_size):
            logger.info("ray executor: rank %d is %s", rank, self._describe(rank))
        bodies = self._wait(refs, self.start_timeout_s, "waiting for the workers to load the model")
        decoder = msgspec.msgpack.Decoder(WorkerReady)
        return [decoder.decode(body) for body in bodies]

    # ------------------------------------------------------------------ waiting

    def _wait(
        self,
        refs: list[ray.ObjectRef],
        timeout_s: float,
        doing: str,
        ranks: list[int] | None = None,
    ) -> list[Any]:
        """The results of refs (one per rank of `ranks`, every rank by default), or
        RuntimeError naming a rank that failed, died, froze or did not answer in timeout_s."""
        ranks = list(range(len(refs))) if ranks is None else ranks
        rank_of = dict(zip(refs, ranks))
        index_of = {ref: index for index, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ranks = sorted(rank_of[ref] for ref in pending)
                self._die(
                    f"no answer from worker rank(s) {ranks} within {timeout_s:.0f} s while {doing}"
                )
            ready, pending = ray.wait(
                pending, num_returns=len(pending), timeout=min(remaining, _POLL_INTERVAL_S)
            )
            for ref in ready:
                results[index_of[ref]] = self._get(ref, rank_of[ref])
            if pending:
                self._check_pings()
        return results

    def _get(self, ref: ray.ObjectRef, rank: int) -> Any:
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as exc:  # ActorDiedError, ActorUnavailableError
            self._die(self._death_reason(rank, exc))
        except ray.exceptions.RayError as exc:  # RayTaskError: the method raised
            # A peer's death first shows as this rank's failed collective: name the cause.
            self._die(
                self._find_dead_rank()
                or f"worker rank {rank} failed:\n{_ANSI_ESCAPE.sub('', str(exc))}"
            )

    def _find_dead_rank(self, timeout_s: float = 2.0) -> str | None:
        """The death of the first rank whose actor is gone, if Ray knows of one by then."""
        pings = [actor.ping.remote() for actor in self._actors]
        ray.wait(pings, num_returns=len(pings), timeout=timeout_s)
        for rank, ping in enumerate(pings):
            try:
                ray.get(ping, timeout=0)
            except ray.exceptions.RayActorError as exc:
                return self._death_reason(rank, exc)
            except ray.exceptions.RayError:
                pass  # GetTimeoutError: alive but slow, or frozen; not what failed the step
        return None

    def _death_reason(self, rank: int, exc: Exception) -> str:
        return f"worker rank {rank} ({self._describe(rank)}) died: {_death_cause(exc)}"

    def _check_pings(self) -> None:
        """Collect the last round of pings, sending the next once every rank answered; a
        dead rank raises at once, one silent for the heartbeat limit is suspect, one silent
        for the hung budget is hung."""
        if not self._pings:
            if self._suspect_rank is not None:
                logger.warning("worker rank %d answers pings again: healthy", self._suspect_rank)
                self._suspect_rank = None
            self._pings = {actor.ping.remote(): rank for rank, actor in enumerate(self._actors)}
            self._pings_sent_at = time.monotonic()
            return
        ready, _ = ray.wait(list(self._pings), num_returns=len(self._pings), timeout=0)
        for ref in ready:
            self._get(ref, self._pings.pop(ref))
        silent_s = time.monotonic() - self._pings_sent_at
        if not self._pings or silent_s <= self._heartbeat_timeout_s:
            return
        rank = min(self._pings.values())
        if silent_s > self._hung_timeout_s:
            self._die(
                f"worker rank {rank} ({self._describe(rank)}) answered no ping for "
                f"{silent_s:.0f} s (limit {self._hung_timeout_s:g} s, "
                f"{WORKER_HUNG_TIMEOUT_S.name}): it is hung (stopped?)"
            )
        if self._suspect_rank is None:
            self._suspect_rank = rank
            logger.warning(
                "worker rank %d (%s) answered no ping for %.0f s (limit %g s, %s): suspect; "
                "it fails its engine core after %g s of silence (%s)",
                rank,
                self._describe(rank),
                silent_s,
                self._heartbeat_timeout_s,
                WORKER_HEARTBEAT_TIMEOUT_S.name,
                self._hung_timeout_s,
                WORKER_HUNG_TIMEOUT_S.name,
            )

    # ------------------------------------------------------------------ liveness

    def _describe(self, rank: int) -> str:
        placement = self.placements[rank] if rank < len(self.placements) else None
        if placement is None:
            return "a Ray actor not yet placed"
        return f"Ray actor pid {placement.pid} on node {placement.node_ip} {placement.node_id[:8]}"

    def _raise_if_dead(self) -> None:
        if self._dead_reason is not None:
            raise RuntimeError(self._dead_reason)

    def _die(self, reason: str) -> NoReturn:
        self._dead_reason = reason
        logger.error("ray executor: %s", reason)
        raise RuntimeError(reason)


def connect_to_cluster() -> bool:
    """Join the Ray cluster at RAY_ADDRESS, else the one `ray start` recorded on this node;
    True when this call connected (and the executor should disconnect again).

    Raises:
        RuntimeError: no cluster answers there (ray.init itself would retry for minutes).
    """
    if ray.is_initialized():
        return False  # the caller's own ray.init (a notebook, a Ray job): use it as it is
    address = RAY_ADDRESS.get() or "auto"
    resolved = _resolve_address(address)
    if resolved is None or not _answers(resolved):
        where = f"at {resolved}" if resolved else "on this node"
        source = f"RAY_ADDRESS={address}" if address != "auto" else "no RAY_ADDRESS set"
        raise RuntimeError(
            f"--distributed-executor-backend ray needs a running Ray cluster, but none answers "
            f"{where} ({source}). Start one: `ray start --head --port 6379` on this node, "
            f"`ray start --address HEAD_IP:6379` on each other node, then set "
            f"RAY_ADDRESS=HEAD_IP:6379 (or nothing, on the head); on one node, "
            f"--distributed-executor-backend mp needs no cluster"
        )
    ray.init(address=resolved)
    return True


def _resolve_address(address: str) -> str | None:
    """HOST:PORT that ray.init would dial for address ("auto": the recorded cluster)."""
    if address.startswith("ray://"):
        return address  # Ray Client: nothing to resolve
    try:
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:  # a Ray without this helper: let ray.init find it
        return address
    try:
        return canonicalize_bootstrap_address(address)
    except (ConnectionError, ValueError):
        return None


def _answers(address: str, timeout_s: float = 5.0) -> bool:
    """Whether something accepts TCP connections at HOST:PORT (a Ray Client URL: assumed)."""
    if address.startswith("ray://") or ":" not in address:
        return True
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _bundle(group: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)


def _host_for_url(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _resource_summary(resources: dict[str, float]) -> str:
    return ", ".join(f"{resources.get(k, 0):g} {k}" for k in ("CPU", "GPU"))


def _death_cause(exc: Exception) -> str:
    """Ray's reason for an actor's death, without its advice paragraph."""
    text = _ANSI_ESCAPE.sub("", str(exc))
    for line in text.splitlines():
        if line.startswith("The actor is dead because"):
            return line.split(" Some common causes")[0]
    return text.splitlines()[0] if text else type(exc).__name__


def _release(resources: dict[str, Any], owns_connection: bool) -> None:
    """Kill every actor, remove the placement group, disconnect if we connected.

    A module function, not a method: weakref.finalize must not hold the executor itself.
    The actors are killed, not asked to leave their process groups: after a peer died,
    a rank may sit in a collective that never returns, and a killed process frees all.
    """
    if not ray.is_initialized():
        return  # interpreter exit after ray's own shutdown: the cluster reaps the actors
    for actor in resources["actors"]:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone is as good as killed
            pass
    if resources["placement_group"] is not None:
        try:
            remove_placement_group(resources["placement_group"])
        except Exception:  # noqa: BLE001 - the cluster frees it with the job anyway
            pass
    if owns_connection:
        ray.shutdown()
