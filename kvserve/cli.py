"""The `kvserve` command line: serve, api, engine, coordinator, generate, bench."""

from __future__ import annotations

import argparse
import sys
import types
import typing

from kvserve.shared.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, \
    field_descriptions

# Flags that vLLM spells differently from our field names.
_FLAG_ALIASES = {"distributed_executor_backend": ["--executor"]}
_SIZE_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from '4294967296', '4G', '4GiB' or '512M'."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in _SIZE_SUFFIXES:
        return int(float(t[:-1]) * _SIZE_SUFFIXES[t[-1]])
    return int(t)


def _flag_type(annotation) -> dict:
    """argparse kwargs for a config field's annotation; bool flags get --x/--no-x."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(annotation) is typing.Literal:
        return {"choices": list(typing.get_args(annotation))}
    return {"type": annotation}


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per config field, named as vLLM's, help text from the field's description."""
    for cls in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig):
        group = parser.add_argument_group(cls.__name__)
        docs = field_descriptions(cls)
        hints = typing.get_type_hints(cls, include_extras=False)
        for name in cls.__struct_fields__:
            if name in skip:
                continue
            kwargs = _flag_type(hints[name])
            if name == "kv_cache_memory":
                kwargs = {"type": parse_size}
            flags = ["--" + name.replace("_", "-")] + _FLAG_ALIASES.get(name, [])
            group.add_argument(*flags, dest=name, default=argparse.SUPPRESS,
                               help=docs.get(name, ""), **kwargs)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine arguments the user actually gave (defaults stay the configs' own)."""
    names = set()
    for cls in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig):
        names |= set(cls.__struct_fields__)
    return {k: v for k, v in vars(args).items() if k in names and k != "model"}


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        outputs = llm.generate(args.prompt, params)
    print(outputs[0].outputs[0].text)
    return 0


def _add_http_args(parser: argparse.ArgumentParser) -> None:
    from kvserve.shared.env import API_KEY

    http = parser.add_argument_group("HTTP server")
    http.add_argument("--host", default="0.0.0.0", help="interface to listen on")
    http.add_argument("--port", type=int, default=8000, help="port to listen on")
    http.add_argument("--api-key", default=API_KEY.get(),
                      help=f"require this bearer token on /v1/* (default: ${API_KEY.name})")
    http.add_argument("--shutdown-timeout", type=float, default=30.0,
                      help="seconds SIGTERM/SIGINT waits for in-flight requests")
    http.add_argument("--uvicorn-log-level", default="info",
                      choices=["critical", "error", "warning", "info", "debug", "trace"])


def _add_socket_args(parser: argparse.ArgumentParser, side: str) -> None:
    sockets = parser.add_argument_group("engine sockets")
    example = "tcp://*:5555" if side == "bind" else "tcp://api-host:5555"
    sockets.add_argument("--input-addr", required=True,
                         help=f"address to {side} for requests to the engine, e.g. {example}")
    sockets.add_argument("--output-addr", required=True,
                         help=f"address to {side} for the engine's outputs")


def _add_data_parallel_args(parser: argparse.ArgumentParser) -> None:
    """Launch details of data parallelism (the engine count itself is
    --data-parallel-size, an engine argument)."""
    dp = parser.add_argument_group("data parallelism (DP)")
    dp.add_argument("--data-parallel-size-local", type=int, default=None,
                    help="engine cores on this node (default: --data-parallel-size, one node)")
    dp.add_argument("--data-parallel-start-rank", type=int, default=0,
                    help="index of this node's first engine core (--headless nodes)")
    dp.add_argument("--data-parallel-address", default=None,
                    help="IP or host name of the front-end node, which other nodes reach")
    dp.add_argument("--data-parallel-rpc-port", type=int, default=29550,
                    help="front-end port where headless nodes register their engines")
    dp.add_argument("--headless", action="store_true",
                    help="run engine cores only, registering with the front-end node")
    _add_routing_arg(dp)


def _add_routing_arg(group) -> None:
    group.add_argument("--dp-routing", choices=["load", "prefix"], default="load",
                       help="load: lowest 4 x waiting + running; prefix: prefer the engine "
                            "holding the prompt's prefix blocks, within a load slack")


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.serve import run_serve

    return run_serve(args)


def _cmd_api(args: argparse.Namespace) -> int:
    from kvserve.serve import run_api

    return run_api(args)


def _cmd_engine(args: argparse.Namespace) -> int:
    from kvserve.serve import run_engine

    return run_engine(args)


def _cmd_coordinator(args: argparse.Namespace) -> int:
    from kvserve.serve import run_coordinator_cmd

    return run_coordinator_cmd(args)


def _cmd_worker(args: argparse.Namespace) -> int:
    from kvserve.services.worker.worker_proc import worker_main

    return worker_main(args.worker_argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion offline")
    gen.add_argument("model", nargs="?", default=None)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_engine_args(gen, skip=("model",))
    gen.set_defaults(func=_cmd_generate)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API (api + engine core)")
    serve.add_argument("model", nargs="?", default=None,
                       help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    _add_http_args(serve)
    add_engine_args(serve, skip=("model",))
    _add_data_parallel_args(serve)
    serve.set_defaults(func=_cmd_serve)

    api = sub.add_parser("api", help="the API server alone, for an engine started elsewhere")
    api.add_argument("model", nargs="?", default=None,
                     help="the engine's model (for its tokenizer and name)")
    api.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    api.add_argument("--served-model-name", default=None, help="model name the API reports")
    _add_http_args(api)
    _add_socket_args(api, "bind")
    dp = api.add_argument_group("data parallelism (DP)")
    dp.add_argument("--data-parallel-size", type=int, default=1,
                    help="engine cores that connect to the sockets (serving starts when all "
                         "are ready)")
    dp.add_argument("--load-table-addr", default=None,
                    help="the DP coordinator's --publish-addr, e.g. tcp://coordinator:5558")
    _add_routing_arg(dp)
    api.set_defaults(func=_cmd_api)

    engine = sub.add_parser("engine", help="one engine core, serving an api elsewhere")
    engine.add_argument("model", nargs="?", default=None)
    engine.add_argument("--engine-index", type=int, default=0, help="this engine's index")
    engine.add_argument("--stats-addr", default=None,
                        help="the DP coordinator's --stats-addr, e.g. tcp://coordinator:5557")
    _add_socket_args(engine, "connect to")
    add_engine_args(engine, skip=("model",))
    engine.set_defaults(func=_cmd_engine)

    coordinator = sub.add_parser(
        "coordinator", help="the DP coordinator alone: engine loads in, load table out")
    coordinator.add_argument("--stats-addr", default="tcp://*:5557",
                             help="address to bind for the engines' loads")
    coordinator.add_argument("--publish-addr", default="tcp://*:5558",
                             help="address to bind for publishing the load table to api servers")
    coordinator.set_defaults(func=_cmd_coordinator)

    worker = sub.add_parser("worker", add_help=False,
                            help="one worker rank (started by an engine core's mp executor)")
    worker.set_defaults(func=_cmd_worker)

    from kvserve.benchmarks import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # The worker parses its own flags (its parser lives with the worker process).
    args, rest = build_parser().parse_known_args(argv)
    if args.command == "worker":
        args.worker_argv = rest
    elif rest:
        build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
