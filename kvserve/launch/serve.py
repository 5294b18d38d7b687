"""`kvserve serve` (the front end), `kvserve engine`, `kvserve coordinator`.

`run_serve` reads as the launch it is: the KV store (P/D), the DP coordinator (more than one
engine core), the registration server (multi-node), the engine cores, then HTTP. Each child
is an async context manager that starts, supervises and stops it (kvserve/launch/children.py,
engines.py), so the children stop in the reverse order: the engines first (after the api
drained), the KV store last (the engines may still be saving blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import AbstractAsyncContextManager

import msgspec

from kvserve.launch.api_server import (
    APIServer,
    AppFactory,
    EngineTopology,
    install_stop_handlers,
    run_api_server,
)
from kvserve.launch.children import (
    KvStoreProcess,
    coordinator_child,
    kv_store_child,
    pd_engine_config,
    registration_server,
)
from kvserve.launch.engines import EngineCores, EngineLaunch, resolve_model_dir
from kvserve.launch.headless import run_headless
from kvserve.launch.supervisor import ChildStartError
from kvserve.services.api.engine_client.mp_client import EngineChannel
from kvserve.services.api.tenancy.tenants import parse_key_file
from kvserve.services.coordinator.coordinator import run_coordinator
from kvserve.shared.env import FRONTEND_TIMEOUT_S
from kvserve.shared.launch_options import CoordinatorOptions, EngineOptions, ServeOptions
from kvserve.shared.logging import init_logger
from kvserve.shared.transport import CoordinatorAddresses, EngineAddresses
from kvserve.shared.wire import EngineAssignment

logger = init_logger(__name__)


def run_serve(options: ServeOptions, build_app: AppFactory | None = None) -> int:
    """`kvserve serve [MODEL]`: resolve the model once, then serve HTTP over this node's
    engine cores and children, or (--headless) run engine cores only.

    Args:
        build_app: the app factory (default: kvserve.services.api.server.build_app).
    """
    options = expect_key_file_targets(options)
    config, dp = options.engine, options.data_parallel
    layout = dp.layout(config.parallel.data_parallel_size)
    model_dir = resolve_model_dir(config.model.model)
    if dp.headless:
        return run_headless(config, model_dir, layout, dp.restart_dead_engines)
    api = APIServer(
        model=config.model,
        http=options.http,
        frontend=options.frontend,
        tokenizer_dir=config.model.tokenizer or model_dir,
        model_dir=model_dir,
        lora=config.lora,
        build_app=build_app,
    )
    return asyncio.run(_serve(options, api, model_dir))


def expect_key_file_targets(options: ServeOptions) -> ServeOptions:
    """`options` with SchedulerConfig.slo_step_timing on where the key file gives a tenant a
    latency target (slo_ttft_ms= or slo_tpot_ms=): the engines then time prompt steps at
    start-up, so the targets size the first steps from this machine's figures. A key file
    that does not parse is left to the api, which names the error."""
    path = options.http.api_key_file
    if not path or options.engine.scheduler.slo_step_timing:
        return options
    try:
        lines = parse_key_file(path)
    except (OSError, ValueError):
        return options
    if not any("slo_ttft_ms" in line.options or "slo_tpot_ms" in line.options for line in lines):
        return options
    scheduler = msgspec.structs.replace(options.engine.scheduler, slo_step_timing=True)
    engine = msgspec.structs.replace(options.engine, scheduler=scheduler)
    return msgspec.structs.replace(options, engine=engine)


async def _serve(options: ServeOptions, api: APIServer, model_dir: str) -> int:
    """The children in start order, then HTTP; they stop in the reverse order."""
    plan = FrontEnd(options)
    stop = install_stop_handlers()  # before the engines start: never orphan them
    channel = EngineChannel(plan.engine_addresses())
    try:
        async with contextlib.AsyncExitStack() as children:
            store = await _enter(children, plan.kv_store())
            store_address = store.address if store else None
            coordinator = await _enter(children, plan.coordinator())
            stats_addr = coordinator.stats_addr if coordinator else None
            await _enter(children, plan.registration(channel.addresses, stats_addr))
            launch = EngineLaunch(
                model_dir=model_dir,
                addresses=channel.addresses,
                stats_addr=stats_addr,
                num_local_engines=plan.num_local_engines,
            )
            engines = await children.enter_async_context(plan.engine_cores(launch, store_address))
            topology = plan.engine_topology(coordinator, store_address)
            return await run_api_server(api, topology, channel, stop, engines)
    except ChildStartError as exc:
        logger.error("exiting with code 1: %s", exc)
        return 1


async def _enter(stack: contextlib.AsyncExitStack, child: AbstractAsyncContextManager | None):
    """The child's value, entered into `stack` (None: this launch has no such child)."""
    return None if child is None else await stack.enter_async_context(child)


