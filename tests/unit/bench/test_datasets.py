"""Benchmark workloads: prompt lengths, prefix sharing, ShareGPT parsing, arrival gaps."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from kvserve.benchmarks.datasets import prefix_requests, random_requests, sharegpt_requests
from kvserve.benchmarks.serve_runner import arrival_gaps


def num_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_random_prompts_tokenize_to_the_asked_length(tokenizer):
    requests = random_requests(tokenizer, num_prompts=6, input_len=48, output_len=7, seed=1)
    assert len(requests) == 6
    assert len({r.prompt for r in requests}) == 6
    for request in requests:
        assert request.prompt_len == 48
        assert num_tokens(tokenizer, request.prompt) == 48
        assert request.expected_output_len == 7


def test_random_range_ratio_spreads_lengths_within_bounds(tokenizer):
    requests = random_requests(
        tokenizer, num_prompts=30, input_len=40, output_len=20, range_ratio=0.5, seed=2
    )
    input_lens = [r.prompt_len for r in requests]
    output_lens = [r.expected_output_len for r in requests]
    assert all(20 <= n <= 60 for n in input_lens) and len(set(input_lens)) > 1
    assert all(10 <= n <= 30 for n in output_lens) and len(set(output_lens)) > 1
    for request in requests:
        assert num_tokens(tokenizer, request.prompt) == request.prompt_len


def test_random_same_seed_same_prompts(tokenizer):
    first = random_requests(tokenizer, 3, 16, 4, seed=7)
    assert first == random_requests(tokenizer, 3, 16, 4, seed=7)
    assert first != random_requests(tokenizer, 3, 16, 4, seed=8)


def test_random_rejects_bad_lengths(tokenizer):
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(tokenizer, 2, 16, 4, range_ratio=1.0)
    with pytest.raises(ValueError, match="input-len"):
        random_requests(tokenizer, 2, 0, 4)


def test_prefix_groups_share_their_prefix_tokens(tokenizer):
    prefix_len, suffix_len = 64, 8
    requests = prefix_requests(
        tokenizer,
        num_prompts=9,
        num_groups=3,
        prefix_len=prefix_len,
        suffix_len=suffix_len,
        output_len=5,
        seed=3,
    )
    assert len(requests) == 9
    assert all(r.expected_output_len == 5 for r in requests)
    # Group by the first prefix_len tokens: 3 groups of 3 requests each.
    groups = Counter(
        tuple(tokenizer.encode(r.prompt, add_special_tokens=False)[:prefix_len]) for r in requests
    )
    assert sorted(groups.values()) == [3, 3, 3]
    # Suffixes are unique, and each prompt is about prefix + separator + suffix long.
    assert len({r.prompt for r in requests}) == 9
    for request in requests:
        assert num_tokens(tokenizer, request.prompt) == request.prompt_len
        assert prefix_len + suffix_len <= request.prompt_len <= prefix_len + suffix_len + 2


def write_sharegpt(path, entries, jsonl: bool = True) -> None:
    with open(path, "w") as f:
        if jsonl:
            f.writelines(json.dumps(e) + "\n" for e in entries)
        else:
            json.dump(entries, f)


def conversation(question: str, answer: str) -> dict:
    return {
        "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
    }


@pytest.mark.parametrize("jsonl", [True, False])
def test_sharegpt_prompt_is_first_human_turn(tokenizer, tmp_path, jsonl):
    entries = [
        conversation(
            "What is the capital of France, in one word?", "The capital of France is Paris."
        ),
        conversation("Name three primary colors please.", "Red, yellow and blue."),
        {
            "conversations": [
                {"from": "gpt", "value": "I speak first, so I am skipped"},
                {"from": "human", "value": "and so is this reply"},
            ]
        },
        conversation("Hi", "Too short a prompt: skipped as vLLM does."),
    ]
    path = tmp_path / ("data.jsonl" if jsonl else "data.json")
    write_sharegpt(path, entries, jsonl)
    requests = sharegpt_requests(tokenizer, str(path), num_prompts=4, seed=0)
    assert len(requests) == 4  # two usable conversations, reused
    by_prompt = {r.prompt: r for r in requests}
    assert set(by_prompt) == {
        entries[0]["conversations"][0]["value"],
        entries[1]["conversations"][0]["value"],
    }
    for entry in entries[:2]:
        question, answer = (turn["value"] for turn in entry["conversations"])
        request = by_prompt[question]
        assert request.prompt_len == num_tokens(tokenizer, question)
        assert request.expected_output_len == num_tokens(tokenizer, answer)
    fixed = sharegpt_requests(tokenizer, str(path), num_prompts=2, output_len=9)
    assert [r.expected_output_len for r in fixed] == [9, 9]


def test_sharegpt_errors_are_actionable(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="--dataset-path"):
        sharegpt_requests(tokenizer, str(tmp_path / "missing.jsonl"), 2)
    path = tmp_path / "empty.jsonl"
    write_sharegpt(path, [{"conversations": []}])
    with pytest.raises(ValueError, match="no usable conversation"):
        sharegpt_requests(tokenizer, str(path), 2)


def test_arrival_gaps_poisson_mean_and_burstiness():
    assert arrival_gaps(5, float("inf"), 1.0, seed=0) == [0.0] * 5
    poisson = np.array(arrival_gaps(20_000, 4.0, 1.0, seed=0))
    bursty = np.array(arrival_gaps(20_000, 4.0, 0.25, seed=0))
    assert poisson.mean() == pytest.approx(0.25, rel=0.05)
    assert bursty.mean() == pytest.approx(0.25, rel=0.05)
    # Exponential gaps have CV 1; gamma with shape k has CV 1/sqrt(k) = 2 here.
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.1)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)
    with pytest.raises(ValueError, match="request-rate"):
        arrival_gaps(3, 0.0, 1.0, seed=0)
