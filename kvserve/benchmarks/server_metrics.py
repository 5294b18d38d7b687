"""What the server saw during a benchmark, from its Prometheus /metrics.

kvserve exposes vLLM's metric names and labels under `kvserve:` (vLLM itself uses `vllm:`),
so both are read the same way: preemptions, prefix-cache counters and the engine's phase
histograms (queue, prefill, decode) are scraped before and after the run (the delta is the
run's), and KV-cache usage is polled during it for the peak. Every series has an `engine`
label; with data parallelism the engines' samples are combined. A server without these
metrics (llama.cpp, or no /metrics at all) gets no server-side section: not an error.
"""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvserve.shared.logging import init_logger

logger = init_logger("kvserve.benchmarks")

METRIC_PREFIXES = ("kvserve:", "vllm:")
_COUNTERS = (
    "num_preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "external_prefix_cache_queries",
    "external_prefix_cache_hits",
)
_KV_USAGE = "kv_cache_usage_perc"
# Engine-side phase histograms (seconds): the report shows the run's mean of each.
_PHASES = {
    "queue": "request_queue_time_seconds",
    "prefill": "request_prefill_time_seconds",
    "decode": "request_decode_time_seconds",
}
_HISTOGRAM_SAMPLES = tuple(
    f"{name}_{part}" for name in _PHASES.values() for part in ("sum", "count")
)
POLL_INTERVAL_S = 0.25
# A server too busy to answer /metrics in time loses a KV-usage sample, not the run.
_SCRAPE_TIMEOUT = aiohttp.ClientTimeout(total=10)


def parse_engine_metrics(text: str) -> dict[str, float] | None:
    """{metric name without prefix: value}, counters summed over engines, KV usage the max.

    None when the text holds none of the engine metrics under a known prefix.
    """
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return None
    wanted = set(_COUNTERS) | {_KV_USAGE} | set(_HISTOGRAM_SAMPLES)
    samples = [sample for family in families for sample in family.samples]
    for prefix in METRIC_PREFIXES:
        values: dict[str, float] = {}
        for sample in samples:
            # Counters are exposed as `NAME_total` (and `NAME_created`, a timestamp); the
            # TYPE line may name either, so the sample names are what is matched.
            name = sample.name.removeprefix(prefix).removesuffix("_total")
            if not sample.name.startswith(prefix) or name not in wanted:
                continue
            # One series per engine: counters and histogram sums add up, while KV usage is
            # a fraction per engine, so the fullest engine's is kept.
            combine = max if name == _KV_USAGE else sum
            values[name] = combine((values.get(name, 0.0), sample.value))
        if values:
            return values
    return None


async def scrape(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str]
) -> dict[str, float] | None:
    """The engine metrics at url, or None if the server has none."""
    try:
        async with session.get(url, headers=headers, timeout=_SCRAPE_TIMEOUT) as response:
            if response.status != 200:
                return None
            return parse_engine_metrics(await response.text())
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None


class ServerMetricsWatcher:
    """Scrapes before, polls KV usage during, scrapes after.

    Args:
        session: the benchmark's HTTP session.
        url: the server's /metrics URL.
        headers: extra headers (Authorization).
    """

    def __init__(self, session: aiohttp.ClientSession, url: str, headers: dict[str, str]):
        self.session = session
        self.url = url
        self.headers = headers
        self.before: dict[str, float] | None = None
        self.peak_kv_usage = 0.0
        self._poller: asyncio.Task | None = None

    async def start(self) -> None:
        self.before = await scrape(self.session, self.url, self.headers)
        if self.before is None:
            logger.info(
                "no kvserve:/vllm: engine metrics at %s: server-side section skipped", self.url
            )
            return
        self._poller = asyncio.create_task(self._poll_kv_usage())

    async def _poll_kv_usage(self) -> None:
        while True:
            values = await scrape(self.session, self.url, self.headers)
            if values is not None:
                self.peak_kv_usage = max(self.peak_kv_usage, values.get(_KV_USAGE, 0.0))
            await asyncio.sleep(POLL_INTERVAL_S)

    async def stop(self) -> dict | None:
        """The run's server-side figures, or None when the server exposes none."""
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except asyncio.CancelledError:
                pass
        if self.before is None:
            return None
        after = await scrape(self.session, self.url, self.headers)
        if after is None:
            return None
        return server_delta(self.before, after, self.peak_kv_usage)


