"""`kvserve bench serve --tenants`: a mix of traffic sources, one per tenant.

The spec names each tenant and its traffic; tenants are separated by `;`, fields by `,`:

    heavy:rate=inf,conc=32,input=1024,output=64,num=200;light:rate=1,input=128,output=32,num=20

    rate    requests per second (inf: all at once, up to conc)     default --request-rate
    conc    requests in flight at most                             default --max-concurrency
    input   prompt tokens (random tokens, as --dataset-name random) default --random-input-len
    output  max_tokens                                              default --random-output-len
    num     requests to send                                        default --num-prompts
    key     API key sent as `Authorization: Bearer`                 default --api-key
    ttft    TTFT target in ms, sent as the x-slo-ttft-ms header     default none
    tpot    TPOT target in ms, sent as the x-slo-tpot-ms header     default none
    weight  not used by the client: the server's key file sets it; kept so that one spec
            can document the mix

Every request also carries the tenant header (--tenant-header, `X-Tenant: heavy`). A tenant's
prompts and arrivals are seeded by its position in the spec, so `--tenants-only light`
sends light exactly what it sends in the mix. This module parses the spec, sums up each
tenant's records and prints the per-tenant table.

A tenant's targets travel as headers (kvserve's latency targets; vLLM ignores them, so the
same client drives both), and are its goodput targets in the report, over --goodput's:
goodput as vLLM defines it, the requests per second that met every target they had.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvserve.benchmarks.classes import TPOT_HEADER, TTFT_HEADER
from kvserve.benchmarks.endpoint_client import RequestRecord
from kvserve.benchmarks.metrics import METRIC_SECTIONS, compute_metrics, percentile_key

# The percentiles of the per-tenant table; --metric-percentiles adds more to the JSON.
TENANT_PERCENTILES = (50.0, 90.0, 99.0)
# The server's tenant names, less `:` (it ends the name in the spec).
_TENANT_NAME = re.compile(r"^[A-Za-z0-9._@-]{1,64}$")
_MAX_ERROR_EXAMPLES = 5


@dataclass(frozen=True)
class TenantTraffic:
    """One tenant's traffic source in a --tenants mix.

    Args:
        name: the tenant, sent as the tenant header's value.
        index: its position in the spec; seeds its prompts and arrivals.
        request_rate: requests per second (inf: all at once, up to max_concurrency).
        max_concurrency: requests in flight at most (None: no cap).
        input_len: prompt tokens.
        output_len: max_tokens of each request.
        num_prompts: requests to send.
        api_key: the bearer token (None: --api-key's, if any).
        weight: the tenant's weight as the spec documents it; the client does not use it.
        ttft_ms: its TTFT target (None: none).
        tpot_ms: its TPOT target (None: none).
    """

    name: str
    index: int
    request_rate: float
    max_concurrency: int | None
    input_len: int
    output_len: int
    num_prompts: int
    api_key: str | None = None
    weight: float = 1.0
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def targets(self) -> dict[str, float]:
        """Its targets as goodput SLOs ({'ttft': ms, 'tpot': ms}, those it has)."""
        found = {"ttft": self.ttft_ms, "tpot": self.tpot_ms}
        return {name: ms for name, ms in found.items() if ms is not None}

    def target_headers(self) -> dict[str, str]:
        """The headers that carry its targets to the server."""
        found = {TTFT_HEADER: self.ttft_ms, TPOT_HEADER: self.tpot_ms}
        return {name: f"{ms:g}" for name, ms in found.items() if ms is not None}

    def config(self) -> dict:
        """The spec's fields for the result JSON, without the API key (targets if set)."""
        return {
            "request_rate": "inf" if math.isinf(self.request_rate) else self.request_rate,
            "max_concurrency": self.max_concurrency,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "num_prompts": self.num_prompts,
            "weight": self.weight,
            **{f"{name}_ms": ms for name, ms in self.targets().items()},
        }


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None
    if value < 1:
        raise ValueError("must be an integer >= 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number (or inf)") from None
    if math.isnan(value) or value <= 0:
        raise ValueError("must be a number > 0")
    return value


def _target_ms(text: str) -> float:
    value = _positive_float(text)
    if math.isinf(value):
        raise ValueError("a target is a finite number of milliseconds")
    return value


def _api_key(text: str) -> str:
    if not text:
        raise ValueError("must not be empty")
    return text


# spec field -> (TenantTraffic attribute, parser of its value).
_FIELDS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "rate": ("request_rate", _positive_float),
    "conc": ("max_concurrency", _positive_int),
    "input": ("input_len", _positive_int),
    "output": ("output_len", _positive_int),
    "num": ("num_prompts", _positive_int),
    "key": ("api_key", _api_key),
    "weight": ("weight", _positive_float),
    "ttft": ("ttft_ms", _target_ms),
    "tpot": ("tpot_ms", _target_ms),
}


def _parse_fields(name: str, text: str) -> dict[str, Any]:
    """'rate=1,num=20' -> {'request_rate': 1.0, 'num_prompts': 20}."""
    values: dict[str, Any] = {}
    for item in (item.strip() for item in text.split(",")):
        if not item:
            continue
        field, sep, value = (part.strip() for part in item.partition("="))
        if not sep:
            raise ValueError(f"--tenants: tenant {name!r}: expected FIELD=VALUE, got {item!r}")
        if field not in _FIELDS:
            raise ValueError(
                f"--tenants: tenant {name!r}: unknown field {field!r} "
                f"(fields: {', '.join(_FIELDS)})"
            )
        attribute, parse = _FIELDS[field]
        if attribute in values:
            raise ValueError(f"--tenants: tenant {name!r}: {field} is given twice")
        try:
            values[attribute] = parse(value)
        except ValueError as exc:
            raise ValueError(f"--tenants: tenant {name!r}: {field}={value}: {exc}") from None
    return values


