"""`kvserve serve --headless`: a node that runs engine cores only, for a front end elsewhere.

It registers its engines (ranks start_rank..start_rank+L-1) with the front end's
registration server, starts them on the sockets it is given, and runs until SIGTERM/SIGINT
(0), until one of them stops because the front end went silent for KVSERVE_FRONTEND_TIMEOUT_S
(0: start the node again to join the next front end), or until one fails (1, after stopping
the others; restarted instead with --restart-dead-engines).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import signal
import threading
import time

from kvserve.launch.engines import EngineCores, EngineLaunch
from kvserve.launch.supervisor import ProcessSupervisor, describe_exit
from kvserve.services.coordinator.handshake import register_engines, rpc_address
from kvserve.shared.config import EngineConfig
from kvserve.shared.env import ENGINE_READY_TIMEOUT_S, FRONTEND_TIMEOUT_S
from kvserve.shared.launch_options import DPLayout
from kvserve.shared.logging import init_logger
from kvserve.shared.transport import EngineAddresses
from kvserve.shared.wire import EngineAssignment, EngineRegistration, this_hostname

logger = init_logger(__name__)


def run_headless(
    config: EngineConfig, model_dir: str, layout: DPLayout, restart_dead_engines: bool = False
) -> int:
    """Register this node's engines with the front end, then run them (see the module).

    Args:
        config: every engine core's config.
        model_dir: the resolved model folder.
        layout: the checked DP layout (this node's ranks, the front end's address).
        restart_dead_engines: restart an engine core that dies instead of stopping.
    """
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    assert layout.address is not None and layout.rpc_port is not None  # layout.validate()
    engine_indices = range(layout.start_rank, layout.start_rank + layout.size_local)
    try:
        assignment = register_engines(
            rpc_address(layout.address, layout.rpc_port),
            EngineRegistration(engine_indices=list(engine_indices), hostname=this_hostname()),
            ENGINE_READY_TIMEOUT_S.get(),
            stop,
        )
    except (TimeoutError, ValueError) as exc:
        logger.error("exiting with code 1: %s", exc)
        return 1
    if assignment is None:
        return 0  # stopped while registering
    launch = EngineLaunch(
        model_dir=model_dir,
        addresses=EngineAddresses(assignment.input_addr, assignment.output_addr),
        stats_addr=assignment.stats_addr,
        num_local_engines=layout.size_local,
        frontend_timeout_s=FRONTEND_TIMEOUT_S.get(),
    )
    configs = dict.fromkeys(engine_indices, config)
    with EngineCores(configs, launch, restart_dead_engines) as engines:
        return _run_until_done(engines, assignment, stop)


def _run_until_done(
    engines: EngineCores, assignment: EngineAssignment, stop: threading.Event
) -> int:
    """Watch the engine cores until `stop`, a stopped one (0) or a failed one (1)."""
    processes = engines.processes
    supervisor = ProcessSupervisor(processes, engines.start, engines.name)
    while not stop.is_set():
        running = [p.sentinel for p in processes.values() if p.exitcode is None]
        if running:
            multiprocessing.connection.wait(running, timeout=0.5)
        else:
            time.sleep(0.5)  # all of them wait for a restart
        exited = [p for p in processes.values() if p.exitcode is not None]
        if any(p.exitcode == 0 for p in exited):
            # The engine stopped itself: the api went silent (FRONTEND_TIMEOUT_S).
            logger.error(
                "engine core process %s stopped: the front end at %s is gone; stopping this node",
                next(p.name for p in exited if p.exitcode == 0),
                assignment.input_addr,
            )
            return 0
        if exited and not engines.restart:
            logger.error(
                "engine core process %s (pid %d) exited with %s; stopping this node",
                exited[0].name,
                exited[0].pid,
                describe_exit(exited[0].exitcode),
            )
            return 1
        if engines.restart:
            supervisor.check()
    return 0
