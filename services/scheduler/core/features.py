"""The optional features a Scheduler plugs in, and how many live requests use each one."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.services.kv_store.connector import SchedulerConnector
from kvserve.services.scheduler.core.request import Request
from kvserve.services.scheduler.structured_output.manager import StructuredOutputManager
from kvserve.shared.config import LoRAConfig, SpeculativeConfig
from kvserve.shared.kv_cache_groups import KVCacheGroupSpec


@dataclass(frozen=True)
class SchedulerFeatures:
    """The optional features a Scheduler plugs in, each at its seam (all off by default).

    Args:
        structured_output_manager: compiles grammars; None refuses structured requests.
        lora_config: with enable_lora, requests may name adapters, and the running requests
            use max_loras distinct adapters at most (the others wait); else LoRA requests
            are refused.
        speculative_config: speculative decoding (None: off). Each decoding request's drafts
            from the last step are scheduled as extra query tokens; the ones the target
            rejects are rolled back (num_computed_tokens and the KV slots they wrote).
            The rules are spec_scheduler.py's (`Scheduler.spec_decode`).
        step_costs: (query tokens, seconds) of a forward, measured by the workers; the
            adaptive speculation rule (spec_decode.py) weighs drafts against them.
        prompt_keys_per_token: attended keys whose attention costs what one prompt token's
            linear layers cost, from the model's shape (ModelRunner.prompt_keys_per_token):
            the latency targets' step-time model prices a prompt chunk's attention with it
            (step_time.py); 0: unknown.
        kv_connector: the KV connector's scheduler half (services/kv_store/connector.py):
            a waiting request with external prefix hits parks until they load; what else
            the connector moves (saves, evicted blocks) is its own business.
        kv_cache_groups: the model's KV cache groups (shared/kv_cache_groups.py); a
            sliding-window or chunked-local one gives back blocks out of its window
            (GroupedKVCacheManager). None or one full group: one block table.
    """

    structured_output_manager: StructuredOutputManager | None = None
    lora_config: LoRAConfig | None = None
    speculative_config: SpeculativeConfig | None = None
    step_costs: list[tuple[int, float]] = field(default_factory=list)
    prompt_keys_per_token: float = 0.0
    kv_connector: SchedulerConnector | None = None
    kv_cache_groups: list[KVCacheGroupSpec] | None = None


NO_FEATURES = SchedulerFeatures()


@dataclass
class LiveFeatureCounts:
    """How many live requests use each per-step feature: a step skips the work of a feature
    that no request uses."""

    num_grammars: int = 0  # requests holding a matcher (bitmask work to do)
    num_thinking_budgets: int = 0  # requests whose thinking end may be forced
    num_pooling: int = 0  # embedding requests (the runner pools their prompts)
    num_traced: int = 0  # requests with a RequestTrace (--otlp-traces-endpoint)

    def add(self, request: Request) -> None:
        """Count an arriving request (its grammar counts once it compiles)."""
        if request.trace is not None:
            self.num_traced += 1
        if request.sampling_params.thinking_token_budget is not None:
            self.num_thinking_budgets += 1
        if request.sampling_params.pooling is not None:
            self.num_pooling += 1

    def remove(self, request: Request) -> None:
        """Uncount a request that ended; it lets go of its grammar."""
        if request.sampling_params.thinking_token_budget is not None:
            self.num_thinking_budgets -= 1
        if request.sampling_params.pooling is not None:
            self.num_pooling -= 1
        if request.trace is not None:
            self.num_traced -= 1
        if request.structured_output is not None and request.structured_output.grammar:
            request.structured_output.grammar = None
            self.num_grammars -= 1
