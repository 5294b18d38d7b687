"""The `kvserve` command line: serve, api, engine, coordinator, worker, kv-store, kv-events,
generate, bench, keys.

Each process kind's flags are generated from its options struct (shared/config.py); the
command then runs with that typed struct, never with the argparse namespace.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Collection
from typing import Any

from kvserve.shared.cli_args import add_refused_flags, add_struct_args, struct_from_args
from kvserve.shared.launch_options import (
    APIOptions,
    CoordinatorOptions,
    EngineOptions,
    GenerateOptions,
    KvEventsOptions,
    KvStoreOptions,
    ServeOptions,
    TrainDraftOptions,
    WorkerOptions,
)
from kvserve.shared.process_exit import exit_process
from kvserve.shared.refused_flags import UNSUPPORTED_VLLM_FLAGS


def _run_generate(options: GenerateOptions) -> int:
    from kvserve import LLM, SamplingParams

    llm = LLM.from_config(options.engine)
    params = SamplingParams(max_tokens=options.max_tokens, temperature=options.temperature)
    if options.chat:
        outputs = llm.chat([{"role": "user", "content": options.prompt}], params)
    else:
        outputs = llm.generate(options.prompt, params)
    print(outputs[0].outputs[0].text)
    return 0


def _run_train_draft(options: TrainDraftOptions) -> int:
    if options.method == "eagle":
        from kvserve.training.train_eagle import run_train_eagle

        return run_train_eagle(options)
    if options.method == "eagle3":
        from kvserve.training.train_eagle3 import run_train_eagle3

        return run_train_eagle3(options)
    from kvserve.training.train_draft import run_train_draft

    return run_train_draft(options)


def _run_serve(options: ServeOptions) -> int:
    from kvserve.launch.serve import run_serve

    return run_serve(options)


def _run_api(options: APIOptions) -> int:
    from kvserve.launch.api_server import run_api

    return run_api(options)


def _run_engine(options: EngineOptions) -> int:
    from kvserve.launch.serve import run_engine

    return run_engine(options)


def _run_coordinator(options: CoordinatorOptions) -> int:
    from kvserve.launch.serve import run_coordinator_cmd

    return run_coordinator_cmd(options)


def _run_kv_store(options: KvStoreOptions) -> int:
    from kvserve.services.kv_store.server import run_kv_store

    return run_kv_store(options)


def _run_kv_events(options: KvEventsOptions) -> int:
    from kvserve.kv_events import run_kv_events

    return run_kv_events(options)


def _run_worker(options: WorkerOptions) -> int:
    from kvserve.services.worker.worker_proc import worker_main

    return worker_main(options)


# name -> (options struct, its runner, help, fields also taken as positionals, fields left out)
_Command = tuple[type, Callable[[Any], int], str, Collection[str], Collection[str]]
COMMANDS: dict[str, _Command] = {
    "serve": (
        ServeOptions,
        _run_serve,
        "serve the OpenAI-compatible API (api + engine core)",
        ("model",),
        (),
    ),
    "api": (
        APIOptions,
        _run_api,
        "the API server alone, for engines started elsewhere",
        ("model",),
        ("dtype", "max_model_len", "seed"),
    ),
    "engine": (
        EngineOptions,
        _run_engine,
        "one engine core, serving an api elsewhere",
        ("model",),
        (),
    ),
    "coordinator": (
        CoordinatorOptions,
        _run_coordinator,
        "the DP coordinator alone: engine loads in, load table out",
        (),
        (),
    ),
    "worker": (
        WorkerOptions,
        _run_worker,
        "one worker rank (started by an engine core's mp executor)",
        (),
        (),
    ),
    "kv-store": (
        KvStoreOptions,
        _run_kv_store,
        "the KV-cache store: blocks by hash for P/D transfer and CPU offload",
        (),
        (),
    ),
    "kv-events": (
        KvEventsOptions,
        _run_kv_events,
        "print an engine's KV cache events (--kv-events-config), one JSON line each",
        (),
        (),
    ),
    "generate": (GenerateOptions, _run_generate, "generate a completion offline", ("model",), ()),
    "train-draft": (
        TrainDraftOptions,
        _run_train_draft,
        "train draft heads (Medusa, EAGLE-1, EAGLE-3) on the model's own generations",
        ("model",),
        (),
    ),
}


# Commands that take vLLM's engine flags (and so --config and the refused ones).
_TAKES_VLLM_FLAGS = ("serve", "api", "engine", "generate")


def config_file_argv(path: str) -> list[str]:
    """The flags of a vLLM-style YAML config file: `max-num-seqs: 8` (or max_num_seqs) becomes
    --max-num-seqs 8; true/false become --flag / --no-flag; lists and mappings go as JSON."""
    import json

    import yaml

    try:
        with open(path) as f:
            mapping = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: {exc}") from None
    if not isinstance(mapping, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    argv: list[str] = []
    for key, value in mapping.items():
        key = str(key)
        flag = key if key.startswith("-") else "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + flag.lstrip("-"))
        elif isinstance(value, list | dict):
            argv += [flag, json.dumps(value)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def _run_keys_generate(args: argparse.Namespace) -> int:
    from kvserve.shared.transport_security import generate_keys

    try:
        public_file, secret_file = generate_keys(args.dir, keep_existing=args.keep_existing)
    except (FileExistsError, OSError) as exc:
        print(f"kvserve keys generate: error: {exc}", file=sys.stderr)
        return 1
    print(f"public key: {public_file}\nsecret key: {secret_file}")
    print(
        f"copy {args.dir} to every node of the deployment and pass --transport-keys "
        f"{args.dir} (or set KVSERVE_TRANSPORT_KEYS) to each kvserve command"
    )
    return 0


def _add_keys_parser(sub: Any) -> None:
    keys = sub.add_parser("keys", help="keys of the tcp:// transport between processes (CURVE)")
    actions = keys.add_subparsers(dest="keys_command", required=True)
    generate = actions.add_parser(
        "generate",
        help="write a new deployment keypair into DIR (0700; files 0600)",
        description="Write one CURVE keypair for the whole deployment, in ZeroMQ's "
        "certificate format: DIR/kvserve.key (public) and DIR/kvserve.key_secret. Every node "
        "gets a copy of DIR and runs with --transport-keys DIR.",
    )
    generate.add_argument("dir", metavar="DIR", help="the keys folder (made if missing)")
    generate.add_argument(
        "--keep-existing",
        action="store_true",
        help="if DIR holds a keypair already, keep it and succeed (default: refuse)",
    )
    generate.set_defaults(func=_run_keys_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (options_type, _, help_text, positional, skip) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=options_type.__doc__)
        add_struct_args(command, options_type, positional=positional, skip=skip)
        if name in _TAKES_VLLM_FLAGS:
            command.add_argument(
                "--config",
                metavar="FILE.yaml",
                help="flags as a YAML mapping (vLLM's format: flag names as keys); flags on "
                "the command line win",
            )
            add_refused_flags(command, UNSUPPORTED_VLLM_FLAGS)
    from kvserve.benchmarks.cli import add_bench_parser

    add_bench_parser(sub)
    from kvserve.benchmarks.tune import add_tune_parser

    add_tune_parser(sub)
    _add_keys_parser(sub)
    return parser


def parse_options(argv: list[str] | None = None) -> tuple[str, Any]:
    """(command, its typed options) for a process command; (command, the namespace) for
    `bench`. A bad value is a usage error (exit 2) naming it."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        # The file's flags go first, so the command line's own win (argparse keeps the last).
        try:
            from_file = config_file_argv(args.config)
        except ValueError as exc:
            parser.error(str(exc))
        args = parser.parse_args([argv[0], *from_file, *argv[1:]])
        if "model__positional" in vars(args) and "--model" in from_file:
            del args.model  # MODEL on the command line beats the file's `model`
    if args.command not in COMMANDS:
        return args.command, args
    given = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    try:
        return args.command, struct_from_args(
            COMMANDS[args.command][0], argparse.Namespace(**given)
        )
    except ValueError as exc:
        parser.error(f"{args.command}: {exc}")


def configure_command_transport(command: str, options: Any) -> None:
    """Export the command's --transport-keys / --insecure-transport to the environment, where
    every socket of this process and of the processes it spawns reads them, and refuse a
    tcp:// address without keys now, before anything starts: a usage error (exit 2)."""
    transport = getattr(options, "transport", None)
    if transport is None:
        return  # a command without tcp:// sockets of its own (worker, generate)
    from kvserve.shared.transport_security import TransportSecurityError, configure_transport

    try:
        configure_transport(
            transport.transport_keys, transport.insecure_transport, options.socket_addresses
        )
    except TransportSecurityError as exc:
        build_parser().error(f"{command}: {exc}")


def main(argv: list[str] | None = None) -> int:
    command, options = parse_options(argv)
    if command in COMMANDS:
        configure_command_transport(command, options)
        return COMMANDS[command][1](options)
    return options.func(options)


def run() -> None:
    """The `kvserve` script: main(), then the process ends without the interpreter's
    teardown (shared/process_exit.py); an exception still ends it the usual way."""
    exit_process(main())


if __name__ == "__main__":
    run()
