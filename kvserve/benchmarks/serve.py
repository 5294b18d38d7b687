"""`kvserve bench serve`: online serving benchmark against any OpenAI-compatible server.

Mirrors `vllm bench serve`: a dataset of prompts, sent as streaming requests that arrive as a
Poisson (or gamma) process at --request-rate, at most --max-concurrency at a time; prints the
same result block and can save the same JSON. When the server exposes kvserve's (or vLLM's)
Prometheus metrics, the run's preemptions, prefix-cache hit rate and peak KV use are added.
With --tenants, several traffic sources run at once, one per tenant, and each tenant's
figures follow the totals (tenants.py); with --dataset-name mixed, the requests belong to
classes (short chats, long documents) with their own targets, reported apart (classes.py).
The run itself lives in serve_runner.py, so that building the CLI imports no aiohttp.
"""

from __future__ import annotations

import argparse
import json
import os

from kvserve.benchmarks.agent_args import add_agent_args

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    """The dataset flags, shared with `kvserve tune`."""
    data = p.add_argument_group("dataset")
    data.add_argument(
        "--dataset-name",
        default="random",
        choices=("random", "prefix", "sharegpt", "mixed", "agent"),
        help="mixed: request classes (--mix); agent: cached agent conversations beside a churn "
        "of random prompts (agent.py)",
    )
    data.add_argument(
        "--mix",
        default=None,
        metavar="SPEC",
        help="--dataset-name mixed: request classes NAME:INPUT:OUTPUT:SHARE[:ttft=MS]"
        "[:tpot=MS], comma-separated, e.g. short:128:64:0.9:ttft=600:tpot=90,long:4096:64:0.1; "
        "a class's targets go with its requests as x-slo-ttft-ms / x-slo-tpot-ms headers, and "
        "the report splits each class (kvserve/benchmarks/classes.py)",
    )
    data.add_argument("--dataset-path", default=None, help="ShareGPT JSON or JSONL file")
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0)
    data.add_argument("--prefix-num-groups", type=int, default=4)
    data.add_argument("--prefix-len", type=int, default=256)
    data.add_argument("--prefix-suffix-len", type=int, default=32)
    data.add_argument("--prefix-output-len", type=int, default=128)
    data.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="max_tokens of every request (default: the gpt answer's length)",
    )


def add_parser(kinds) -> None:
    p = kinds.add_parser("serve", help="online serving benchmark (any OpenAI-compatible server)")
    _add_server_args(p)
    add_dataset_args(p)
    add_agent_args(p)
    _add_load_args(p)
    _add_tenant_args(p)
    _add_report_args(p)
    p.set_defaults(func=run)


def _add_server_args(p: argparse.ArgumentParser) -> None:
    """Which server, endpoint, model and key."""
    server = p.add_argument_group("server")
    server.add_argument(
        "--base-url", default=None, help="e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)"
    )
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    server.add_argument(
        "--model", default=None, help="the `model` field (default: the first id of GET /v1/models)"
    )
    server.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer folder (default: kvserve's default model)",
    )
    server.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $OPENAI_API_KEY)",
    )


def _add_load_args(p: argparse.ArgumentParser) -> None:
    """How the requests arrive and what they ask for."""
    load = p.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second (inf: all at once)",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps (1: Poisson; <1 burstier)",
    )
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos: true, so every request generates max_tokens",
    )
    load.add_argument(
        "--no-target-headers",
        action="store_true",
        help="do not send the --mix classes' and --tenants' targets as x-slo-* headers; "
        "goodput still judges them (a baseline run of a server without targets)",
    )
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument(
        "--extra-body",
        type=json.loads,
        default=None,
        help="JSON object merged into every request body",
    )
    load.add_argument("--disable-tqdm", action="store_true")


def _add_tenant_args(p: argparse.ArgumentParser) -> None:
    """--tenants: several traffic sources at once, one per tenant (tenants.py)."""
    mix = p.add_argument_group("tenants")
    mix.add_argument(
        "--tenants",
        default=None,
        metavar="SPEC",
        help="a mix of traffic sources, one per tenant, all at once, random prompts: "
        "'heavy:rate=inf,conc=32,input=1024,output=64,num=200;light:rate=1,input=128,"
        "output=32,num=20'; fields rate, conc, input, output, num, key (bearer token), "
        "weight (not used by the client); a field not given takes its flag's value "
        "(--request-rate, --max-concurrency, --random-input-len, --random-output-len, "
        "--num-prompts, --api-key)",
    )
    mix.add_argument(
        "--tenants-only",
        default=None,
        metavar="NAMES",
        help="run only these tenants of --tenants (a comma list), with the prompts and "
        "arrivals they have in the mix",
    )
    mix.add_argument(
        "--tenant-header",
        default="X-Tenant",
        metavar="HEADER",
        help="the header that names each request's tenant under --tenants (empty: none)",
    )


def _add_report_args(p: argparse.ArgumentParser) -> None:
    """Which figures are printed, and where the JSON result goes."""
    report = p.add_argument_group("report")
    report.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    report.add_argument("--metric-percentiles", default="99")
    report.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000",
    )
    report.add_argument("--save-result", action="store_true")
    report.add_argument("--result-dir", default=".")
    report.add_argument("--result-filename", default=None)
    report.add_argument("--label", default=None, help="name of this run in the JSON and plots")
    report.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE")


def _run_agent(args: argparse.Namespace, base_url: str) -> int:
    import asyncio

    from kvserve.benchmarks import datasets
    from kvserve.benchmarks.agent import run_agent_benchmark

    result = asyncio.run(
        run_agent_benchmark(args, base_url, datasets.load_tokenizer(args.tokenizer))
    )
    if args.save_result:
        path = os.path.join(args.result_dir, args.result_filename or "agent.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"result saved to {path}")
    return 1 if result["agent_turns"] == 0 else 0


def run(args: argparse.Namespace) -> int:
    import asyncio

    from kvserve.benchmarks import datasets
    from kvserve.benchmarks.serve_runner import (
        benchmark,
        build_sources,
        parse_run_options,
        result_path,
    )

    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    if args.dataset_name == "agent":
        return _run_agent(args, base_url)
    try:
        options = parse_run_options(args)
        tokenizer = datasets.load_tokenizer(args.tokenizer)
        sources = build_sources(args, options, tokenizer)
        result = asyncio.run(benchmark(args, options, base_url, sources, tokenizer))
    except ValueError as exc:
        raise SystemExit(f"kvserve bench serve: {exc}") from None
    if args.save_result:
        path = result_path(args, result)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"result saved to {path}")
    # Some failures are a finding about the server; all of them mean no benchmark ran.
    return 1 if result["completed"] == 0 else 0
