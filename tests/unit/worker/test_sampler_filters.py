"""Property tests: the topk-based top-k / top-p / min-p filters keep the same tokens as the
sort-based filters they replaced (reference copy below), and greedy rows stay argmax."""

from __future__ import annotations

from unittest import mock

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.services.worker import sampler as sampler_module
from kvserve.services.worker.sampler import Sampler, apply_top_k_top_p
from kvserve.services.worker.sampling_metadata import SamplingMetadata
from tests.support.sampling import NEG_INF, reference_top_k_top_p

# A nucleus boundary this close to 1 - p is float rounding: both answers are right.
BOUNDARY_TOLERANCE = 1e-6


def reference_probs(logits: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    probs = reference_top_k_top_p(logits.clone(), top_k, top_p).softmax(dim=-1)
    if min_p is not None:
        probs.masked_fill_(probs < min_p.unsqueeze(1) * probs.amax(-1, keepdim=True), 0.0)
    return probs


def near_nucleus_boundary(logits: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """[R] bool: some cumulative mass of the reference lies within tolerance of 1 - p."""
    if top_p is None:
        return torch.zeros(logits.shape[0], dtype=torch.bool)
    vocab_size = logits.shape[1]
    sorted_logits = logits.double().sort(dim=-1).values
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size).long()
        kth_largest = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth_largest, NEG_INF)
    cumsum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    distance = (cumsum - (1.0 - top_p.double()).unsqueeze(1)).abs()
    return (distance < BOUNDARY_TOLERANCE).any(dim=-1) & (top_p < 1.0)


@st.composite
def filter_cases(draw):
    """Logits (flat, peaked or heavily tied, some -inf) with per-row k / p / min_p."""
    num_rows = draw(st.integers(1, 6))
    vocab_size = draw(st.sampled_from([1, 2, 7, 64, 300, 1000]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["flat", "peaked", "ties"]))
    if kind == "ties":
        # Few distinct values: thresholds land inside groups of equal logits.
        logits = torch.randint(-3, 4, (num_rows, vocab_size), generator=gen).float()
        logits *= draw(st.sampled_from([0.25, 1.0, 4.0]))
    else:
        scale = 0.5 if kind == "flat" else draw(st.sampled_from([2.0, 5.0, 8.0]))
        logits = (torch.randn(num_rows, vocab_size, generator=gen) * scale).clamp(-40, 40)
    if draw(st.booleans()):
        masked = torch.rand(num_rows, vocab_size, generator=gen) < 0.3
        masked[:, 0] = False  # every row keeps a finite logit
        logits.masked_fill_(masked, NEG_INF)

    def per_row(values):
        return draw(st.lists(values, min_size=num_rows, max_size=num_rows))

    top_k = top_p = min_p = None
    if draw(st.booleans()):
        ks = st.one_of(st.just(0), st.integers(1, 3), st.integers(1, vocab_size + 2))
        top_k = torch.tensor(per_row(ks), dtype=torch.int64)
    if draw(st.booleans()):
        ps = st.one_of(
            st.just(1.0), st.sampled_from([0.5, 0.9, 0.95]), st.floats(0.0, 1.0, width=32)
        )
        top_p = torch.tensor(per_row(ps), dtype=torch.float32)
    if draw(st.booleans()):
        min_p = torch.tensor(per_row(st.floats(0.0, 0.5, width=32)), dtype=torch.float32)
    num_candidates = draw(st.sampled_from([1, 4, 32, 256]))
    return logits, top_k, top_p, min_p, num_candidates


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(filter_cases())
def test_filters_keep_the_tokens_of_the_sorted_reference(case):
    logits, top_k, top_p, min_p, num_candidates = case
    expected = ~torch.isinf(reference_top_k_top_p(logits.clone(), top_k, top_p))
    # Few candidates make the sort fallback run on small vocabularies too.
    with mock.patch.object(sampler_module, "_NUM_TOP_P_CANDIDATES", num_candidates):
        filtered = apply_top_k_top_p(logits.clone(), top_k, top_p)
    kept = ~torch.isinf(filtered)
    # Exact equality, except where the reference's own float rounding decides the boundary.
    exact_rows = ~near_nucleus_boundary(logits, top_k, top_p)
    assert torch.equal(kept[exact_rows], expected[exact_rows])
    # Kept logits are untouched.
    assert torch.equal(filtered[kept], logits[kept])

    metadata = SamplingMetadata(
        temperature=torch.ones(logits.shape[0]),
        all_greedy=False,
        all_random=True,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
    )
    with mock.patch.object(sampler_module, "_NUM_TOP_P_CANDIDATES", num_candidates):
        probs = Sampler._random_probs(logits.clone(), metadata)
    expected_probs = reference_probs(logits, top_k, top_p, min_p)
    assert torch.equal((probs > 0)[exact_rows], (expected_probs > 0)[exact_rows])


