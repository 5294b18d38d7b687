"""The run behind `kvserve bench serve`: arrivals, concurrency, metrics, the result dict."""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime

import aiohttp
import numpy as np

from kvserve.benchmarks import datasets
from kvserve.benchmarks.classes import (
    CLASS_PERCENTILES,
    RequestClass,
    format_class_report,
    mixed_requests,
    parse_mix,
    summarize_classes,
)
from kvserve.benchmarks.endpoint_client import RequestRecord, RequestSpec, send_request
from kvserve.benchmarks.metrics import (
    compute_metrics,
    format_report,
    parse_goodput,
    parse_metric_percentiles,
    parse_percentile_metrics,
)
from kvserve.benchmarks.server_metrics import ServerMetricsWatcher, format_server_report
from kvserve.benchmarks.tenants import (
    TenantTraffic,
    format_tenant_report,
    summarize_tenant,
    tenants_of_args,
)
from kvserve.shared.logging import init_logger

logger = init_logger("kvserve.benchmarks")

# A long generation on a loaded CPU server can take minutes; no request should hang forever.
_REQUEST_TIMEOUT_S = 6 * 60 * 60


def sample_requests(args: argparse.Namespace, tokenizer) -> list[datasets.SampleRequest]:
    if args.dataset_name == "random":
        return datasets.random_requests(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
        )
    if args.dataset_name == "prefix":
        return datasets.prefix_requests(
            tokenizer,
            args.num_prompts,
            args.prefix_num_groups,
            args.prefix_len,
            args.prefix_suffix_len,
            args.prefix_output_len,
            args.seed,
        )
    return datasets.sharegpt_requests(
        tokenizer, args.dataset_path, args.num_prompts, args.sharegpt_output_len, args.seed
    )


def arrival_gaps(
    num_requests: int, request_rate: float, burstiness: float, seed: int
) -> list[float]:
    """Seconds to wait after each request before sending the next.

    Gamma-distributed with shape = burstiness and mean 1 / request_rate: burstiness 1 is a
    Poisson process, smaller values bunch arrivals together. All zero at an infinite rate.
    """
    if request_rate == float("inf"):
        return [0.0] * num_requests
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(
            f"--request-rate and --burstiness must be > 0, got {request_rate} and {burstiness}"
        )
    rng = np.random.default_rng(seed)
    return rng.gamma(burstiness, 1.0 / (request_rate * burstiness), num_requests).tolist()


async def _arrivals(items: list, gaps: list[float]) -> AsyncIterator:
    for i, (item, gap) in enumerate(zip(items, gaps)):
        yield item
        # No wait after the last request: it would only stretch the measured duration.
        if gap > 0 and i + 1 < len(items):
            await asyncio.sleep(gap)


async def _resolve_model(
    session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]
) -> str:
    try:
        async with session.get(base_url + "/v1/models", headers=headers) as response:
            if response.status == 200:
                return (await response.json())["data"][0]["id"]
            problem = f"answered HTTP {response.status}"
    except aiohttp.ClientError as exc:
        problem = f"failed ({exc})"
    raise ValueError(
        f"GET {base_url}/v1/models {problem}: is the server up at --base-url "
        "(or --host/--port)? Pass --model to skip this lookup"
    )


@dataclass(frozen=True)
class RunOptions:
    """The flags that need parsing, checked before any prompt is built.

    Args:
        percentiles: --metric-percentiles as numbers.
        metric_names: --percentile-metrics as a list.
        slos: --goodput as {metric: ms}.
        gaps: seconds between consecutive requests (empty under --tenants: each has its own).
        metadata: --metadata as a dict.
        tenants: the --tenants to run (after --tenants-only); empty: one source, the flags'.
        classes: the --mix classes of --dataset-name mixed (empty: another dataset).
    """

    percentiles: list[float]
    metric_names: list[str]
    slos: dict[str, float]
    gaps: list[float]
    metadata: dict[str, str]
    tenants: list[TenantTraffic] = field(default_factory=list)
    classes: list[RequestClass] = field(default_factory=list)


def parse_run_options(args: argparse.Namespace) -> RunOptions:
    """RunOptions from the CLI flags; ValueError with the flag's name when one is wrong."""
    metadata = {}
    for item in args.metadata:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata takes KEY=VALUE items, got {item!r}")
        metadata[key] = value
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    tenants = tenants_of_args(args)
    if args.mix is not None and args.dataset_name != "mixed":
        raise ValueError("--mix gives the classes of --dataset-name mixed, which is not given")
    classes = parse_mix(args.mix) if args.dataset_name == "mixed" else []
    percentiles = parse_metric_percentiles(args.metric_percentiles)
    if classes:  # the per-class table compares the classes with the whole run
        percentiles = sorted({*percentiles, *CLASS_PERCENTILES})
    gaps = (
        []
        if tenants
        else arrival_gaps(args.num_prompts, args.request_rate, args.burstiness, args.seed)
    )
    return RunOptions(
        percentiles,
        parse_percentile_metrics(args.percentile_metrics),
        parse_goodput(args.goodput),
        gaps,
        metadata,
        tenants,
        classes,
    )


