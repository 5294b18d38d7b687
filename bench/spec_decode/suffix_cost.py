"""The suffix proposer's time per engine step at batch 32 (no model: the proposer alone).

32 requests with 1,000-token prompts (random tokens, a quarter of them repeating an earlier
stretch, as code edits do) decode 256 steps each; every step each request gets one new
token (drawn from its own earlier text half the time) and asks for up to 32 drafts, as
`SpecDecodeScheduler.on_output` asks. The tenants' output store is warmed with 200 finished
outputs. Prints the median and p90 µs per step (all 32 requests) and per request, and the
ngram proposer's (the worker's, k = 4, n 2..4) on the same texts for scale. CPU time of
this process (time.process_time), so a shared machine's other work does not count.

    .venv/bin/python bench/spec_decode/suffix_cost.py
"""

from __future__ import annotations

import random
import statistics
import time

import numpy as np

from kvserve.services.scheduler.core.request import Request
from kvserve.services.scheduler.core.suffix_proposer import SuffixProposer
from kvserve.services.worker.spec_decode.ngram import NgramProposer
from kvserve.shared.config import SpeculativeConfig
from kvserve.shared.sampling_params import SamplingParams

BATCH, PROMPT_LEN, STEPS, VOCAB = 32, 1000, 256, 49152


def text(rng: random.Random, length: int) -> list[int]:
    tokens = [rng.randrange(VOCAB) for _ in range(length)]
    for _ in range(length // 200):  # stretches copied from earlier in the text
        start = rng.randrange(length // 2)
        at = rng.randrange(start + 50, length - 50)
        tokens[at : at + 50] = tokens[start : start + 50]
    return tokens


def main() -> None:
    rng = random.Random(0)
    config = SpeculativeConfig(
        method="suffix", num_speculative_tokens=32, suffix_decoding_max_tree_depth=64
    )
    proposer = SuffixProposer(config)
    for i in range(200):
        done = Request(f"old{i}", [1, 2, 3], SamplingParams(), None)
        done.append_output_token_ids(text(rng, 300))
        proposer.free(done)
    requests = [
        Request(f"r{i}", text(rng, PROMPT_LEN), SamplingParams(), None) for i in range(BATCH)
    ]
    ngram = NgramProposer(2, 4)
    suffix_us, ngram_us = [], []
    for _ in range(STEPS):
        new = [
            r.all_token_ids[rng.randrange(r.num_tokens)]
            if rng.random() < 0.5
            else rng.randrange(VOCAB)
            for r in requests
        ]
        start = time.process_time()
        for request, token_id in zip(requests, new):
            proposer.propose(request, [token_id], 32)
        suffix_us.append((time.process_time() - start) * 1e6)
        for request, token_id in zip(requests, new):
            request.append_output_token_ids(token_id)
        arrays = [np.asarray(r.all_token_ids) for r in requests]
        start = time.process_time()
        ngram.propose(arrays, [4] * BATCH)
        ngram_us.append((time.process_time() - start) * 1e6)
    for name, times in (("suffix", suffix_us), ("ngram", ngram_us)):
        median = statistics.median(times)
        p90 = statistics.quantiles(times, n=10)[-1]
        print(
            f"{name}: median {median:.0f} µs/step, p90 {p90:.0f} µs/step at batch {BATCH} "
            f"({median / BATCH:.1f} µs per request)"
        )


if __name__ == "__main__":
    main()
