"""Multi-tenant workload: shared per-tenant prefixes, unique suffixes, Poisson arrivals.

Each tenant owns one system-prompt/document prefix; its requests are that prefix plus a unique
suffix. Tenants are picked with Zipf popularity (tenant 0 the most popular). Every request
carries real token ids, so the shipped router and KV cache hash its blocks themselves
(kvserve.shared.hashing), exactly as the api and the engines do:

    | tenant prefix (shared)          | suffix (own)      | outputs (own)   |
    0                        prefix_len        prompt_len    prompt_len + output_len

A suffix starts with its request index (mod the vocabulary), so in a run of fewer than
`vocab_size` requests the block that holds the prefix/suffix boundary, and every block after
it, is unique to the request. Outputs are drawn in advance, as a model would have sampled
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_TOKEN_DTYPE = np.int32


@dataclass(frozen=True)
class WorkloadConfig:
    """
    Args:
        num_tenants: tenants, each with one shared prefix.
        prefix_len_range: inclusive (min, max) tokens of a tenant's prefix, drawn once per
            tenant; (0, 0) gives a workload with nothing shared.
        suffix_len_range: inclusive (min, max) unique prompt tokens per request.
        output_len_range: inclusive (min, max) generated tokens per request.
        zipf_exponent: tenant popularity ~ 1 / rank**zipf_exponent (0 = uniform).
        block_size: tokens per KV block.
        vocab_size: token ids are drawn from [0, vocab_size) (SmolLM2's 49152 by default).
    """

    num_tenants: int = 128
    prefix_len_range: tuple[int, int] = (512, 2048)
    suffix_len_range: tuple[int, int] = (128, 384)
    output_len_range: tuple[int, int] = (64, 192)
    zipf_exponent: float = 1.0
    block_size: int = 16
    vocab_size: int = 49152

    def __post_init__(self) -> None:
        if self.num_tenants < 1:
            raise ValueError(f"num_tenants must be >= 1, got {self.num_tenants}")
        for name in ("prefix_len_range", "suffix_len_range", "output_len_range"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(
                    f"{name} must be (min, max) with 0 <= min <= max, got {(low, high)}"
                )
        if self.suffix_len_range[0] < 1 or self.output_len_range[0] < 1:
            raise ValueError("suffix and output lengths must be >= 1 token")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")

    @property
    def max_request_tokens(self) -> int:
        return self.prefix_len_range[1] + self.suffix_len_range[1] + self.output_len_range[1]


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request: its workload fields, the engine-side state KVCacheManager reads, results.

    Token ids live in two pieces until the request arrives (`materialize`), and are dropped
    when it finishes, so a run holds only the in-flight requests' sequences.

    Args:
        req_idx: index in arrival order.
        arrival_s: arrival time (simulated seconds).
        tenant: tenant index.
        prefix_token_ids: the tenant's prefix (shared with its other requests, not copied).
        own_token_ids: the suffix, then the outputs.
        prompt_len: prompt tokens (prefix + suffix).
        output_len: tokens to generate.
    """

    req_idx: int
    arrival_s: float
    tenant: int
    prefix_token_ids: np.ndarray
    own_token_ids: np.ndarray
    prompt_len: int
    output_len: int
    # Engine-side state, under the names KVCacheManager and the block hasher read.
    req_id: str = ""
    token_ids: np.ndarray | None = None  # prompt + outputs, from `materialize`
    num_tokens: int = 0
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    extra_keys: bytes | None = None  # no cache salt
    skip_reading_prefix_cache: bool = False  # no prompt logprobs
    mm_inputs: list = field(default_factory=list)  # text only: no image spans in the hashes
    num_output: int = 0
    # Results.
    engine_idx: int = -1
    num_cached_tokens: int = -1  # prefix-cache hit at first admission
    first_token_s: float = -1.0
    finish_s: float = -1.0

    def __post_init__(self) -> None:
        self.req_id = str(self.req_idx)
        self.num_tokens = self.prompt_len

    @property
    def num_prefix_tokens(self) -> int:
        return len(self.prefix_token_ids)

    def materialize(self) -> None:
        """Build the whole token sequence (on arrival)."""
        self.token_ids = np.concatenate((self.prefix_token_ids, self.own_token_ids))

    def release(self) -> None:
        """Drop the sequence and its hashes (on finish): only the results stay."""
        self.token_ids = None
        self.block_hashes = []

    @property
    def prompt_token_ids(self) -> np.ndarray:
        return self.token_ids[: self.prompt_len]

    @property
    def all_token_ids(self) -> np.ndarray:
        """The tokens known so far (prompt and outputs sampled), as kvserve's Request has."""
        return self.token_ids[: self.num_tokens]


def make_tenant_prefixes(config: WorkloadConfig, seed: int) -> list[np.ndarray]:
    """Each tenant's prefix token ids (the same for every run with this seed)."""
    rng = np.random.default_rng([seed, 1])
    low, high = config.prefix_len_range
    prefix_lens = rng.integers(low, high + 1, size=config.num_tenants)
    return [
        rng.integers(0, config.vocab_size, size=int(n), dtype=_TOKEN_DTYPE) for n in prefix_lens
    ]


def make_requests(
    config: WorkloadConfig, num_requests: int, rate_per_s: float, seed: int, stream: int = 0
) -> list[SimRequest]:
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
    prefixes = make_tenant_prefixes(config, seed)
    rng = np.random.default_rng([seed, 2, stream])
    if np.isinf(rate_per_s):
        arrivals = np.zeros(num_requests)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / rate_per_s, size=num_requests))
    popularity = 1.0 / np.arange(1, config.num_tenants + 1) ** config.zipf_exponent
    tenants = rng.choice(config.num_tenants, size=num_requests, p=popularity / popularity.sum())
    suffix_lens = rng.integers(
        config.suffix_len_range[0], config.suffix_len_range[1] + 1, size=num_requests
    )
    output_lens = rng.integers(
        config.output_len_range[0], config.output_len_range[1] + 1, size=num_requests
    )
    own_lens = suffix_lens + output_lens
    # One draw for every request's own tokens, split below (views, no copies).
    own_tokens = rng.integers(0, config.vocab_size, size=int(own_lens.sum()), dtype=_TOKEN_DTYPE)
    starts = np.concatenate(([0], np.cumsum(own_lens)[:-1]))
    own_tokens[starts] = np.arange(num_requests) % config.vocab_size
    requests = []
    for req_idx in range(num_requests):
        tenant = int(tenants[req_idx])
        prefix = prefixes[tenant]
        start = int(starts[req_idx])
        requests.append(
            SimRequest(
                req_idx,
                float(arrivals[req_idx]),
                tenant,
                prefix,
                own_tokens[start : start + int(own_lens[req_idx])],
                len(prefix) + int(suffix_lens[req_idx]),
                int(output_lens[req_idx]),
            )
        )
    return requests


def ideal_cached_tokens(requests: list[SimRequest], block_size: int) -> list[int]:
    """Per request, the prefix-cache hit of one engine with unbounded KV: the tenant's
    full prefix blocks once any earlier request of the tenant has been seen (the last
    prompt token is always recomputed)."""
    seen: set[int] = set()
    cached = []
    for request in requests:
        num_shared_blocks = request.num_prefix_tokens // block_size
        max_blocks = (request.prompt_len - 1) // block_size
        cached.append(
            min(num_shared_blocks, max_blocks) * block_size if request.tenant in seen else 0
        )
        seen.add(request.tenant)
    return cached
