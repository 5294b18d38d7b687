"""`kvserve serve`, `kvserve api`, `kvserve engine`: the processes of one server and their
supervision.

    kvserve serve (this process: api + uvicorn, no torch)
      └── EngineCore_0 (spawned; run_engine_core; torch)
            └── workers (the `mp` executor, when TP x PP > 1)

The launcher binds the api's sockets, starts the engine core, loads the tokenizer while the
engine loads the model, waits for READY, then serves HTTP. If any of those processes dies,
in-flight requests fail (503), the dead process is named in the log, and the launcher exits 1.
SIGTERM / SIGINT: stop accepting, drain in-flight requests for up to --shutdown-timeout
seconds, stop the engine (which stops its workers), exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import multiprocessing
import signal
from collections.abc import Awaitable, Callable

import psutil

from shared.config import EngineConfig, ModelConfig
from shared.logging import init_logger
from shared.transport import EngineAddresses
from services.api.engine_client import EngineDeadError
from services.api.mp_client import EngineChannel, MPEngineClient
from services.api.tokenizer import TokenizerInfo

logger = init_logger(__name__)

# How long a SIGTERM'd engine may take to stop its workers before it is killed.
ENGINE_STOP_TIMEOUT_S = 10.0

AppFactory = Callable[..., object]  # build_app(engine_client, *, served_model_name, api_key)


# ---------------------------------------------------------------------- processes


def resolve_model_dir(model: str | None) -> str:
    """`resolve_model` in a short-lived child: converting a GGUF imports torch (and worker/),
    which the api process must never hold."""
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return pool.submit(_resolve_model, model).result()


def _resolve_model(model: str | None) -> str:
    from services.worker.model_loader import resolve_model

    return resolve_model(model)


def start_engine_process(config: EngineConfig, model_dir: str, addresses: EngineAddresses,
                         engine_index: int = 0) -> multiprocessing.Process:
    """Spawn an engine core (not a daemon: its `mp` executor has children of its own)."""
    process = multiprocessing.get_context("spawn").Process(
        target=_engine_main, name=f"EngineCore_{engine_index}",
        args=(config, model_dir, addresses.input_addr, addresses.output_addr, engine_index))
    process.start()
    logger.info("started engine core process %s (pid %d)", process.name, process.pid)
    return process


def _engine_main(config: EngineConfig, model_dir: str, input_addr: str, output_addr: str,
                 engine_index: int) -> None:
    from services.scheduler.engine_proc import run_engine_core

    raise SystemExit(run_engine_core(config, model_dir, input_addr, output_addr, engine_index,
                                     watch_parent=True))


def stop_engine_process(process: multiprocessing.Process,
                        leftovers: list[psutil.Process | None] = ()) -> None:
    """SIGTERM the engine (it stops its workers), kill it after ENGINE_STOP_TIMEOUT_S, then
    kill any worker left behind (a killed engine cannot stop its own)."""
    if process.is_alive():
        process.terminate()
        process.join(ENGINE_STOP_TIMEOUT_S)
        if process.is_alive():
            logger.error("engine core process %s (pid %d) ignored SIGTERM for %.0f s; killing",
                         process.name, process.pid, ENGINE_STOP_TIMEOUT_S)
            process.kill()
    process.join()
    for leftover in leftovers:
        try:
            if leftover is not None and leftover.is_running():
                leftover.kill()
        except psutil.NoSuchProcess:
            pass
    logger.info("engine core process %s (pid %d) exited with %s", process.name, process.pid,
                _describe_exit(process.exitcode))


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"signal {signal.Signals(-exitcode).name}"
    return f"code {exitcode}"


# ---------------------------------------------------------------------- the api process


async def serve_http(client: MPEngineClient, args: argparse.Namespace,
                     build_app: AppFactory | None = None,
                     stop: asyncio.Event | None = None) -> int:
    """Serve the HTTP app until SIGTERM/SIGINT (0) or the engine's death (1).

    Args:
        client: a connected engine client (its model_name is the served name).
        args: --host, --port, --api-key, --shutdown-timeout, --uvicorn-log-level.
        build_app: the app factory (default: services.api.server.build_app).
        stop: set by a signal that came before uvicorn took the signals over.
    """
    import uvicorn

    if build_app is None:
        from services.api.server import build_app
    app = build_app(client, served_model_name=client.model_name, api_key=args.api_key)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=args.shutdown_timeout))

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


async def _run_api_server(args: argparse.Namespace, channel: EngineChannel,
                          stop: asyncio.Event, tokenizer_dir: str, model_name: str,
                          build_app: AppFactory | None, engine_process=None) -> int:
    """Load the tokenizer, wait for READY, serve; always close the channel and stop the
    engine process (when it is ours)."""
    client = None
    try:
        # The tokenizer loads while the engine loads the model.
        tokenizer_info = await asyncio.to_thread(TokenizerInfo, tokenizer_dir)
        client = await _until_signal(MPEngineClient.connect(
            channel, tokenizer_info, model_name, engine_process=engine_process), stop)
        if client is None:
            logger.info("stopped before the engine was ready")
            return 0
        return await serve_http(client, args, build_app, stop)
    except EngineDeadError as exc:
        logger.error("exiting with code 1: %s", exc)
        return 1
    finally:
        if client is not None:
            await client.shutdown()
        else:
            channel.close()
        if engine_process is not None:
            leftovers = [process for _, process in client.watched_processes] if client else []
            await asyncio.to_thread(stop_engine_process, engine_process, leftovers)


def run_serve(args: argparse.Namespace, build_app: AppFactory | None = None) -> int:
    """`kvserve serve [MODEL]`: resolve the model once, start the engine, serve HTTP."""
    from kvserve.cli import engine_kwargs
    from kvserve.llm import build_engine_config

    config = build_engine_config(model=args.model, **engine_kwargs(args))
    model_dir = resolve_model_dir(args.model)

    async def main() -> int:
        stop = _install_stop_handlers()  # before the engine starts: it must never be orphaned
        channel = EngineChannel(EngineAddresses.local())
        engine_process = start_engine_process(config, model_dir, channel.addresses)
        return await _run_api_server(
            args, channel, stop, config.model.tokenizer or model_dir,
            config.model.served_name, build_app,
            engine_process)

    return asyncio.run(main())


def run_api(args: argparse.Namespace) -> int:
    """`kvserve api [MODEL]`: the HTTP server alone, for an engine started elsewhere."""
    model_dir = resolve_model_dir(args.model)

    async def main() -> int:
        stop = _install_stop_handlers()
        channel = EngineChannel(EngineAddresses(args.input_addr, args.output_addr))
        return await _run_api_server(
            args, channel, stop, args.tokenizer or model_dir,
            ModelConfig(model=args.model, served_model_name=args.served_model_name).served_name,
            None)

    return asyncio.run(main())


def run_engine(args: argparse.Namespace) -> int:
    """`kvserve engine [MODEL]`: one engine core, connecting to an api elsewhere."""
    from kvserve.cli import engine_kwargs
    from kvserve.llm import build_engine_config
    from services.scheduler.engine_proc import run_engine_core
    from services.worker.model_loader import resolve_model

    config = build_engine_config(model=args.model, **engine_kwargs(args))
    return run_engine_core(config, resolve_model(args.model), args.input_addr,
                           args.output_addr, args.engine_index)
