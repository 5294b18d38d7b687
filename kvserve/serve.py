"""`kvserve serve`, `kvserve api`, `kvserve engine`, `kvserve coordinator`: the processes of
one server and their supervision.

    kvserve serve (this process: api + uvicorn, no torch)
      ├── DPCoordinator (spawned, only with more than one engine core; no torch)
      ├── KvStore (spawned, only with --prefill-size/--decode-size; no torch)
      └── EngineCore_0 .. EngineCore_{L-1} (spawned; run_engine_core; torch)
            └── workers (the `mp` executor, when TP x PP > 1)

The launcher binds the api's sockets, starts the engine cores, loads the tokenizer while the
engines load the model, waits for READY from all N engines (the remote ones too), then serves
HTTP. An engine process that dies fails its in-flight requests (503, or an error chunk naming
it); the others serve on; when none is left the launcher exits 1, naming the dead process.
With --restart-dead-engines the launcher restarts a dead engine core instead (its leftover
workers killed first; 1 s to 30 s of back-off while it keeps dying young), the api readmits
it once it says READY, and answers 503 while no engine core serves. The DP coordinator is
always supervised: one that dies is restarted on the same addresses (engines and the api
reconnect by themselves; routing runs on the api's own estimates meanwhile).
SIGTERM / SIGINT: stop accepting, drain in-flight requests for up to --shutdown-timeout
seconds, stop the engines (which stop their workers) and the coordinator, exit 0.

Multi-node (`--data-parallel-size-local L0 < N`): the front end binds its sockets on
--data-parallel-address (tcp, ports the OS picks) and answers the registration of headless
nodes on --data-parallel-rpc-port for as long as it runs, so a node that restarts (or comes
late) joins again; `kvserve serve --headless` nodes run engines only. A headless engine core
shuts down after KVSERVE_FRONTEND_TIMEOUT_S without a word from the api, and its node then
exits 0 (start it again to join the next front end).

P/D disaggregation (`--prefill-size N --decode-size M`): a KV store on an ipc:// address in a
fresh temporary folder, engines 0..N-1 with kv_role kv_producer and N..N+M-1 with kv_consumer,
each a KvStoreConnector to that store. The api sends each request to a prefill engine first
(max_tokens 1), then to a decode engine (see services/api/mp_client.py). The store stops
after the engines, and takes its shared memory with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import glob
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable

import msgspec
import psutil

from kvserve.services.api.engine_client import EngineDeadError
from kvserve.services.api.mp_client import EngineChannel, MPEngineClient
from kvserve.services.api.tokenizer import TokenizerInfo
from kvserve.services.coordinator.coordinator import run_coordinator, start_coordinator_process
from kvserve.services.coordinator.handshake import RegistrationServer, register_engines, rpc_address
from kvserve.shared.config import (
    APIOptions,
    CoordinatorOptions,
    DPLayout,
    DPRouting,
    EngineConfig,
    EngineOptions,
    FrontendConfig,
    HTTPConfig,
    KvStoreOptions,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    PDConfig,
    ServeOptions,
)
from kvserve.shared.env import ENGINE_READY_TIMEOUT_S, FRONTEND_TIMEOUT_S
from kvserve.shared.logging import init_logger
from kvserve.shared.transport import CoordinatorAddresses, EngineAddresses
from kvserve.shared.wire import EngineAssignment, EngineRegistration, this_hostname

logger = init_logger(__name__)

# How long a SIGTERM'd engine may take to stop its workers before it is killed.
ENGINE_STOP_TIMEOUT_S = 10.0

AppFactory = Callable[..., object]  # services/api/server.py's build_app and its keywords


# ---------------------------------------------------------------------- processes


def resolve_model_dir(model: str | None) -> str:
    """`resolve_model` in a short-lived child: converting a GGUF imports torch (and worker/),
    which the api process must never hold."""
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return pool.submit(_resolve_model, model).result()


def _resolve_model(model: str | None) -> str:
    from kvserve.services.worker.model_loader import resolve_model

    return resolve_model(model)


def start_engine_process(
    config: EngineConfig,
    model_dir: str,
    addresses: EngineAddresses,
    engine_index: int = 0,
    stats_addr: str | None = None,
    num_local_engines: int = 1,
    frontend_timeout_s: float | None = None,
) -> multiprocessing.Process:
    """Spawn an engine core (not a daemon: its `mp` executor has children of its own).

    Args:
        stats_addr: the DP coordinator's load address (data parallelism), else None.
        num_local_engines: engine cores on this host (they share its CPU cores).
        frontend_timeout_s: for engines of a headless node: exit after this long without
            a message from the api (None: the api is this process, which they watch).
    """
    process = multiprocessing.get_context("spawn").Process(
        target=_engine_main,
        name=f"EngineCore_{engine_index}",
        args=(
            config,
            model_dir,
            addresses.input_addr,
            addresses.output_addr,
            engine_index,
            stats_addr,
            num_local_engines,
            frontend_timeout_s,
        ),
    )
    process.start()
    logger.info("started engine core process %s (pid %d)", process.name, process.pid)
    return process


def _engine_main(
    config: EngineConfig,
    model_dir: str,
    input_addr: str,
    output_addr: str,
    engine_index: int,
    stats_addr: str | None,
    num_local_engines: int,
    frontend_timeout_s: float | None,
) -> None:
    from kvserve.services.scheduler.engine.engine_proc import run_engine_core

    raise SystemExit(
        run_engine_core(
            config,
            model_dir,
            input_addr,
            output_addr,
            engine_index,
            watch_parent=True,
            stats_addr=stats_addr,
            num_local_engines=num_local_engines,
            frontend_timeout_s=frontend_timeout_s,
        )
    )


def stop_engine_process(
    process: multiprocessing.Process, leftovers: list[psutil.Process | None] = ()
) -> None:
    """SIGTERM the engine (it stops its workers), kill it after ENGINE_STOP_TIMEOUT_S, then
    kill any worker left behind (a killed engine cannot stop its own)."""
    if process.is_alive():
        process.terminate()
        process.join(ENGINE_STOP_TIMEOUT_S)
        if process.is_alive():
            logger.error(
                "engine core process %s (pid %d) ignored SIGTERM for %.0f s; killing",
                process.name,
                process.pid,
                ENGINE_STOP_TIMEOUT_S,
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
        _describe_exit(process.exitcode),
    )


# A process that dies sooner than this after its start is crash-looping (a bad flag, a
# missing file: it dies while starting): its next restart waits (1 s, doubling up to
# MAX_RESTART_DELAY_S); one that lived longer restarts at once. A model load that fails late
# is rate-limited by its own length.
RESTART_WINDOW_S = 10.0
MAX_RESTART_DELAY_S = 30.0


class ProcessSupervisor:
    """Restarts the processes of a dict (engine cores by index, the coordinator) that exit.

    `check()` runs every half second or so (it never waits on a process): a dead process's
    descendants (an engine's workers, seen while it lived) are killed, and the process
    starts again through `start(key)` once its back-off is over; the dict holds the new one.

    Args:
        processes: key -> process; entries are replaced on restart (callers share it).
        start: starts the process of one key again (may raise: retried after the back-off).
        name: how the log names the process of one key.
    """

    def __init__(
        self,
        processes: dict,
        start: Callable[[object], multiprocessing.Process],
        name: Callable[[object], str],
    ):
        self.processes = processes
        self.start = start
        self.name = name
        self.num_restarts = 0
        now = time.monotonic()
        self._started_at = dict.fromkeys(processes, now)
        self._quick_deaths = dict.fromkeys(processes, 0)
        self._restart_at: dict = {}
        self._descendants: dict[object, list[psutil.Process]] = {}

    def check(self) -> None:
        now = time.monotonic()
        for key, process in list(self.processes.items()):
            if key in self._restart_at:
                if now >= self._restart_at[key]:
                    self._restart(key, now)
            elif process.is_alive():
                self._descendants[key] = _descendants(process.pid)
            else:
                self._schedule_restart(key, process, now)

    def _schedule_restart(self, key, process: multiprocessing.Process, now: float) -> None:
        process.join()
        for leftover in self._descendants.pop(key, []):
            with contextlib.suppress(psutil.NoSuchProcess):
                leftover.kill()
        lived_s = now - self._started_at[key]
        self._quick_deaths[key] = self._quick_deaths[key] + 1 if lived_s < RESTART_WINDOW_S else 0
        quick = self._quick_deaths[key]
        delay_s = 0.0 if quick == 0 else min(MAX_RESTART_DELAY_S, 2.0 ** (quick - 1))
        self._restart_at[key] = now + delay_s
        logger.error(
            "%s (pid %d) exited with %s after %.0f s; restarting it in %.0f s",
            self.name(key),
            process.pid,
            _describe_exit(process.exitcode),
            lived_s,
            delay_s,
        )

    def _restart(self, key, now: float) -> None:
        del self._restart_at[key]
        self._started_at[key] = now
        try:
            self.processes[key] = self.start(key)
        except Exception as exc:  # noqa: BLE001 - a failed start is retried after a back-off
            logger.error("restarting %s failed: %s", self.name(key), exc)
            self._quick_deaths[key] += 1
            self._restart_at[key] = now + min(
                MAX_RESTART_DELAY_S, 2.0 ** (self._quick_deaths[key] - 1)
            )
            return
        self.num_restarts += 1
        logger.info(
            "restarted %s (pid %d; restart %d)",
            self.name(key),
            self.processes[key].pid,
            self.num_restarts,
        )

    async def run(self, interval_s: float = 0.5) -> None:
        """check() forever, off the event loop (a start may block for a while)."""
        while True:
            await asyncio.sleep(interval_s)
            await asyncio.to_thread(self.check)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


class KvStoreProcess:
    """The P/D KV store: a spawned `kvserve kv-store` on an ipc:// socket in a folder of its own.

    Supervised like the coordinator: a store that dies is started again on the same address
    (`respawn`), empty; the engines' clients connect to it afresh and recompute meanwhile.

    Args:
        size: bytes of KV blocks it holds at most (--kv-store-size).
    """

    START_TIMEOUT_S = 60.0

    def __init__(self, size: int):
        self.folder = tempfile.mkdtemp(prefix="kvserve-pd-")
        self.socket_path = os.path.join(self.folder, "kv-store")
        self.address = f"ipc://{self.socket_path}"
        self.size = size
        self.process = self._spawn()

    def _spawn(self) -> multiprocessing.Process:
        process = multiprocessing.get_context("spawn").Process(
            target=_kv_store_main,
            name="KvStore",
            args=(KvStoreOptions(address=self.address, size=self.size), os.getpid()),
        )
        process.start()
        logger.info(
            "started KV store process %s (pid %d) on %s", process.name, process.pid, self.address
        )
        return process

    def respawn(self) -> multiprocessing.Process:
        """A new store on the same address, once the old one died (whose shared-memory
        segments, named after its pid, are unlinked: a killed store cannot)."""
        for path in glob.glob(f"/dev/shm/kvserve-kv-*-{self.process.pid}"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.process = self._spawn()
        return self.process

    def wait_listening(self) -> None:
        """Until its socket exists (it binds before it serves); RuntimeError if it exits."""
        deadline = time.monotonic() + self.START_TIMEOUT_S
        while not os.path.exists(self.socket_path):
            if not self.process.is_alive():
                raise RuntimeError(
                    f"KV store process (pid {self.process.pid}) exited with "
                    f"{_describe_exit(self.process.exitcode)} before it listened"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"KV store not listening on {self.address} in time")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM (it unlinks its shared memory), SIGKILL after ENGINE_STOP_TIMEOUT_S."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(ENGINE_STOP_TIMEOUT_S)
            if self.process.is_alive():
                logger.error("KV store ignored SIGTERM; killing it")
                self.process.kill()
        self.process.join()
        shutil.rmtree(self.folder, ignore_errors=True)
        logger.info("KV store process exited with %s", _describe_exit(self.process.exitcode))


def _kv_store_main(options: KvStoreOptions, parent_pid: int) -> None:
    from kvserve.services.kv_store.server import run_kv_store

    # Ctrl-C reaches the whole process group: the launcher stops the store after the
    # engines, which may still be saving blocks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_stop_when_orphaned, args=(parent_pid,), daemon=True).start()
    raise SystemExit(run_kv_store(options))


def _stop_when_orphaned(parent_pid: int) -> None:
    """SIGTERM this process once the launcher is gone (killed), so the store still unlinks
    its shared memory."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def pd_engine_config(
    config: EngineConfig, pd: PDConfig, engine_index: int, store_address: str
) -> EngineConfig:
    """Engine `engine_index`'s config: a KvStoreConnector to the store, in its P/D role."""
    transfer = KVTransferConfig(
        kv_connector="KvStoreConnector",
        kv_role=pd.kv_role(engine_index),
        kv_connector_extra_config={"store_address": store_address},
    )
    return msgspec.structs.replace(config, kv_transfer_config=transfer)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"signal {signal.Signals(-exitcode).name}"
    return f"code {exitcode}"


