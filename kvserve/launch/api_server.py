"""The api process: load the tokenizer, wait for READY from every engine core, serve HTTP.

`run_api_server` is the api of `kvserve serve` (engine cores in child processes) and of
`kvserve api` (engine cores started elsewhere): what it serves is an `APIServer`, the engine
cores it waits for and routes over an `EngineTopology`.

Signals: SIGTERM/SIGINT stop it (uvicorn drains while it serves). SIGHUP reads the key file
again (TenantDirectory.reload: keys, weights, quotas; a file that does not parse leaves the
old one in force, with an error line in the log); before the server is up it does nothing.
In `kvserve serve` this process is the launcher itself (engine cores, coordinator and KV
store are its children), so `kill -HUP <the kvserve serve pid>` reaches it and nothing needs
forwarding; send it to that pid alone, not the process group: the children, spawned, keep
SIGHUP's default action (exit).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from kvserve.launch.engines import EngineCores, resolve_model_dir
from kvserve.services.api.engine_client.client import EngineClient, EngineDeadError
from kvserve.services.api.engine_client.mp_client import (
    ClientTopology,
    EngineChannel,
    MPEngineClient,
)
from kvserve.services.api.serving.tokenizer import TokenizerInfo
from kvserve.shared.api_config import FrontendConfig, HTTPConfig
from kvserve.shared.config import LoRAConfig, ModelConfig
from kvserve.shared.launch_options import APIOptions, DPRouting
from kvserve.shared.logging import init_logger
from kvserve.shared.transport import EngineAddresses

if TYPE_CHECKING:
    from kvserve.services.api.tenancy.tenants import TenantDirectory

logger = init_logger(__name__)

AppFactory = Callable[..., Any]  # services/api/server.py's build_app and its keywords

# uvicorn's bounds on slow and idle clients (see serve_http).
_TIMEOUT_KEEP_ALIVE_S = 5
_MAX_HEADER_BYTES = 16 << 10
_LIMIT_CONCURRENCY = 8192
_SIGHUP_IGNORED = "SIGHUP while the server is not serving: nothing to reload"


class APIServer(msgspec.Struct, frozen=True, kw_only=True):
    """What the api serves, and how.

    Args:
        model: the model options (its served name).
        http: the HTTP server's options.
        frontend: the OpenAI front end's options.
        tokenizer_dir: the folder the tokenizer loads from.
        model_dir: the model's folder (its config.json picks the `auto` parsers).
        lora: the engines' LoRA options (adapters are served with enable_lora).
        build_app: the app factory (default: kvserve.services.api.server.build_app).
    """

    model: ModelConfig
    http: HTTPConfig
    frontend: FrontendConfig
    tokenizer_dir: str
    model_dir: str | None = None
    lora: LoRAConfig | None = None
    build_app: AppFactory | None = None


class EngineTopology(msgspec.Struct, frozen=True, kw_only=True):
    """The engine cores the api waits for and routes over.

    Args:
        num_engines: engine cores that connect (serving starts when all are READY).
        routing: how requests pick an engine core (--dp-routing).
        prefix_slack: --dp-prefix-slack, prefix routing's load margin.
        load_table_addr: the DP coordinator's load table, or None.
        kv_store_address: the P/D KV store this launcher runs (shown in /health), or None.
        wait_for_restarts: with no engine core left, answer 503 rather than exit (engines
            restart here, or on a headless node that may rejoin).
    """

    num_engines: int = 1
    routing: DPRouting = "load"
    prefix_slack: int = 8  # services/api/engine_client/dp_router.py PREFIX_LOAD_SLACK
    load_table_addr: str | None = None
    kv_store_address: str | None = None
    wait_for_restarts: bool = False


def install_stop_handlers() -> asyncio.Event:
    """SIGTERM/SIGINT before the server runs (uvicorn takes them over while it serves);
    SIGHUP does nothing until serve_http makes it reload the key file (its default action
    would end the launcher)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, logger.info, _SIGHUP_IGNORED)
    return stop


def reload_key_file(tenants: TenantDirectory, engine_client: EngineClient) -> None:
    """SIGHUP's handler: read the key file again; on an error the old one stays in force.
    The engine requests carry its tightest TTFT target from then on."""
    try:
        tenants.reload()
    except (OSError, ValueError) as exc:
        logger.error("SIGHUP: the key file was not reloaded (the old one stays): %s", exc)
        return
    engine_client.standing_ttft_ms = tenants.tightest_ttft_ms
    logger.info("reloaded the key file: %d keys", len(tenants.keys))


async def run_api_server(
    api: APIServer,
    topology: EngineTopology,
    channel: EngineChannel,
    stop: asyncio.Event,
    engines: EngineCores | None = None,
) -> int:
    """Wait for READY from every engine core, serve until SIGTERM/SIGINT (0) or until no
    engine core is left (1); always close the channel.

    Args:
        api: what to serve.
        topology: the engine cores to wait for and route over.
        channel: the api's bound sockets; closed on the way out.
        stop: set by SIGTERM/SIGINT (install_stop_handlers).
        engines: the engine cores that are this process's children (restarted while it
            serves, with --restart-dead-engines), or None.
    """
    try:
        async with _connected_client(api, topology, channel, stop, engines) as client:
            if client is None:
                logger.info("stopped before the engines were ready")
                return 0
            async with engines.supervised() if engines else contextlib.nullcontext():
                return await serve_http(client, api, stop)
    except EngineDeadError as exc:
        logger.error("exiting with code 1: %s", exc)
        return 1


