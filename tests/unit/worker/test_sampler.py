"""Sampler tests on small vocabularies: each checks one stage against a direct computation."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.services.worker.sampler import (
    Sampler,
    _pad_token_ids,
    apply_penalties,
    apply_top_k_top_p,
    compute_topk_logprobs,
)
from kvserve.services.worker.sampling_metadata import SamplingMetadata

NEG_INF = float("-inf")


def make_metadata(
    num_reqs: int, temperature: float | list[float] = 0.0, **overrides
) -> SamplingMetadata:
    """Metadata for num_reqs rows; temperature 0 = greedy, as the model runner would build it."""
    temps = temperature if isinstance(temperature, list) else [temperature] * num_reqs
    assert len(temps) == num_reqs
    temperature_t = torch.tensor(temps, dtype=torch.float32)
    all_greedy = all(t == 0.0 for t in temps)
    fields = dict(
        temperature=None if all_greedy else temperature_t,
        all_greedy=all_greedy,
        all_random=all(t > 0.0 for t in temps),
        output_token_ids=[[] for _ in range(num_reqs)],
    )
    fields.update(overrides)
    return SamplingMetadata(**fields)


def sample(logits: torch.Tensor, metadata: SamplingMetadata):
    # The Sampler consumes its input, so tests keep their logits intact.
    return Sampler()(logits.clone(), metadata)


def probs_to_logits(probs: list[float], num_rows: int) -> torch.Tensor:
    return torch.tensor(probs).log().repeat(num_rows, 1)


def test_greedy_is_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    out = sample(logits, make_metadata(6))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None


def test_top_k_1_equals_greedy():
    logits = torch.randn(8, 200, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    for _ in range(5):
        out = sample(
            logits, make_metadata(8, temperature=1.5, top_k=torch.ones(8, dtype=torch.int64))
        )
        assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_mixed_batch_greedy_rows_take_argmax():
    # Flat logits: a random row would hit the argmax only ~1/500 of the time.
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(2)) * 0.01
    temps = [0.0, 1.0, 0.0, 1.0]
    torch.manual_seed(0)
    random_hits = 0
    for _ in range(10):
        sampled = sample(logits, make_metadata(4, temperature=temps)).sampled_token_ids
        argmax = logits.argmax(dim=-1)
        assert sampled[0] == argmax[0] and sampled[2] == argmax[2]
        random_hits += int(sampled[1] == argmax[1]) + int(sampled[3] == argmax[3])
    assert random_hits < 5


def test_seeded_row_is_independent_of_batch():
    vocab_size, seeded_row, num_steps = 300, 3, 6
    step_logits = [
        torch.randn(8, vocab_size, generator=torch.Generator().manual_seed(s))
        for s in range(num_steps)
    ]

    def run(batched: bool, seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)  # seeded once, reused each step
        tokens = []
        for logits in step_logits:
            if batched:
                # Other rows: unseeded, different temperatures and filters.
                metadata = make_metadata(
                    8,
                    temperature=[0.7, 1.3, 0.0, 1.0, 0.5, 2.0, 1.0, 0.9],
                    top_k=torch.tensor([5, 0, 0, 0, 50, 0, 3, 0]),
                    top_p=torch.tensor([1.0, 0.8, 1.0, 1.0, 0.9, 1.0, 1.0, 0.5]),
                    generators={seeded_row: generator},
                )
                tokens.append(int(sample(logits, metadata).sampled_token_ids[seeded_row]))
            else:
                metadata = make_metadata(1, temperature=1.0, generators={0: generator})
                tokens.append(
                    int(sample(logits[seeded_row : seeded_row + 1], metadata).sampled_token_ids[0])
                )
        return tokens

    torch.manual_seed(123)
    alone = run(batched=False, seed=42)
    torch.manual_seed(456)  # a different global state must not matter
    assert run(batched=True, seed=42) == alone
    assert run(batched=True, seed=7) != alone  # the seed, not luck, fixes the tokens


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_sampling_matches_softmax():
    base_logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    num_rows, temperature = 4000, 0.7
    torch.manual_seed(0)
    sampled = sample(
        base_logits.repeat(num_rows, 1), make_metadata(num_rows, temperature=temperature)
    ).sampled_token_ids
    counts = torch.bincount(sampled, minlength=8).float()
    # 7 degrees of freedom: 24.3 is the 0.999 quantile.
    assert chi_square(counts, (base_logits / temperature).softmax(-1)) < 24.3
    # The same statistic rejects the untempered distribution, so the check has teeth.
    assert chi_square(counts, base_logits.softmax(-1)) > 100


def test_top_p_keeps_the_smallest_nucleus():
    logits = probs_to_logits([0.05, 0.5, 0.15, 0.3], num_rows=2)
    filtered = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.7, 0.85]))
    # 0.5 < 0.7 needs the 0.3 token too; 0.8 < 0.85 also needs the 0.15 token.
    assert torch.isinf(filtered[0]).tolist() == [True, False, True, False]
    assert torch.isinf(filtered[1]).tolist() == [True, False, False, False]
    torch.manual_seed(0)
    sampled = sample(
        probs_to_logits([0.05, 0.5, 0.15, 0.3], num_rows=2000),
        make_metadata(2000, temperature=1.0, top_p=torch.full((2000,), 0.7)),
    )
    assert set(sampled.sampled_token_ids.tolist()) == {1, 3}


def test_top_k_and_top_p_combine():
    logits = probs_to_logits([0.4, 0.3, 0.2, 0.1], num_rows=3)
    filtered = apply_top_k_top_p(
        logits.clone(), torch.tensor([2, 0, 3]), torch.tensor([1.0, 0.6, 0.5])
    )
    assert torch.isinf(filtered[0]).tolist() == [False, False, True, True]
    assert torch.isinf(filtered[1]).tolist() == [False, False, True, True]
    # Top-3 renormalizes to 4/9, 3/9, 2/9: p = 0.5 needs the first two.
    assert torch.isinf(filtered[2]).tolist() == [False, False, True, True]
    assert torch.equal(filtered[~torch.isinf(filtered)], logits[~torch.isinf(filtered)])


def test_min_p_excludes_tokens_below_the_scaled_max():
    logits = probs_to_logits([0.5, 0.3, 0.15, 0.05], num_rows=2000)
    torch.manual_seed(0)
    sampled = sample(logits, make_metadata(2000, temperature=1.0, min_p=torch.full((2000,), 0.2)))
    # Threshold 0.2 * 0.5 = 0.1 drops only the 0.05 token.
    assert set(sampled.sampled_token_ids.tolist()) == {0, 1, 2}


def penalty_metadata(num_reqs: int, **penalties) -> SamplingMetadata:
    fields = dict(
        no_penalties=False,
        presence_penalties=torch.zeros(num_reqs),
        frequency_penalties=torch.zeros(num_reqs),
        repetition_penalties=torch.ones(num_reqs),
    )
    fields.update(penalties)
    return make_metadata(num_reqs, **fields)


def test_repetition_penalty_hits_prompt_and_output_tokens_only():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 3.0, 0.5]] * 2)
    vocab_size = logits.shape[1]
    metadata = penalty_metadata(
        2,
        repetition_penalties=torch.tensor([2.0, 1.0]),
        prompt_token_ids=torch.tensor([[0, 1], [0, vocab_size]]),  # padded with vocab_size
        output_token_ids=[[3, 3], [4]],
    )
    penalized = logits.clone()
    apply_penalties(penalized, metadata)
    expected = torch.tensor([1.0, -4.0, 1.0, -2.0, 3.0, 0.5])
    assert torch.allclose(penalized[0], expected)
    assert torch.equal(penalized[1], logits[1])  # penalty 1 is neutral


def test_frequency_penalty_scales_with_output_count():
    logits = torch.zeros(2, 5)
    metadata = penalty_metadata(
        2,
        frequency_penalties=torch.tensor([0.5, 0.0]),
        prompt_token_ids=torch.tensor([[4], [4]]),
        output_token_ids=[[2, 2, 2, 1], [2]],
    )
    apply_penalties(logits, metadata)
    assert torch.allclose(logits[0], torch.tensor([0.0, -0.5, -1.5, 0.0, 0.0]))
    assert torch.equal(logits[1], torch.zeros(5))


def test_presence_penalty_counts_each_output_token_once():
    logits = torch.zeros(1, 5)
    metadata = penalty_metadata(
        1,
        presence_penalties=torch.tensor([0.5]),
        prompt_token_ids=torch.tensor([[4]]),
        output_token_ids=[[2, 2, 2, 1]],
    )
    apply_penalties(logits, metadata)
    assert torch.allclose(logits[0], torch.tensor([0.0, -0.5, -0.5, 0.0, 0.0]))


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    metadata = penalty_metadata(1, presence_penalties=torch.tensor([0.2]), output_token_ids=[[0]])
    assert sample(logits, metadata).sampled_token_ids.tolist() == [1]


def test_min_tokens_forbids_listed_ids():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]] * 2)
    metadata = make_metadata(2, min_tokens={0: (3, {1, 2})})
    assert sample(logits, metadata).sampled_token_ids.tolist() == [3, 1]


def reference_ranks(logprobs: torch.Tensor, token_ids: torch.Tensor) -> list[int]:
    return [
        1 + sum(1 for value in row.tolist() if value > row[token].item())
        for row, token in zip(logprobs, token_ids.tolist())
    ]


def test_logprobs_are_raw_with_correct_ranks():
    num_reqs, vocab_size, k = 16, 40, 5
    logits = torch.randn(num_reqs, vocab_size, generator=torch.Generator().manual_seed(3))
    # Penalties and temperature must not leak into the logprobs.
    metadata = penalty_metadata(
        num_reqs,
        temperature=2.0,
        max_num_logprobs=k,
        presence_penalties=torch.full((num_reqs,), 1.5),
        output_token_ids=[[0, 1, 2]] * num_reqs,
    )
    torch.manual_seed(0)
    out = sample(logits, metadata)
    sampled = out.sampled_token_ids
    raw = logits.log_softmax(dim=-1)
    lp = out.logprobs
    assert lp.token_ids.shape == lp.logprobs.shape == (num_reqs, 1 + k)
    assert torch.equal(lp.token_ids[:, 0], sampled)
    assert torch.allclose(lp.logprobs[:, 0], raw.gather(1, sampled.unsqueeze(1)).squeeze(1))
    top = raw.topk(k, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    assert torch.allclose(lp.logprobs[:, 1:], top.values)
    assert lp.ranks.tolist() == reference_ranks(raw, sampled)
    assert (lp.ranks > 1).any(), "temperature 2 should sample some non-argmax tokens"


def test_compute_topk_logprobs_for_given_tokens():
    logprobs = torch.tensor([[-0.5, -1.0, -3.0], [-2.0, -0.2, -2.5]])
    out = compute_topk_logprobs(logprobs, torch.tensor([2, 0]), k=0)
    assert out.token_ids.tolist() == [[2], [0]]
    assert out.logprobs.tolist() == [[-3.0], [-2.0]]
    assert out.ranks.tolist() == [3, 2]


@pytest.mark.parametrize("top_p", [0.3, 0.9])
def test_top_p_matches_sorted_reference(top_p: float):
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(4)) * 2
    filtered = apply_top_k_top_p(logits.clone(), None, torch.full((5,), top_p))
    for row, kept in zip(logits, ~torch.isinf(filtered)):
        probs = sorted(row.softmax(-1).tolist(), reverse=True)
        # The nucleus: the fewest top tokens whose mass reaches top_p.
        num_needed = next(i + 1 for i in range(len(probs)) if math.fsum(probs[: i + 1]) >= top_p)
        assert int(kept.sum()) == num_needed
        assert kept[row.argmax()]


def test_pad_token_ids_packs_ragged_rows():
    padded = _pad_token_ids([[3, 1], [], [2, 2, 0]], vocab_size=9)
    assert padded.tolist() == [[3, 1, 9], [9, 9, 9], [2, 2, 0]]
    assert _pad_token_ids([[], []], vocab_size=9).shape == (2, 0)