@dataclass
class TrafficSource:
    """One stream of requests: its prompts, arrivals, concurrency cap and headers.

    Args:
        tenant: the tenant it sends for (None: the one source of a run without --tenants).
        requests: its dataset.
        gaps: seconds to wait after each request before sending the next.
        max_concurrency: its requests in flight at most (None: no cap).
        headers: Authorization, the tenant header and the tenant's targets.
        request_classes: each request's --mix class (None: not a mixed run).
    """

    tenant: TenantTraffic | None
    requests: list[datasets.SampleRequest]
    gaps: list[float]
    max_concurrency: int | None
    headers: dict[str, str]
    request_classes: list[RequestClass] | None = None

    def request_slos(self) -> list[dict[str, float]]:
        """Each request's own goodput targets: its class's, or its tenant's."""
        if self.request_classes is not None:
            return [request_class.targets() for request_class in self.request_classes]
        own = self.tenant.targets() if self.tenant is not None else {}
        return [own] * len(self.requests)


def _bearer(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def build_sources(args: argparse.Namespace, options: RunOptions, tokenizer) -> list[TrafficSource]:
    """The run's traffic sources: one per tenant under --tenants, else the flags' one."""
    if not options.tenants:
        request_classes = None
        if options.classes:
            requests, request_classes = mixed_requests(
                tokenizer, args.num_prompts, options.classes, args.seed
            )
        else:
            requests = sample_requests(args, tokenizer)
        return [
            TrafficSource(
                None,
                requests,
                options.gaps[: len(requests)],
                args.max_concurrency,
                _bearer(args.api_key),
                request_classes,
            )
        ]
    sources = []
    for tenant in options.tenants:
        # Seeded by the spec position, not the run's order: --tenants-only keeps the prompts.
        seed = args.seed + tenant.index
        headers = _bearer(tenant.api_key or args.api_key)
        if args.tenant_header:
            headers[args.tenant_header] = tenant.name
        if not args.no_target_headers:
            headers |= tenant.target_headers()
        requests = datasets.random_requests(
            tokenizer,
            tenant.num_prompts,
            tenant.input_len,
            tenant.output_len,
            args.random_range_ratio,
            seed,
        )
        gaps = arrival_gaps(tenant.num_prompts, tenant.request_rate, args.burstiness, seed)
        sources.append(TrafficSource(tenant, requests, gaps, tenant.max_concurrency, headers))
    return sources


async def _run_source(
    session: aiohttp.ClientSession,
    source: TrafficSource,
    specs: list[RequestSpec],
    progress,
) -> tuple[list[RequestRecord], float]:
    """Send one source's requests; (their records, perf_counter() when the last one ended)."""
    semaphore = asyncio.Semaphore(source.max_concurrency) if source.max_concurrency else None

    async def limited(spec: RequestSpec) -> RequestRecord:
        if semaphore is None:
            record = await send_request(session, spec, source.headers)
        else:
            async with semaphore:
                record = await send_request(session, spec, source.headers)
        if progress is not None:
            progress.update(1)
        return record

    tasks = [asyncio.create_task(limited(spec)) async for spec in _arrivals(specs, source.gaps)]
    records = await asyncio.gather(*tasks)
    return records, time.perf_counter()


async def benchmark(
    args: argparse.Namespace,
    options: RunOptions,
    base_url: str,
    sources: list[TrafficSource],
    tokenizer,
) -> dict:
    """Send every source's requests at once, then return the result (config, summary, server
    figures, per-tenant figures, detail).

    Args:
        args: the `kvserve bench serve` flags.
        options: the parsed flags.
        base_url: the server's URL, without a trailing slash.
        sources: the traffic sources (build_sources).
        tokenizer: counts output tokens when the server sends no usage.
    """
    percentiles, slos = options.percentiles, options.slos
    # /v1/models and /metrics are asked with the first source's key.
    headers = sources[0].headers
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = args.model or await _resolve_model(session, base_url, headers)
        specs_of_sources = [_request_specs(args, base_url, model, source) for source in sources]
        num_requests = sum(len(specs) for specs in specs_of_sources)
        watcher = ServerMetricsWatcher(session, base_url + "/metrics", headers)
        await watcher.start()
        progress = None
        if not args.disable_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=num_requests)
        for source, specs in zip(sources, specs_of_sources):
            _log_source(args, base_url, source, len(specs))
        bench_start = time.perf_counter()
        runs = await asyncio.gather(
            *(
                _run_source(session, source, specs, progress)
                for source, specs in zip(sources, specs_of_sources)
            )
        )
        duration = time.perf_counter() - bench_start
        if progress is not None:
            progress.close()
        server = await watcher.stop()
    records = [record for source_records, _ in runs for record in source_records]
    request_slos = [targets for source in sources for targets in source.request_slos()]
    summary, detail = compute_metrics(
        records, tokenizer, duration, percentiles, slos, bench_start, request_slos
    )
    tenant_part = {}
    if options.tenants:
        tenant_part = _tenant_results(sources, runs, tokenizer, options, bench_start)
    class_part = _class_results(sources[0], records, tokenizer, duration, options, bench_start)
    _print_reports(args, options, summary, tenant_part, server)
    if class_part:
        print(format_class_report(class_part["classes"], summary))
    for error in sorted({e for e in detail["errors"] if e})[:5]:
        logger.warning("failed requests, e.g.: %s", error)
    return {
        **_run_config(args, options, base_url, model, len(records)),
        **options.metadata,
        **summary,
        **(server or {}),
        **tenant_part,
        **class_part,
        **detail,
    }


