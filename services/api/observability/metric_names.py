"""--metrics-prefix: /metrics under kvserve's own names, or under vLLM 0.32's.

Every series is made once, named `kvserve:` (services/api/observability/metrics.py,
tenancy/metrics.py, auth.py). With `--metrics-prefix vllm`, /metrics reads the same registry through
`vllm_named`, which renames each family of `VLLM_NAMES` and gives it vLLM's labels:

    kvserve:prompt_tokens_total{model_name,engine} -> vllm:prompt_tokens_total{model_name,engine}
    kvserve:cache_config_info{engine, <kvserve's CacheConfig fields>}
        -> vllm:cache_config_info{engine, <vLLM's CacheConfig fields>}

A family vLLM 0.32 has no series for keeps its `kvserve:` name in either mode (engine_up,
engine_suspect, tenant_*, request_migration*, kv_store_*, kv_transfer_*, structured outputs,
gemm_path_info, api_key_requests, and time_per_output_token_seconds, which vLLM 0.32 no
longer exports): a `vllm:` name would promise dashboards a vLLM series that does not exist.
tests/support/vllm_metrics.py lists vLLM 0.32's series and says which kvserve cannot honour.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

Relabel = Callable[[dict[str, str]], dict[str, str]]

# vLLM 0.32's CacheConfig fields, the labels of vllm:cache_config_info besides `engine`
# (CacheConfig.metrics_info(): each field of its __dict__ as a string).
# fmt: off
VLLM_CACHE_CONFIG_FIELDS = (
    "block_size", "user_specified_block_size", "kv_cache_layout", "prefix_match_unit",
    "gpu_memory_utilization", "cache_dtype", "is_attention_free", "num_gpu_blocks_override",
    "sliding_window", "enable_prefix_caching", "prefix_caching_hash_algo",
    "prefix_cache_retention_interval", "kv_cache_dtype_skip_layers", "mamba_page_size_padded",
    "skip_page_size_padded", "mamba_block_size", "mamba_cache_dtype", "mamba_ssm_cache_dtype",
    "mamba_cache_mode", "enable_mamba_shared_prefix_checkpoint", "replayssm_buffer_len",
    "use_replayssm", "use_kda_recoverssm", "num_gpu_blocks", "num_cpu_blocks",
    "effective_attention_block_size", "kv_cache_size_tokens", "kv_cache_max_concurrency",
    "hash_block_size", "cache_hit_alignment_tokens", "kv_sharing_fast_prefill",
    "swa_bounded_replay", "kv_cache_memory_bytes", "kv_offloading_size",
    "kv_offloading_backend", "_block_size_resolved",
)
# fmt: on


def _vllm_cache_config_labels(labels: dict[str, str]) -> dict[str, str]:
    """kvserve's fields (each is one of vLLM's, with the same meaning) under vLLM's label set;
    a field kvserve does not have reads "None", as vLLM writes an unset one."""
    return {"engine": labels["engine"]} | {
        field: labels.get(field, "None") for field in VLLM_CACHE_CONFIG_FIELDS
    }


# kvserve family -> (vLLM family, label mapping; None: the labels are vLLM's already).
# Counters are named without `_total`, as prometheus_client names their families.
VLLM_NAMES: dict[str, tuple[str, Relabel | None]] = {
    "kvserve:num_requests_running": ("vllm:num_requests_running", None),
    "kvserve:num_requests_waiting": ("vllm:num_requests_waiting", None),
    "kvserve:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", None),
    "kvserve:engine_sleep_state": ("vllm:engine_sleep_state", None),
    "kvserve:num_preemptions": ("vllm:num_preemptions", None),
    "kvserve:prefix_cache_queries": ("vllm:prefix_cache_queries", None),
    "kvserve:prefix_cache_hits": ("vllm:prefix_cache_hits", None),
    "kvserve:external_prefix_cache_queries": ("vllm:external_prefix_cache_queries", None),
    "kvserve:external_prefix_cache_hits": ("vllm:external_prefix_cache_hits", None),
    "kvserve:spec_decode_num_drafts": ("vllm:spec_decode_num_drafts", None),
    "kvserve:spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens", None),
    "kvserve:spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens", None),
    "kvserve:spec_decode_num_accepted_tokens_per_pos": (
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        None,
    ),
    "kvserve:prompt_tokens": ("vllm:prompt_tokens", None),
    "kvserve:generation_tokens": ("vllm:generation_tokens", None),
    "kvserve:prompt_tokens_cached": ("vllm:prompt_tokens_cached", None),
    "kvserve:request_success": ("vllm:request_success", None),
    "kvserve:iteration_tokens_total": ("vllm:iteration_tokens_total", None),
    "kvserve:request_prompt_tokens": ("vllm:request_prompt_tokens", None),
    "kvserve:request_generation_tokens": ("vllm:request_generation_tokens", None),
    "kvserve:request_max_num_generation_tokens": (
        "vllm:request_max_num_generation_tokens",
        None,
    ),
    "kvserve:request_params_n": ("vllm:request_params_n", None),
    "kvserve:request_params_max_tokens": ("vllm:request_params_max_tokens", None),
    "kvserve:request_num_preemptions": ("vllm:request_num_preemptions", None),
    "kvserve:request_prefill_kv_computed_tokens": (
        "vllm:request_prefill_kv_computed_tokens",
        None,
    ),
    "kvserve:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds", None),
    "kvserve:inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", None),
    "kvserve:request_time_per_output_token_seconds": (
        "vllm:request_time_per_output_token_seconds",
        None,
    ),
    "kvserve:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds", None),
    "kvserve:request_queue_time_seconds": ("vllm:request_queue_time_seconds", None),
    "kvserve:request_inference_time_seconds": ("vllm:request_inference_time_seconds", None),
    "kvserve:request_prefill_time_seconds": ("vllm:request_prefill_time_seconds", None),
    "kvserve:request_decode_time_seconds": ("vllm:request_decode_time_seconds", None),
    "kvserve:lora_requests_info": ("vllm:lora_requests_info", None),
    "kvserve:cache_config_info": ("vllm:cache_config_info", _vllm_cache_config_labels),
}


def exposed_name(name: str, metrics_prefix: str) -> str:
    """The name a `kvserve:` family or sample has on /metrics under --metrics-prefix: the
    Grafana board generator's and the tests' one way to ask the table."""
    if metrics_prefix == "kvserve":
        return name
    for suffix in ("", "_total", "_bucket", "_sum", "_count", "_created"):
        base = name[: len(name) - len(suffix)] if suffix else name
        if name.endswith(suffix) and base in VLLM_NAMES:
            return VLLM_NAMES[base][0] + suffix
    return name


def _renamed(family: Metric, name: str, relabel: Relabel | None) -> Metric:
    # A sample's name is its family's plus a suffix (_total, _bucket, _sum, _count, _created).
    renamed = Metric(name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        renamed.samples.append(
            sample._replace(
                name=name + sample.name[len(family.name) :],
                labels=relabel(sample.labels) if relabel else sample.labels,
            )
        )
    return renamed


class _VllmNamed(Collector):
    """`registry`'s families, those vLLM also has under vLLM's names and labels."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            entry = VLLM_NAMES.get(family.name)
            yield family if entry is None else _renamed(family, *entry)


def vllm_named(registry: CollectorRegistry) -> CollectorRegistry:
    """A registry that reads `registry` at each scrape and renames as VLLM_NAMES says."""
    view = CollectorRegistry(auto_describe=False)
    view.register(_VllmNamed(registry))
    return view
