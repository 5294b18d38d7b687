"""A small Scheduler driven by a fake model: requests, hand-built runner outputs, steps.

Scheduler and KV tests run on CPU without a model, as in vLLM's tests/v1/core: the test
decides what the "model" samples and checks what the scheduler does with it.
"""

from __future__ import annotations

import itertools

from kvserve.services.scheduler.core.features import SchedulerFeatures
from kvserve.services.scheduler.core.request import Request, make_block_hasher
from kvserve.services.scheduler.core.scheduler import Scheduler
from kvserve.services.scheduler.engine.request_checks import RequestChecker
from kvserve.shared.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from kvserve.shared.hashing import get_hash_fn
from kvserve.shared.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    ModelRunnerOutput,
    SchedulerOutput,
)
from kvserve.shared.sampling_params import SamplingParams

# Tokens the fake model "samples": never EOS_TOKEN_ID unless a test asks for it.
SAMPLED_TOKEN_ID = 7
EOS_TOKEN_ID = 2

_prompt_counter = itertools.count()


def create_scheduler(
    *,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 16,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    scheduling_policy: str = "fcfs",
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    hash_algo: str = "sha256",
    num_blocks: int = 1000,
    max_model_len: int = 1024,
    log_stats: bool = True,
    speculative_config: SpeculativeConfig | None = None,
    step_costs: list[tuple[int, float]] | None = None,
    kv_connector=None,
    max_pinned_cache_fraction: float = 0.5,
) -> Scheduler:
    """A Scheduler over `num_blocks` KV blocks (block 0 is the null block); the knobs are the
    config fields of the same names."""
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        scheduling_policy=scheduling_policy,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        prefix_caching_hash_algo=hash_algo,
        max_pinned_cache_fraction=max_pinned_cache_fraction,
    )
    return Scheduler(
        scheduler_config,
        cache_config,
        num_blocks,
        max_model_len,
        log_stats,
        SchedulerFeatures(
            speculative_config=speculative_config,
            step_costs=step_costs or [],
            kv_connector=kv_connector,
        ),
    )


def create_request(
    req_id: str,
    num_tokens: int = 10,
    *,
    prompt_token_ids: list[int] | None = None,
    max_tokens: int | None = 16,
    priority: int = 0,
    arrival_time: float = 0.0,
    eos_token_id: int | None = EOS_TOKEN_ID,
    cache_salt: str | None = None,
    tenant: str = "default",
    tenant_weight: float = 1.0,
    **sampling_kwargs,
) -> EngineCoreRequest:
    """A request (of `tenant`); unless `prompt_token_ids` is given, its prompt is
    `num_tokens` ids that no other request shares, so prefix hits happen only where a test
    asks for them."""
    if prompt_token_ids is None:
        first_id = 100 + 10_000 * next(_prompt_counter)
        prompt_token_ids = list(range(first_id, first_id + num_tokens))
    return EngineCoreRequest(
        request_id=req_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=SamplingParams(max_tokens=max_tokens, **sampling_kwargs),
        eos_token_id=eos_token_id,
        arrival_time=arrival_time,
        priority=priority,
        cache_salt=cache_salt,
        tenant=tenant,
        tenant_weight=tenant_weight,
    )


def submit(scheduler: Scheduler, engine_request: EngineCoreRequest) -> None:
    """Hand a request to the scheduler as the engine core does: request_checks first, and a
    refused request gets an ERROR output with the next step's outputs."""
    checker = RequestChecker(
        None,
        max_logprobs=20,
        max_model_len=scheduler.max_model_len,
        structured_outputs=scheduler.structured_output_manager is not None,
        lora_config=scheduler.lora_config,
    )
    error = checker.check(engine_request, engine_request.request_id in scheduler.requests)
    if error is None:
        scheduler.add_request(engine_request)
    else:
        scheduler.reject(engine_request.request_id, error)


def make_runner_output(
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    sampled: dict[str, list[int]] | None = None,
    spec_token_ids: dict[str, list[int]] | None = None,
) -> ModelRunnerOutput:
    """What a model would return: one token for each request whose tokens are all computed
    after this step, none for prompt chunks that stop short; `sampled` overrides per request,
    and `spec_token_ids` are the drafts proposed for the next step."""
    sampled = sampled or {}
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled_token_ids = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        done = request is not None and request.num_computed_tokens >= request.num_tokens
        sampled_token_ids.append(sampled.get(req_id, [SAMPLED_TOKEN_ID]) if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=sampled_token_ids, spec_token_ids=spec_token_ids or {}
    )


def step(
    scheduler: Scheduler,
    sampled: dict[str, list[int]] | None = None,
    spec_token_ids: dict[str, list[int]] | None = None,
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine step with a fake model."""
    scheduler_output = scheduler.schedule()
    runner_output = make_runner_output(scheduler, scheduler_output, sampled, spec_token_ids)
    return scheduler_output, scheduler.update_from_output(scheduler_output, runner_output)


def run_to_completion(scheduler: Scheduler, max_steps: int = 1000) -> dict[str, EngineCoreOutput]:
    """Step until every request finished; returns each request's final output."""
    finals = {}
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return finals
        _, outputs = step(scheduler)
        finals.update({out.request_id: out for out in outputs if out.finished})
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def make_hashed_request(
    req_id: str,
    token_ids: list[int],
    block_size: int,
    *,
    hash_algo: str = "sha256",
    cache_salt: str | None = None,
    **sampling_kwargs,
) -> Request:
    """A scheduler-side Request (what the KV cache manager and block pool see) whose block
    hashes grow with its tokens.

    Args:
        token_ids: the prompt.
        block_size: tokens per KV block, for the block hashes.
        hash_algo: "sha256" or "xxhash".
        sampling_kwargs: SamplingParams fields (prompt_logprobs disables prefix-cache reads).
    """
    return Request(
        req_id,
        token_ids,
        SamplingParams(**sampling_kwargs),
        cache_salt=cache_salt,
        block_hasher=make_block_hasher(block_size, get_hash_fn(hash_algo)),
    )