def parse_tenants(text: str, defaults: TenantTraffic) -> list[TenantTraffic]:
    """The tenants of a --tenants spec, in its order.

    Args:
        text: the spec, `NAME[:FIELD=VALUE,...][;NAME...]`.
        defaults: the values of the fields a tenant does not give (from the flags).
    """
    tenants: list[TenantTraffic] = []
    for entry in (entry.strip() for entry in text.split(";")):
        if not entry:
            continue
        name, _, fields = (part.strip() for part in entry.partition(":"))
        if not _TENANT_NAME.match(name):
            raise ValueError(
                f"--tenants: {name!r} is not a tenant name (1-64 letters, digits or ._@-), "
                f"in {entry!r}"
            )
        if any(tenant.name == name for tenant in tenants):
            raise ValueError(f"--tenants: tenant {name!r} appears twice")
        tenants.append(
            replace(defaults, name=name, index=len(tenants), **_parse_fields(name, fields))
        )
    if not tenants:
        raise ValueError(f"--tenants names no tenant: {text!r}")
    return tenants


def select_tenants(tenants: list[TenantTraffic], only: str | None) -> list[TenantTraffic]:
    """The tenants named by --tenants-only (a comma list; None: all of them), in spec order."""
    if only is None:
        return tenants
    names = {name.strip() for name in only.split(",") if name.strip()}
    unknown = sorted(names - {tenant.name for tenant in tenants})
    if not names or unknown:
        raise ValueError(
            f"--tenants-only {only!r}: not a comma list of the spec's tenants "
            f"({', '.join(tenant.name for tenant in tenants)})"
        )
    return [tenant for tenant in tenants if tenant.name in names]


def tenants_of_args(args: argparse.Namespace) -> list[TenantTraffic]:
    """The tenants to run, from --tenants and --tenants-only; [] without --tenants."""
    if args.tenants is None:
        if args.tenants_only is not None:
            raise ValueError("--tenants-only picks tenants of --tenants, which is not given")
        return []
    if args.dataset_name != "random":
        raise ValueError(
            f"--tenants sends random prompts; --dataset-name {args.dataset_name} "
            "does not go with it"
        )
    if args.burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    defaults = TenantTraffic(
        name="",
        index=0,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        num_prompts=args.num_prompts,
        api_key=None,
    )
    return select_tenants(parse_tenants(args.tenants, defaults), args.tenants_only)


def summarize_tenant(
    tenant: TenantTraffic,
    records: list[RequestRecord],
    duration_s: float,
    tokenizer,
    percentiles: list[float],
    slos: dict[str, float],
    bench_start: float,
) -> dict:
    """One tenant's part of the result: its spec fields and the summary of its records.

    Args:
        tenant: the tenant.
        records: its requests' records.
        duration_s: from the run's start to the end of its last request (its throughputs
            are over this time, so a tenant run alone compares with the same tenant mixed).
        tokenizer: counts output tokens when the server sent no usage.
        percentiles: the asked pNN (TENANT_PERCENTILES are always added).
        slos: --goodput's SLOs in ms (the tenant's targets win over them).
        bench_start: perf_counter() at the start of the run.
    """
    percentiles = sorted({*TENANT_PERCENTILES, *percentiles})
    summary, detail = compute_metrics(
        records, tokenizer, duration_s, percentiles, slos | tenant.targets(), bench_start
    )
    errors = sorted({error for error in detail["errors"] if error})
    return {
        **tenant.config(),
        "num_requests": len(records),
        **summary,
        "error_examples": errors[:_MAX_ERROR_EXAMPLES],
    }


def format_tenant_report(tenant_results: dict[str, dict], metric_names: list[str]) -> str:
    """The per-tenant table: counts and throughput, then p50/p90/p99/mean of each metric.

    Args:
        tenant_results: tenant name -> summarize_tenant's dict.
        metric_names: the sections to print (--percentile-metrics).
    """
    name_width = max(6, *(len(name) for name in tenant_results))
    # Goodput only where some tenant had targets (its own or --goodput's).
    with_goodput = any(r["request_goodput"] is not None for r in tenant_results.values())
    width = max(50, name_width + (5 if with_goodput else 4) * 11)

    def row(first: str, cells: list[str]) -> str:
        return f"{first:<{name_width}}" + "".join(f"{cell:>11}" for cell in cells)

    headers = ["Requests", "Failed", "Out tokens", "Out tok/s"]
    lines = [
        f"{' Per-tenant Result ':=^{width}}",
        row("Tenant", headers + ["Good req/s"] if with_goodput else headers),
    ]
    for name, result in tenant_results.items():
        cells = [
            str(result["num_requests"]),
            str(result["failed"]),
            str(result["total_output_tokens"]),
            f"{result['output_throughput']:.2f}",
        ]
        if with_goodput:
            goodput = result["request_goodput"]
            cells.append("-" if goodput is None else f"{goodput:.3f}")
        lines.append(row(name, cells))
    keys = [f"p{percentile_key(p)}" for p in TENANT_PERCENTILES] + ["mean"]
    for metric in metric_names:
        _, short = METRIC_SECTIONS[metric]
        lines.append(f"{f' {short} (ms) ':-^{width}}")
        lines.append(row("Tenant", [key.upper() if key != "mean" else "Mean" for key in keys]))
        for name, result in tenant_results.items():
            lines.append(row(name, [f"{result[f'{key}_{metric}_ms']:.2f}" for key in keys]))
    lines.append("=" * width)
    return "\n".join(lines)
