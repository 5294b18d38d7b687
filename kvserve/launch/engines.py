"""The engine core processes a launcher starts: one per local DP rank, spawned.

`EngineCores` owns this node's engine cores: it starts them on entry, restarts a dead one
while `supervised()` (--restart-dead-engines), and stops them on exit, each stopping its own
workers (the `mp` executor), then kills any worker a killed engine left behind.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import multiprocessing
from collections.abc import Collection, Mapping
from multiprocessing.process import BaseProcess

import msgspec
import psutil

from kvserve.launch.allocator import log_allocator
from kvserve.launch.supervisor import STOP_TIMEOUT_S, describe_exit, supervised
from kvserve.shared.config import EngineConfig
from kvserve.shared.logging import init_logger
from kvserve.shared.process_exit import exit_process
from kvserve.shared.shm_ring import unlink_rings_of
from kvserve.shared.transport import EngineAddresses

logger = init_logger(__name__)


def resolve_model_dir(model: str | None) -> str:
    """`resolve_model` in a short-lived child: converting a GGUF imports torch (and worker/),
    which the api process must never hold."""
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return pool.submit(_resolve_model, model).result()


def _resolve_model(model: str | None) -> str:
    from kvserve.services.worker.model_loader import resolve_model

    return resolve_model(model)


class EngineLaunch(msgspec.Struct, frozen=True, kw_only=True):
    """What every engine core of one launch starts with (each adds its index and config).

    Args:
        model_dir: the resolved model folder.
        addresses: the api's sockets the engine cores connect to.
        stats_addr: the DP coordinator's load address (data parallelism), else None.
        num_local_engines: engine cores on this host (they share its CPU cores).
        frontend_timeout_s: for engines of a headless node: exit after this long without
            a message from the api (None: the api is this process, which they watch).
    """

    model_dir: str
    addresses: EngineAddresses
    stats_addr: str | None = None
    num_local_engines: int = 1
    frontend_timeout_s: float | None = None


def start_engine_process(
    config: EngineConfig, launch: EngineLaunch, engine_index: int = 0
) -> BaseProcess:
    """Spawn engine core `engine_index` (not a daemon: its `mp` executor has children of its
    own). On a CPU host it starts with tcmalloc preloaded where the system has it
    (kvserve/launch/allocator.py)."""
    log_allocator()
    process = multiprocessing.get_context("spawn").Process(
        target=_engine_main, name=f"EngineCore_{engine_index}", args=(config, launch, engine_index)
    )
    process.start()
    logger.info("started engine core process %s (pid %d)", process.name, process.pid)
    return process


def _engine_main(config: EngineConfig, launch: EngineLaunch, engine_index: int) -> None:
    from kvserve.services.scheduler.engine.engine_proc import run_engine_core

    exit_process(
        run_engine_core(
            config,
            launch.model_dir,
            launch.addresses,
            engine_index,
            watch_parent=True,
            stats_addr=launch.stats_addr,
            num_local_engines=launch.num_local_engines,
            frontend_timeout_s=launch.frontend_timeout_s,
        )
    )


def stop_engine_process(
    process: BaseProcess, leftovers: Collection[psutil.Process | None] = ()
) -> None:
    """SIGTERM the engine (it stops its workers), kill it after STOP_TIMEOUT_S, then kill
    any worker left behind (a killed engine cannot stop its own)."""
    if process.is_alive():
        process.terminate()
        process.join(STOP_TIMEOUT_S)
        if process.is_alive():
            logger.error(
                "engine core process %s (pid %d) ignored SIGTERM for %.0f s; killing",
                process.name,
                process.pid,
                STOP_TIMEOUT_S,
            )
            process.kill()
    process.join()
    for leftover in leftovers:
        try:
            if leftover is not None and leftover.is_running():
                leftover.kill()
        except psutil.NoSuchProcess:
            pass
    logger.info(
        "engine core process %s (pid %d) exited with %s",
        process.name,
        process.pid,
        describe_exit(process.exitcode),
    )
    unlink_rings_left_by(process)  # a killed engine closed none


def unlink_rings_left_by(process: BaseProcess) -> None:
    """Unlink the shared-memory rings (to its workers) a dead engine core left behind:
    one that exits cleanly unlinks its own; a killed one cannot, and the resource tracker
    would keep its 8 MiB in /dev/shm until the launcher exits."""
    if process.pid is None or process.is_alive():
        return
    for name in unlink_rings_of(process.pid):
        logger.info("unlinked %s, left by engine core process (pid %d)", name, process.pid)


class EngineCores:
    """This node's engine core processes, by engine index.

    `with` (a headless node) or `async with` (the front end) starts them all and stops them
    all on the way out; `supervised()` restarts a dead one while it lasts, when `restart`.

    Args:
        configs: engine index -> its config (P/D engines differ in their KV role).
        launch: what they all start with.
        restart: restart an engine core that dies (--restart-dead-engines).
    """

    def __init__(self, configs: Mapping[int, EngineConfig], launch: EngineLaunch, restart: bool):
        self.configs = dict(configs)
        self.launch = launch
        self.restart = restart
        # Engine index -> its current process; the supervisor replaces entries, and the api's
        # client watches this very dict, so it sees a restarted engine's new process.
        self.processes: dict[int, BaseProcess] = {}
        # Workers the api saw (its watched processes): killed once their engines stopped.
        self.leftover_workers: list[psutil.Process | None] = []

    def start(self, engine_index: int) -> BaseProcess:
        """Start (or restart) engine core `engine_index`; a restart first unlinks the
        shared-memory rings its dead predecessor left (a killed process cannot)."""
        dead = self.processes.get(engine_index)
        if dead is not None:
            unlink_rings_left_by(dead)
        return start_engine_process(self.configs[engine_index], self.launch, engine_index)

    @staticmethod
    def name(engine_index: int) -> str:
        return f"engine core {engine_index}"

    def supervised(self) -> contextlib.AbstractAsyncContextManager:
        """Restarts a dead engine core for the block's length (with `restart`)."""
        if not self.restart:
            return contextlib.nullcontext()
        return supervised(self.processes, self.start, self.name)

    def __enter__(self) -> EngineCores:
        try:
            for index in self.configs:
                self.processes[index] = self.start(index)
        except BaseException:
            self.__exit__(None, None, None)  # a failed start stops the ones already started
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        for process in self.processes.values():
            stop_engine_process(process, self.leftover_workers)

    async def __aenter__(self) -> EngineCores:
        return self.__enter__()

    async def __aexit__(self, *exc_info) -> None:
        await asyncio.gather(
            *(
                asyncio.to_thread(stop_engine_process, process, self.leftover_workers)
                for process in self.processes.values()
            )
        )