def server_delta(before: dict[str, float], after: dict[str, float], peak_kv_usage: float) -> dict:
    """The run's preemptions, prefix-cache hit rate (None without queries), peak KV use and
    mean engine phase times in ms (None without finished requests, or from a server that
    has no such histograms)."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    num_queries = delta("prefix_cache_queries")
    peak = max(peak_kv_usage, after.get(_KV_USAGE, 0.0))
    phase_means = {}
    for phase, name in _PHASES.items():
        count = delta(f"{name}_count")
        mean = delta(f"{name}_sum") / count * 1000 if count > 0 else None
        phase_means[f"server_mean_{phase}_time_ms"] = mean
    return {
        "server_num_preemptions": int(delta("num_preemptions")),
        "server_prefix_cache_queries": int(num_queries),
        "server_prefix_cache_hits": int(delta("prefix_cache_hits")),
        "server_prefix_cache_hit_rate": delta("prefix_cache_hits") / num_queries
        if num_queries > 0
        else None,
        "server_peak_kv_cache_usage": peak,
        **phase_means,
        **spec_decode_figures(delta),
        "server_external_prefix_cache_hit_rate": delta("external_prefix_cache_hits")
        / delta("external_prefix_cache_queries")
        if delta("external_prefix_cache_queries") > 0
        else None,
    }


def spec_decode_figures(delta) -> dict:
    """Speculative decoding's acceptance rate (accepted / draft tokens) and mean acceptance
    length (1 + accepted per draft: tokens per verifying step, vLLM's definition); None
    when the run verified no drafts."""
    num_drafts = delta("spec_decode_num_drafts")
    num_draft_tokens = delta("spec_decode_num_draft_tokens")
    num_accepted = delta("spec_decode_num_accepted_tokens")
    if num_drafts <= 0 or num_draft_tokens <= 0:
        return {"server_spec_acceptance_rate": None, "server_spec_mean_acceptance_length": None}
    return {
        "server_spec_acceptance_rate": num_accepted / num_draft_tokens,
        "server_spec_mean_acceptance_length": 1 + num_accepted / num_drafts,
    }


def format_server_report(figures: dict) -> str:
    """The server-side block printed under the client-side result."""
    hit_rate = figures["server_prefix_cache_hit_rate"]
    hit_rate_text = f"{hit_rate * 100:<10.2f}" if hit_rate is not None else "n/a"
    peak_kv_percent = figures["server_peak_kv_cache_usage"] * 100
    lines = [
        f"{'Server-side (/metrics delta)':-^50}",
        f"{'Preemptions:':<40} {figures['server_num_preemptions']:<10}",
        f"{'Prefix cache hit rate (%):':<40} {hit_rate_text}",
        f"{'Peak KV-cache usage (%):':<40} {peak_kv_percent:<10.2f}",
    ]
    for phase in _PHASES:
        mean = figures.get(f"server_mean_{phase}_time_ms")
        if mean is not None:
            lines.append(f"{f'Mean {phase} time (ms):':<40} {mean:<10.2f}")
    external = figures.get("server_external_prefix_cache_hit_rate")
    if external is not None:
        lines.append(f"{'External prefix cache hit rate (%):':<40} {external * 100:<10.2f}")
    if figures.get("server_spec_acceptance_rate") is not None:
        rate = figures["server_spec_acceptance_rate"] * 100
        length = figures["server_spec_mean_acceptance_length"]
        lines.append(f"{'Draft acceptance rate (%):':<40} {rate:<10.2f}")
        lines.append(f"{'Mean acceptance length:':<40} {length:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)