def test_top_p_rounding_boundary_is_rare():
    # The tolerance above excuses float rounding, not a different algorithm.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 5000, generator=gen) * 3
    top_p = torch.rand(64, generator=gen)
    exact_rows = ~near_nucleus_boundary(logits, None, top_p)
    assert int(exact_rows.sum()) >= 60
    expected = ~torch.isinf(reference_top_k_top_p(logits.clone(), None, top_p))
    kept = ~torch.isinf(apply_top_k_top_p(logits.clone(), None, top_p))
    assert torch.equal(kept[exact_rows], expected[exact_rows])


def test_flat_rows_fall_back_to_the_sort():
    # randn logits over 5,000 tokens: 256 candidates hold far less than p = 0.9.
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(1))
    top_p = torch.tensor([0.9, 0.2, 1.0])
    with mock.patch.object(
        sampler_module, "_sorted_thresholds", wraps=sampler_module._sorted_thresholds
    ) as sorted_thresholds:
        kept = ~torch.isinf(apply_top_k_top_p(logits.clone(), None, top_p))
    assert sorted_thresholds.call_args.args[0].shape == (1, 5000)  # the p = 0.9 row only
    expected = ~torch.isinf(reference_top_k_top_p(logits.clone(), None, top_p))
    assert torch.equal(kept, expected)
    assert bool(kept[2].all())


@settings(max_examples=60, deadline=None)
@given(filter_cases(), st.lists(st.booleans(), min_size=6, max_size=6), st.integers(0, 2**16))
def test_mixed_batch_greedy_rows_argmax_random_rows_stay_in_filter(case, greedy, seed):
    logits, top_k, top_p, min_p, _ = case
    num_rows = logits.shape[0]
    temps = [0.0 if greedy[row] else 0.8 for row in range(num_rows)]
    metadata = SamplingMetadata(
        temperature=torch.tensor(temps),
        all_greedy=all(t == 0.0 for t in temps),
        all_random=all(t > 0.0 for t in temps),
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        generators={0: torch.Generator().manual_seed(seed)},
    )
    torch.manual_seed(seed)
    sampled = Sampler()(logits.clone(), metadata).sampled_token_ids
    expected_probs = reference_probs(logits / 0.8, top_k, top_p, min_p)
    exact_rows = ~near_nucleus_boundary(logits / 0.8, top_k, top_p)
    for row, token in enumerate(sampled.tolist()):
        if greedy[row]:
            assert token == int(logits[row].argmax())
        elif exact_rows[row]:
            assert expected_probs[row, token] > 0


def test_seeded_row_draws_the_same_alone_and_among_greedy_rows():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(2))

    def draw(temps: list[float], row: int) -> int:
        metadata = SamplingMetadata(
            temperature=torch.tensor(temps),
            all_greedy=False,
            all_random=all(t > 0 for t in temps),
            top_p=torch.full((len(temps),), 0.9),
            generators={row: torch.Generator().manual_seed(5)},
        )
        return int(Sampler()(logits[4 - len(temps) :].clone(), metadata).sampled_token_ids[row])

    assert draw([0.0, 1.0, 0.0, 1.0], 3) == draw([1.0], 0)