@contextlib.asynccontextmanager
async def _connected_client(
    api: APIServer,
    topology: EngineTopology,
    channel: EngineChannel,
    stop: asyncio.Event,
    engines: EngineCores | None,
) -> AsyncIterator[MPEngineClient | None]:
    """The engine client once every engine core is READY (None: SIGTERM/SIGINT came first);
    shut down on the way out (the channel closed), its engines' workers handed to `engines`
    to kill once the engines stopped."""
    client = None
    try:
        # The tokenizer loads while the engines load the model.
        tokenizer_info = await asyncio.to_thread(
            TokenizerInfo, api.tokenizer_dir, api.frontend.chat_template, api.model_dir, True
        )
        client = await _until_signal(
            MPEngineClient.connect(
                channel,
                tokenizer_info,
                api.model.served_name,
                topology=ClientTopology(
                    num_engines=topology.num_engines,
                    routing=topology.routing,
                    prefix_slack=topology.prefix_slack,
                    load_table_addr=topology.load_table_addr,
                    kv_store_address=topology.kv_store_address,
                    wait_for_restarts=topology.wait_for_restarts,
                    max_request_migrations=api.frontend.max_request_migrations,
                    migration_wait_s=api.frontend.migration_wait_s,
                ),
                engine_processes=engines.processes if engines else {},
            ),
            stop,
        )
        yield client
    finally:
        if client is not None:
            await client.shutdown()
            if engines is not None:
                engines.leftover_workers += [process for _, process in client.watched_processes]
        else:
            channel.close()


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


async def serve_http(client: MPEngineClient, api: APIServer, stop: asyncio.Event) -> int:
    """Serve the HTTP app until SIGTERM/SIGINT (0) or the engine's death (1).

    Args:
        client: a connected engine client (its model_name is the served name).
        api: what to serve.
        stop: set by a signal that came before uvicorn took the signals over.
    """
    import uvicorn

    app = _build_app(client, api)
    server = uvicorn.Server(_uvicorn_config(app, api.http))

    async def stop_on_engine_death() -> None:
        reason = await client.wait_dead()
        logger.error("%s; shutting the server down", reason)
        server.should_exit = True

    async def stop_on_early_signal() -> None:
        await stop.wait()
        server.should_exit = True

    watchers = [
        asyncio.create_task(stop_on_engine_death()),
        asyncio.create_task(stop_on_early_signal()),
    ]
    loop = asyncio.get_running_loop()
    ctx = getattr(app.state, "ctx", None)  # a custom build_app may have none
    if ctx is not None:
        loop.add_signal_handler(signal.SIGHUP, reload_key_file, ctx.tenants, ctx.engine_client)
    try:
        # uvicorn handles SIGTERM/SIGINT here: stop accepting, drain, return.
        await server.serve()
    finally:
        for watcher in watchers:
            watcher.cancel()
        if ctx is not None:
            loop.add_signal_handler(signal.SIGHUP, logger.info, _SIGHUP_IGNORED)
    if client.dead_reason is not None:
        logger.error("exiting with code 1: %s", client.dead_reason)
        return 1
    return 0


def _build_app(client: MPEngineClient, api: APIServer) -> Any:
    from kvserve.services.api.server import build_app as default_build_app
    from kvserve.services.api.tenancy.tenants import TenantDirectory

    build_app: AppFactory = api.build_app or default_build_app
    tenants = TenantDirectory(api.http, api.frontend.tenants)
    if tenants.keys:
        logger.info("/v1/* needs one of %d API keys: %s", len(tenants.keys), sorted(tenants.keys))
    return build_app(
        client,
        served_model_name=client.model_name,
        http=api.http,
        frontend=api.frontend,
        lora_config=api.lora,
        tenants=tenants,
    )


def _uvicorn_config(app: Any, http: HTTPConfig):
    import uvicorn

    return uvicorn.Config(
        app,
        host=http.host,
        port=http.port,
        log_level=http.uvicorn_log_level,
        # uvicorn hands it to asyncio.wait_for: a float works, whatever its hint says.
        timeout_graceful_shutdown=http.shutdown_timeout,  # type: ignore[arg-type]
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


def run_api(options: APIOptions) -> int:
    """`kvserve api [MODEL]`: the HTTP server alone, for engines started elsewhere."""
    model_dir = resolve_model_dir(options.model.model)
    api = APIServer(
        model=options.model,
        http=options.http,
        frontend=options.frontend,
        tokenizer_dir=options.model.tokenizer or model_dir,
        model_dir=model_dir,
        lora=options.lora,
    )
    topology = EngineTopology(
        num_engines=options.data_parallel_size,
        routing=options.dp_routing,
        prefix_slack=options.dp_prefix_slack,
        load_table_addr=options.load_table_addr,
    )
    sockets = EngineAddresses(options.sockets.input_addr, options.sockets.output_addr)

    async def main() -> int:
        stop = install_stop_handlers()
        return await run_api_server(api, topology, EngineChannel(sockets), stop)

    return asyncio.run(main())
