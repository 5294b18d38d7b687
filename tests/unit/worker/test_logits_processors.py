"""Logits processors of the sampler: the grammar bitmask, allowed_token_ids, bad words and
logit_bias, each applied to the rows that use it and checked against a plain Python loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.services.worker.logits_processors import (
    LogitsProcessorBatch,
    LogitsProcessorState,
    apply_token_bitmask,
    forbidden_tokens_numpy,
    forbidden_tokens_torch,
)
from kvserve.services.worker.sampler import Sampler
from kvserve.services.worker.sampling_metadata import SamplingMetadata
from kvserve.shared.sampling_params import SamplingParams

VOCAB = 70  # not a multiple of 32: the last bitmask word is partly padding


def random_bitmask(rng, num_rows: int, num_words: int) -> np.ndarray:
    return rng.integers(-(2**31), 2**31, size=(num_rows, num_words), dtype=np.int64).astype(
        np.int32
    )


def reference_mask(logits, bitmask, rows):
    out = logits.clone()
    for bit_row, row in zip(bitmask, rows):
        for token in range(logits.shape[1]):
            word = token // 32
            allowed = word < len(bit_row) and (int(bit_row[word]) >> (token % 32)) & 1
            if not allowed:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize(
    "rows, num_words",
    [([0, 1, 2, 3], 3), ([2, 0], 3), ([1], 2)],  # all rows; some, out of order; a narrow mask
    ids=["all-rows", "some-rows", "narrow-bitmask"],
)
def test_bitmask_forbids_exactly_the_cleared_bits(rows, num_words):
    rng = np.random.default_rng(0)
    logits = torch.randn(4, VOCAB)
    bitmask = random_bitmask(rng, len(rows), num_words)
    expected = reference_mask(logits, bitmask, rows)
    apply_token_bitmask(logits, bitmask, np.asarray(rows))
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("vocab_size", [VOCAB, 64, 100])  # padded, exact, wider than the mask
def test_the_gpu_unpacking_agrees_with_the_cpu_one(vocab_size):
    # The torch path runs on CUDA in production; here it is checked on CPU tensors.
    bitmask = random_bitmask(np.random.default_rng(1), 5, 3)
    expected = forbidden_tokens_numpy(bitmask, vocab_size)
    assert torch.equal(forbidden_tokens_torch(torch.from_numpy(bitmask), vocab_size), expected)


def processor_batch(params_per_row: dict[int, SamplingParams], outputs: dict[int, list[int]]):
    states = [
        (row, LogitsProcessorState.of(params, VOCAB), outputs.get(row, []))
        for row, params in params_per_row.items()
    ]
    return LogitsProcessorBatch.gather([s for s in states if s[1] is not None])


def test_allowed_token_ids_bad_words_and_logit_bias():
    logits = torch.zeros(3, VOCAB)
    batch = processor_batch(
        {
            0: SamplingParams(allowed_token_ids=[3, 5, 999]),  # 999 is past the vocabulary
            1: SamplingParams(bad_words=["x"], bad_words_token_ids=[[7], [8, 9], [10, 11]]),
            2: SamplingParams(logit_bias={4: 2.5, 6: -100.0, 5000: 1.0}),
        },
        outputs={1: [1, 8]},
    )
    batch.apply(logits)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [3, 5]
    # [7] is always banned; 9 only after 8 (the output ends with 8); 11 not (no 10 before).
    assert torch.isinf(logits[1]).nonzero().flatten().tolist() == [7, 9]
    assert (logits[2, 4], logits[2, 6], logits[2, 5]) == (2.5, -100.0, 0.0)


def test_requests_without_processors_have_no_state():
    assert LogitsProcessorState.of(SamplingParams(), VOCAB) is None
    assert LogitsProcessorState.of(SamplingParams(bad_words=["x"]), VOCAB) is None  # untokenized


def test_sampler_samples_only_what_the_grammar_allows():
    logits = torch.randn(2, VOCAB)
    bitmask = np.zeros((1, 3), dtype=np.int32)
    bitmask[0, 1] = 1 << 3  # token 35 only
    metadata = SamplingMetadata(
        temperature=None,
        all_greedy=True,
        all_random=False,
        max_num_logprobs=0,
        grammar_bitmask=bitmask,
        grammar_rows=np.array([1]),
    )
    out = Sampler()(logits.clone(), metadata)
    assert out.sampled_token_ids.tolist() == [int(logits[0].argmax()), 35]
    # Logprobs are those of the masked distribution (vLLM's): the one allowed token is certain.
    assert out.logprobs.logprobs[1, 0] == 0.0