# ---------------------------------------------------------------------- the api process


# uvicorn's bounds on slow and idle clients (see serve_http).
_TIMEOUT_KEEP_ALIVE_S = 5
_MAX_HEADER_BYTES = 16 << 10
_LIMIT_CONCURRENCY = 8192


async def serve_http(
    client: MPEngineClient,
    http: HTTPConfig,
    frontend: FrontendConfig,
    build_app: AppFactory | None = None,
    stop: asyncio.Event | None = None,
    lora: LoRAConfig | None = None,
) -> int:
    """Serve the HTTP app until SIGTERM/SIGINT (0) or the engine's death (1).

    Args:
        client: a connected engine client (its model_name is the served name).
        http: the HTTP server's options.
        frontend: the OpenAI front end's options.
        build_app: the app factory (default: kvserve.services.api.server.build_app).
        stop: set by a signal that came before uvicorn took the signals over.
        lora: the engines' LoRA options (adapters are served with enable_lora).
    """
    import uvicorn

    from kvserve.services.api.auth import load_api_keys

    if build_app is None:
        from kvserve.services.api.server import build_app
    api_keys = load_api_keys(http)
    if api_keys:
        logger.info("/v1/* needs one of %d API keys: %s", len(api_keys), sorted(api_keys))
    app = build_app(
        client,
        served_model_name=client.model_name,
        http=http,
        frontend=frontend,
        api_keys=api_keys,
        lora_config=lora,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=http.host,
            port=http.port,
            log_level=http.uvicorn_log_level,
            timeout_graceful_shutdown=http.shutdown_timeout,
            # Slow or idle clients (each holds only its own request: outputs wait in that
            # request's queue, and a full socket buffer pauses only its own send):
            # - an idle keep-alive connection is closed after 5 s (vLLM's value);
            timeout_keep_alive=_TIMEOUT_KEEP_ALIVE_S,
            # - request line and headers: 16 KiB at most (the body is BodySizeLimitMiddleware's);
            h11_max_incomplete_event_size=_MAX_HEADER_BYTES,
            # - connections and requests in progress at once; past it uvicorn answers 503
            #   (requests past the engines' --max-waiting-requests get 429s long before).
            limit_concurrency=_LIMIT_CONCURRENCY,
            root_path=http.root_path or "",
            ssl_keyfile=http.ssl_keyfile,
            ssl_certfile=http.ssl_certfile,
            ssl_ca_certs=http.ssl_ca_certs,
            ssl_cert_reqs=http.ssl_cert_reqs,
            access_log=not http.disable_uvicorn_access_log,
        )
    )

    async def stop_on_engine_death() -> None:
        reason = await client.wait_dead()
        logger.error("%s; shutting the server down", reason)
        server.should_exit = True

    async def stop_on_early_signal() -> None:
        await stop.wait()
        server.should_exit = True

    watchers = [asyncio.create_task(stop_on_engine_death())]
    if stop is not None:
        watchers.append(asyncio.create_task(stop_on_early_signal()))
    try:
        # uvicorn handles SIGTERM/SIGINT here: stop accepting, drain, return.
        await server.serve()
    finally:
        for watcher in watchers:
            watcher.cancel()
    if client.dead_reason is not None:
        logger.error("exiting with code 1: %s", client.dead_reason)
        return 1
    return 0


