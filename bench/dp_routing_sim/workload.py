"""Multi-tenant workload: shared per-tenant prefixes, unique suffixes, Poisson arrivals.

Each tenant owns one system-prompt/document prefix; its requests are that prefix plus a unique
suffix. Tenants are picked with Zipf popularity (tenant 0 the most popular).

Block hashes stand in for kvserve's chained sha256 hashes (shared/hashing.py): every prompt is
built from known pieces, so a block's chain is named by small ints instead of hashed bytes:

    tenant prefix block i      ->  tenant << 20 | i          (equal chains, equal keys)
    any other full prompt block -> -(req_idx << 12 | i) - 1   (unique, never hit)

The block that straddles the prefix/suffix boundary holds suffix tokens, so it is unique. Only
full blocks have hashes, as in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class WorkloadConfig:
    """Args:
        num_tenants: tenants, each with one shared prefix.
        prefix_len_range: inclusive (min, max) tokens of a tenant's prefix, drawn once per
            tenant; (0, 0) gives a workload with nothing shared.
        suffix_len_range: inclusive (min, max) unique prompt tokens per request.
        output_len_range: inclusive (min, max) generated tokens per request.
        zipf_exponent: tenant popularity ~ 1 / rank**zipf_exponent (0 = uniform).
        block_size: tokens per KV block.
    """

    num_tenants: int = 128
    prefix_len_range: tuple[int, int] = (512, 2048)
    suffix_len_range: tuple[int, int] = (128, 384)
    output_len_range: tuple[int, int] = (64, 192)
    zipf_exponent: float = 1.0
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.num_tenants < 1:
            raise ValueError(f"num_tenants must be >= 1, got {self.num_tenants}")
        for name in ("prefix_len_range", "suffix_len_range", "output_len_range"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"{name} must be (min, max) with 0 <= min <= max, "
                                 f"got {(low, high)}")
        if self.suffix_len_range[0] < 1 or self.output_len_range[0] < 1:
            raise ValueError("suffix and output lengths must be >= 1 token")

    @property
    def max_request_tokens(self) -> int:
        return (self.prefix_len_range[1] + self.suffix_len_range[1]
                + self.output_len_range[1])


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request: its workload fields, then engine-side state and results.

    Args:
        req_idx: index in arrival order.
        arrival_s: arrival time (simulated seconds).
        tenant: tenant index.
        prompt_len: prompt tokens.
        output_len: tokens to generate.
        block_hashes: keys of the prompt's full blocks, in chain order.
    """

    req_idx: int
    arrival_s: float
    tenant: int
    prompt_len: int
    output_len: int
    block_hashes: list[int]
    # Engine-side state (see engine.py): tokens known, tokens with KV, KV blocks held.
    num_tokens: int = 0
    num_computed: int = 0
    num_output: int = 0
    num_blocks: int = 0
    held_hashes: list[int] = field(default_factory=list)
    # Results.
    engine_idx: int = -1
    num_cached_tokens: int = -1  # prefix-cache hit at first admission
    first_token_s: float = -1.0
    finish_s: float = -1.0

    def __post_init__(self) -> None:
        self.num_tokens = self.prompt_len


def make_tenant_prefix_lens(config: WorkloadConfig, seed: int) -> np.ndarray:
    """Prefix length per tenant (the same for every run with this seed)."""
    rng = np.random.default_rng([seed, 1])
    low, high = config.prefix_len_range
    return rng.integers(low, high + 1, size=config.num_tenants)


def make_requests(config: WorkloadConfig, num_requests: int, rate_per_s: float,
                  seed: int, stream: int = 0) -> list[SimRequest]:
    """Requests with Poisson arrivals at `rate_per_s` (all at t=0 when rate is inf).

    Args:
        config: the workload shape.
        num_requests: how many requests.
        rate_per_s: mean arrivals per simulated second over the whole fleet.
        seed: the workload seed (tenant prefixes depend on it alone).
        stream: picks an independent request stream for the same tenants.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
    prefix_lens = make_tenant_prefix_lens(config, seed)
    rng = np.random.default_rng([seed, 2, stream])
    if np.isinf(rate_per_s):
        arrivals = np.zeros(num_requests)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / rate_per_s, size=num_requests))
    popularity = 1.0 / np.arange(1, config.num_tenants + 1) ** config.zipf_exponent
    tenants = rng.choice(config.num_tenants, size=num_requests,
                         p=popularity / popularity.sum())
    suffix_lens = rng.integers(config.suffix_len_range[0], config.suffix_len_range[1] + 1,
                               size=num_requests)
    output_lens = rng.integers(config.output_len_range[0], config.output_len_range[1] + 1,
                               size=num_requests)
    block_size = config.block_size
    tenant_hashes = [[tenant << 20 | i for i in range(int(prefix_len) // block_size)]
                     for tenant, prefix_len in enumerate(prefix_lens)]
    requests = []
    for req_idx in range(num_requests):
        tenant = int(tenants[req_idx])
        prompt_len = int(prefix_lens[tenant] + suffix_lens[req_idx])
        num_shared = len(tenant_hashes[tenant])
        unique = [-(req_idx << 12 | i) - 1
                  for i in range(num_shared, prompt_len // block_size)]
        requests.append(SimRequest(req_idx, float(arrivals[req_idx]), tenant, prompt_len,
                                   int(output_lens[req_idx]),
                                   tenant_hashes[tenant] + unique))
    return requests


def ideal_cached_tokens(requests: list[SimRequest], block_size: int) -> list[int]:
    """Per request, the prefix-cache hit of one engine with unbounded KV: the tenant's
    prefix blocks once any earlier request of the tenant has been seen (the last prompt
    token is always recomputed)."""
    seen: set[int] = set()
    cached = []
    for request in requests:
        shared = sum(1 for h in request.block_hashes if h >= 0)
        max_blocks = (request.prompt_len - 1) // block_size
        cached.append(min(shared, max_blocks) * block_size if request.tenant in seen else 0)
        seen.add(request.tenant)
    return cached