class FrontEnd:
    """Which children a front end (`kvserve serve` without --headless) runs, and how.

    Args:
        options: the command's options.
    """

    def __init__(self, options: ServeOptions):
        self.options = options
        dp, pd = options.data_parallel, options.pd
        self.layout = dp.layout(options.engine.parallel.data_parallel_size)
        self.num_engines = pd.num_engines if pd.enabled else self.layout.size
        self.num_local_engines = pd.num_engines if pd.enabled else self.layout.size_local
        # Other nodes reach this one over tcp:// on --data-parallel-address; else ipc://.
        self.host = self.layout.address if self.layout.multi_node else None

    def engine_addresses(self) -> EngineAddresses:
        """Where the api binds for its engine cores."""
        return EngineAddresses.tcp(self.host) if self.host else EngineAddresses.local()

    def kv_store(self) -> AbstractAsyncContextManager[KvStoreProcess] | None:
        """The P/D KV store (--prefill-size/--decode-size), else None."""
        pd = self.options.pd
        return kv_store_child(pd) if pd.enabled else None

    def coordinator(self) -> AbstractAsyncContextManager[CoordinatorAddresses] | None:
        """The DP coordinator (more than one engine core), else None."""
        return coordinator_child(self.host) if self.num_engines > 1 else None

    def registration(
        self, addresses: EngineAddresses, stats_addr: str | None
    ) -> AbstractAsyncContextManager[None] | None:
        """The registration server for headless nodes (multi-node), else None."""
        if not self.layout.multi_node:
            return None
        assignment = EngineAssignment(
            input_addr=addresses.input_addr,
            output_addr=addresses.output_addr,
            stats_addr=stats_addr,
        )
        return registration_server(self.layout, assignment)

    def engine_cores(self, launch: EngineLaunch, store_address: str | None) -> EngineCores:
        """This node's engine cores: with P/D, each in its KV role, connected to the store."""
        config, pd = self.options.engine, self.options.pd
        indices = range(self.num_local_engines)
        if store_address is None:
            configs = dict.fromkeys(indices, config)
        else:
            configs = {
                index: pd_engine_config(config, pd, index, store_address) for index in indices
            }
        return EngineCores(configs, launch, self.options.data_parallel.restart_dead_engines)

    def engine_topology(
        self, coordinator: CoordinatorAddresses | None, store_address: str | None
    ) -> EngineTopology:
        """What the api waits for and routes over."""
        dp = self.options.data_parallel
        return EngineTopology(
            num_engines=self.num_engines,
            routing=dp.dp_routing,
            prefix_slack=dp.dp_prefix_slack,
            load_table_addr=coordinator.publish_addr if coordinator else None,
            kv_store_address=store_address,
            # Engines restart here, or on a headless node that may rejoin.
            wait_for_restarts=self.layout.multi_node or dp.restart_dead_engines,
        )


def run_engine(options: EngineOptions) -> int:
    """`kvserve engine [MODEL]`: one engine core, connecting to an api elsewhere."""
    from kvserve.services.scheduler.engine.engine_proc import run_engine_core
    from kvserve.services.worker.model_loader import resolve_model

    config = options.engine
    return run_engine_core(
        config,
        resolve_model(config.model.model),
        EngineAddresses(options.sockets.input_addr, options.sockets.output_addr),
        options.engine_index,
        stats_addr=options.stats_addr,
        frontend_timeout_s=FRONTEND_TIMEOUT_S.get(),
    )


def run_coordinator_cmd(options: CoordinatorOptions) -> int:
    """`kvserve coordinator`: the DP coordinator alone (compose runs it as a service)."""
    return run_coordinator(CoordinatorAddresses(options.stats_addr, options.publish_addr))