async def _until_signal(awaitable: Awaitable, stop: asyncio.Event):
    """The awaitable's result, or None when SIGTERM/SIGINT came first (it is cancelled)."""
    task = asyncio.ensure_future(awaitable)
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


def _install_stop_handlers() -> asyncio.Event:
    """SIGTERM/SIGINT before the server runs (uvicorn takes them over while it serves)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _run_api_server(
    model: ModelConfig,
    http: HTTPConfig,
    frontend: FrontendConfig,
    channel: EngineChannel,
    stop: asyncio.Event,
    tokenizer_dir: str,
    build_app: AppFactory | None,
    engine_processes: dict[int, multiprocessing.Process] | None = None,
    num_engines: int = 1,
    load_table_addr: str | None = None,
    routing: DPRouting = "load",
    lora: LoRAConfig | None = None,
    kv_store_address: str | None = None,
    restart_engine: Callable[[int], multiprocessing.Process] | None = None,
    wait_for_restarts: bool = False,
) -> int:
    """Load the tokenizer, wait for READY from every engine, serve; always close the channel
    and stop the engine processes that are ours.

    Args:
        kv_store_address: the P/D KV store this launcher runs (shown in /health), or None.
        restart_engine: starts engine core `index` again (--restart-dead-engines), or None.
        wait_for_restarts: with no engine core left, answer 503 rather than exit (engines
            restart here, or on a headless node that may rejoin).
    """
    engine_processes = engine_processes if engine_processes is not None else {}
    client = None
    supervisor = None
    try:
        # The tokenizer loads while the engines load the model.
        tokenizer_info = await asyncio.to_thread(
            TokenizerInfo, tokenizer_dir, frontend.chat_template
        )
        client = await _until_signal(
            MPEngineClient.connect(
                channel,
                tokenizer_info,
                model.served_name,
                num_engines=num_engines,
                engine_processes=engine_processes,
                routing=routing,
                load_table_addr=load_table_addr,
                kv_store_address=kv_store_address,
                wait_for_restarts=wait_for_restarts or restart_engine is not None,
            ),
            stop,
        )
        if client is None:
            logger.info("stopped before the engines were ready")
            return 0
        if restart_engine is not None:
            supervisor = asyncio.create_task(
                ProcessSupervisor(
                    engine_processes, restart_engine, lambda index: f"engine core {index}"
                ).run(),
                name="engine-supervisor",
            )
        return await serve_http(client, http, frontend, build_app, stop, lora)
    except EngineDeadError as exc:
        logger.error("exiting with code 1: %s", exc)
        return 1
    finally:
        if supervisor is not None:  # before the engines stop: none restarts then
            supervisor.cancel()
            await asyncio.gather(supervisor, return_exceptions=True)
        if client is not None:
            await client.shutdown()
        else:
            channel.close()
        leftovers = [process for _, process in client.watched_processes] if client else []
        await asyncio.gather(
            *(
                asyncio.to_thread(stop_engine_process, process, leftovers)
                for process in engine_processes.values()
            )
        )


def run_serve(options: ServeOptions, build_app: AppFactory | None = None) -> int:
    """`kvserve serve [MODEL]`: resolve the model once, start the coordinator and the local
    engines, serve HTTP (or, with --headless, run engines only)."""
    config, dp = options.engine, options.data_parallel
    layout = dp.layout(config.parallel.data_parallel_size)
    model_dir = resolve_model_dir(config.model.model)
    if dp.headless:
        return run_headless(config, model_dir, layout, dp.restart_dead_engines)

    pd = options.pd
    num_engines = pd.num_engines if pd.enabled else layout.size
    num_local_engines = pd.num_engines if pd.enabled else layout.size_local

    async def main() -> int:
        stop = _install_stop_handlers()  # before the engines start: never orphan them
        host = layout.address if layout.multi_node else None
        channel = EngineChannel(EngineAddresses.tcp(host) if host else EngineAddresses.local())
        registration = kv_store = coordinator_supervisor = store_supervisor = None
        coordinators: dict[str, multiprocessing.Process] = {}
        try:
            engine_configs = dict.fromkeys(range(num_local_engines), config)
            if pd.enabled:
                kv_store = KvStoreProcess(pd.kv_store_size)
                try:
                    await asyncio.to_thread(kv_store.wait_listening)
                except RuntimeError as exc:
                    logger.error("exiting with code 1: %s", exc)
                    return 1
                engine_configs = {
                    index: pd_engine_config(config, pd, index, kv_store.address)
                    for index in engine_configs
                }
                store = kv_store  # for the closures: the one store of this launch
                store_supervisor = asyncio.create_task(
                    ProcessSupervisor(
                        {"kv_store": store.process},
                        lambda _: store.respawn(),
                        lambda _: "KV store",
                    ).run(),
                    name="kv-store-supervisor",
                )
            stats_addr = load_table_addr = None
            if num_engines > 1:
                coordinator, coordinator_addrs = await asyncio.to_thread(
                    start_coordinator_process,
                    CoordinatorAddresses.tcp(host) if host else CoordinatorAddresses.local(),
                )
                stats_addr, load_table_addr = (
                    coordinator_addrs.stats_addr,
                    coordinator_addrs.publish_addr,
                )
                coordinators["coordinator"] = coordinator
                coordinator_supervisor = asyncio.create_task(
                    ProcessSupervisor(
                        coordinators,
                        lambda _: start_coordinator_process(coordinator_addrs)[0],
                        lambda _: "DP coordinator",
                    ).run(),
                    name="coordinator-supervisor",
                )
            if layout.multi_node:
                registration = asyncio.create_task(
                    RegistrationServer(
                        rpc_address(layout.address, layout.rpc_port),
                        set(range(layout.size_local, layout.size)),
                        EngineAssignment(
                            input_addr=channel.addresses.input_addr,
                            output_addr=channel.addresses.output_addr,
                            stats_addr=stats_addr,
                        ),
                    ).serve()
                )

            def start_engine(index: int) -> multiprocessing.Process:
                return start_engine_process(
                    engine_configs[index],
                    model_dir,
                    channel.addresses,
                    index,
                    stats_addr,
                    num_local_engines,
                )

            engine_processes = {index: start_engine(index) for index in engine_configs}
            return await _run_api_server(
                config.model,
                options.http,
                options.frontend,
                channel,
                stop,
                config.model.tokenizer or model_dir,
                build_app,
                engine_processes,
                num_engines,
                load_table_addr,
                dp.dp_routing,
                lora=config.lora,
                kv_store_address=kv_store.address if kv_store else None,
                restart_engine=start_engine if dp.restart_dead_engines else None,
                wait_for_restarts=layout.multi_node,
            )
        finally:
            for task in (registration, coordinator_supervisor, store_supervisor):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            for coordinator in coordinators.values():
                await asyncio.to_thread(_stop_coordinator, coordinator)
            if kv_store is not None:  # after the engines: they may be saving blocks
                await asyncio.to_thread(kv_store.stop)

    return asyncio.run(main())


def _stop_coordinator(process: multiprocessing.Process) -> None:
    process.terminate()
    process.join(ENGINE_STOP_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join()


def run_headless(
    config: EngineConfig, model_dir: str, layout: DPLayout, restart_dead_engines: bool = False
) -> int:
    """`kvserve serve --headless`: register this node's engines with the front end, run them
    until SIGTERM/SIGINT (0), until one of them stops because the front end is gone (0), or
    until one fails (1, after stopping the others; restarted instead with
    `restart_dead_engines`)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    engine_indices = list(range(layout.start_rank, layout.start_rank + layout.size_local))
    try:
        assignment = register_engines(
            rpc_address(layout.address, layout.rpc_port),
            EngineRegistration(engine_indices=engine_indices, hostname=this_hostname()),
            ENGINE_READY_TIMEOUT_S.get(),
            stop,
        )
    except (TimeoutError, ValueError) as exc:
        logger.error("exiting with code 1: %s", exc)
        return 1
    if assignment is None:
        return 0  # stopped while registering
    addresses = EngineAddresses(assignment.input_addr, assignment.output_addr)
    frontend_timeout_s = FRONTEND_TIMEOUT_S.get()

    def start_engine(index: int) -> multiprocessing.Process:
        return start_engine_process(
            config,
            model_dir,
            addresses,
            index,
            assignment.stats_addr,
            layout.size_local,
            frontend_timeout_s,
        )

    processes = {index: start_engine(index) for index in engine_indices}
    supervisor = ProcessSupervisor(processes, start_engine, lambda index: f"engine core {index}")
    exit_code = 0
    try:
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
                    "engine core process %s stopped: the front end at %s is gone; stopping "
                    "this node",
                    next(p.name for p in exited if p.exitcode == 0),
                    assignment.input_addr,
                )
                break
            if exited and not restart_dead_engines:
                logger.error(
                    "engine core process %s (pid %d) exited with %s; stopping this node",
                    exited[0].name,
                    exited[0].pid,
                    _describe_exit(exited[0].exitcode),
                )
                exit_code = 1
                break
            if restart_dead_engines:
                supervisor.check()
    finally:
        for process in processes.values():
            stop_engine_process(process)
    return exit_code