def _class_results(
    source: TrafficSource,
    records: list[RequestRecord],
    tokenizer,
    duration_s: float,
    options: RunOptions,
    bench_start: float,
) -> dict:
    """The result's class part of a mixed run (else empty): each class's figures, and each
    request's class."""
    if source.request_classes is None:
        return {}
    classes = summarize_classes(
        options.classes,
        records,
        source.request_classes,
        tokenizer,
        duration_s,
        options.slos,
        bench_start,
    )
    return {
        "mix": {c.name: c.config() for c in options.classes},
        "classes": classes,
        "request_classes": [c.name for c in source.request_classes],
    }


def _request_specs(
    args: argparse.Namespace, base_url: str, model: str, source: TrafficSource
) -> list[RequestSpec]:
    """One source's requests as the client sends them."""
    classes = None if args.no_target_headers else source.request_classes
    return [
        RequestSpec(
            base_url + args.endpoint,
            args.endpoint.endswith("chat/completions"),
            model,
            r.prompt,
            r.prompt_len,
            r.expected_output_len,
            args.ignore_eos,
            args.temperature,
            args.extra_body or {},
            headers=classes[i].headers() if classes else {},
        )
        for i, r in enumerate(source.requests)
    ]


def _log_source(
    args: argparse.Namespace, base_url: str, source: TrafficSource, num_requests: int
) -> None:
    logger.info(
        "bench serve: %s%d requests to %s%s, rate %s, max concurrency %s",
        f"tenant {source.tenant.name}: " if source.tenant else "",
        num_requests,
        base_url,
        args.endpoint,
        source.tenant.request_rate if source.tenant else args.request_rate,
        source.max_concurrency,
    )


def _print_reports(
    args: argparse.Namespace,
    options: RunOptions,
    summary: dict,
    tenant_part: dict,
    server: dict | None,
) -> None:
    """The result block as vllm bench serve prints it, then each tenant's and the server's."""
    metric_names, percentiles = options.metric_names, options.percentiles
    if options.tenants:
        # The flags' rate and concurrency are only the tenants' defaults: not printed.
        print(format_report(summary, metric_names, percentiles, None, float("inf")))
        print(format_tenant_report(tenant_part["tenants"], metric_names))
    else:
        print(
            format_report(
                summary, metric_names, percentiles, args.max_concurrency, args.request_rate
            )
        )
    if server is not None:
        print(format_server_report(server))


def _tenant_results(
    sources: list[TrafficSource],
    runs: list[tuple[list[RequestRecord], float]],
    tokenizer,
    options: RunOptions,
    bench_start: float,
) -> dict:
    """The result's tenant part: each tenant's figures, and each request's tenant."""
    tenants: dict[str, dict] = {}
    request_tenants: list[str] = []
    for source, (records, end_time) in zip(sources, runs):
        assert source.tenant is not None, "every source of a --tenants run has a tenant"
        tenants[source.tenant.name] = summarize_tenant(
            source.tenant,
            records,
            end_time - bench_start,
            tokenizer,
            options.percentiles,
            options.slos,
            bench_start,
        )
        request_tenants += [source.tenant.name] * len(records)
    return {"tenants": tenants, "request_tenants": request_tenants}


def _run_config(
    args: argparse.Namespace, options: RunOptions, base_url: str, model: str, num_prompts: int
) -> dict:
    if options.tenants:
        # Each tenant has its own rate and concurrency (the result's "tenants").
        request_rate, max_concurrency = None, None
    else:
        request_rate = args.request_rate if args.request_rate != float("inf") else "inf"
        max_concurrency = args.max_concurrency
    config = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if args.endpoint.endswith("chat/completions") else "openai",
        "label": args.label,
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model_id": model,
        "tokenizer_id": args.tokenizer,
        "dataset_name": args.dataset_name,
        "num_prompts": num_prompts,
        "request_rate": request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": max_concurrency,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
    }
    if options.tenants:
        config["tenant_header"] = args.tenant_header or None
    return config


def result_path(args: argparse.Namespace, result: dict) -> str:
    if args.result_filename:
        name = args.result_filename
    elif "tenants" in result:
        name = (
            f"{args.label or 'openai'}-tenants-{'+'.join(result['tenants'])}-"
            f"{os.path.basename(str(result['model_id']))}-{result['date']}.json"
        )
    else:
        rate = result["request_rate"]
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        name = (
            f"{args.label or 'openai'}-{rate}qps{concurrency}-"
            f"{os.path.basename(str(result['model_id']))}-{result['date']}.json"
        )
    os.makedirs(args.result_dir, exist_ok=True)
    return os.path.join(args.result_dir, name)