def run_api(options: APIOptions) -> int:
    """`kvserve api [MODEL]`: the HTTP server alone, for engines started elsewhere."""
    model_dir = resolve_model_dir(options.model.model)

    async def main() -> int:
        stop = _install_stop_handlers()
        channel = EngineChannel(
            EngineAddresses(options.sockets.input_addr, options.sockets.output_addr)
        )
        return await _run_api_server(
            options.model,
            options.http,
            options.frontend,
            channel,
            stop,
            options.model.tokenizer or model_dir,
            None,
            num_engines=options.data_parallel_size,
            load_table_addr=options.load_table_addr,
            routing=options.dp_routing,
            lora=options.lora,
        )

    return asyncio.run(main())


def run_engine(options: EngineOptions) -> int:
    """`kvserve engine [MODEL]`: one engine core, connecting to an api elsewhere."""
    from kvserve.services.scheduler.engine.engine_proc import run_engine_core
    from kvserve.services.worker.model_loader import resolve_model

    config = options.engine
    return run_engine_core(
        config,
        resolve_model(config.model.model),
        options.sockets.input_addr,
        options.sockets.output_addr,
        options.engine_index,
        stats_addr=options.stats_addr,
        frontend_timeout_s=FRONTEND_TIMEOUT_S.get(),
    )


def run_coordinator_cmd(options: CoordinatorOptions) -> int:
    """`kvserve coordinator`: the DP coordinator alone (compose runs it as a service)."""
    return run_coordinator(CoordinatorAddresses(options.stats_addr, options.publish_addr))
