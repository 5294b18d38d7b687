"""The Sampler's top-k / top-p paths: the sort-based filter of before vs the topk-based one.

For each row count and sampling mode, times the whole Sampler forward on [R, 49152] float32
logits, old and new interleaved in one process, and prints the median ms per call. "old"
is today's Sampler with the sort-based filter (copied below) and the draw on every row of
a mixed batch; "new" is services/worker/sampler.py.

Logits: `--logits zipf` (default) gives rows whose probabilities fall as rank^-s, s drawn
in [1.1, 2.0], a stand-in for next-token distributions; `--logits randn` gives flat rows
that make top-p fall back to the sort; `--model HF_FOLDER` takes the real next-token logits
of every position of a paragraph of text instead.

    .venv/bin/python bench/sampler_paths.py [--rows 1 8 32 128] [--calls 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from unittest import mock

import torch

if __package__ in (None, ""):  # run as a script: the repository root on sys.path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve.services.worker import sampler as sampler_module  # noqa: E402
from kvserve.services.worker.sampler import Sampler, inverse_cdf_sample  # noqa: E402
from kvserve.services.worker.sampling_metadata import SamplingMetadata  # noqa: E402
from tests.support.sampling import reference_top_k_top_p  # noqa: E402

VOCAB_SIZE = 49152
MODES = {
    # name: (top_k, top_p, fraction of greedy rows)
    "temperature": (None, None, 0.0),
    "top_k=50": (50, None, 0.0),
    "top_p=0.9": (None, 0.9, 0.0),
    "top_k=50+top_p=0.9": (50, 0.9, 0.0),
    "half greedy, top_p=0.9": (None, 0.9, 0.5),
}
TEXT = (
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion about the costs of the new library, the members agreed to delay the vote "
    "until the city had published its own estimates. Several residents spoke in favour of "
    "the project, pointing out that the old building had been closed since the flood. "
)


class OldSampler(Sampler):
    """The Sampler before: sort-based filter, and a mixed batch draws on every row."""

    def sample(self, logits, metadata):
        greedy_token_ids = None
        if not metadata.all_random:
            greedy_token_ids = logits.argmax(dim=-1)
            if metadata.all_greedy:
                return greedy_token_ids
        with mock.patch.object(sampler_module, "apply_top_k_top_p", reference_top_k_top_p):
            probs = self._random_probs(logits, metadata)
        random_token_ids = inverse_cdf_sample(probs, metadata.generators)
        if greedy_token_ids is None:
            return random_token_ids
        return torch.where(metadata.temperature < 1e-5, greedy_token_ids, random_token_ids)


def make_logits(kind: str, num_rows: int, model: str | None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if model is not None:
        # Evenly spread positions, past the first (which has no context).
        logits = real_logits(model)
        return logits[1 + torch.arange(num_rows) * (logits.shape[0] - 1) // num_rows]
    if kind == "randn":
        return torch.randn(num_rows, VOCAB_SIZE, generator=gen) * 2
    exponent = 1.1 + 0.9 * torch.rand(num_rows, 1, generator=gen)
    ranks = torch.arange(1, VOCAB_SIZE + 1, dtype=torch.float32)
    logits = -exponent * ranks.log() + 0.05 * torch.randn(num_rows, VOCAB_SIZE, generator=gen)
    return logits[:, torch.randperm(VOCAB_SIZE, generator=gen)].contiguous()


_REAL_LOGITS: dict[str, torch.Tensor] = {}


def real_logits(model: str) -> torch.Tensor:
    if model not in _REAL_LOGITS:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        input_ids = tokenizer(TEXT * 4, return_tensors="pt").input_ids[:, :256]
        with torch.no_grad():
            _REAL_LOGITS[model] = hf_model(input_ids).logits[0].float()
    return _REAL_LOGITS[model]


def metadata_for(mode: str, num_rows: int) -> SamplingMetadata:
    top_k, top_p, greedy_fraction = MODES[mode]
    temperature = torch.full((num_rows,), 1.0)
    num_greedy = int(num_rows * greedy_fraction)
    temperature[:num_greedy] = 0.0
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=False,
        all_random=num_greedy == 0,
        top_k=None if top_k is None else torch.full((num_rows,), top_k, dtype=torch.int64),
        top_p=None if top_p is None else torch.full((num_rows,), top_p),
    )


def num_flat_rows(logits: torch.Tensor, top_p: float | None) -> int:
    """Rows whose nucleus is larger than the top-p candidates: the sort fallback's share."""
    if top_p is None:
        return 0
    cumsum = logits.softmax(dim=-1).sort(dim=-1, descending=True).values.cumsum(dim=-1)
    nucleus_size = (cumsum < top_p).sum(dim=-1) + 1
    return int((nucleus_size > sampler_module._NUM_TOP_P_CANDIDATES).sum())


def time_call(sampler: Sampler, logits: torch.Tensor, metadata: SamplingMetadata) -> float:
    fresh = logits.clone()  # the Sampler consumes its logits
    start = time.perf_counter()
    sampler(fresh, metadata)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--logits", choices=["zipf", "randn"], default="zipf")
    parser.add_argument("--model", default=None, help="HF folder: use its real logits")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    source = args.model or args.logits
    print(f"logits: {source}, vocab {VOCAB_SIZE}, {args.threads} threads, median of {args.calls}")
    print(
        f"{'mode':<24}{'rows':>6}{'old ms':>10}{'new ms':>10}{'speed-up':>10}"
        f"{'old min':>10}{'new min':>10}{'sorted rows':>13}"
    )
    old, new = OldSampler(), Sampler()
    for mode in MODES:
        for num_rows in args.rows:
            logits = make_logits(args.logits, num_rows, args.model)
            metadata = metadata_for(mode, logits.shape[0])
            for sampler in (old, new):  # warm-up
                time_call(sampler, logits, metadata)
            old_ms, new_ms = [], []
            for _ in range(args.calls):  # interleaved, so load drifts hit both alike
                old_ms.append(time_call(old, logits, metadata))
                new_ms.append(time_call(new, logits, metadata))
            old_median, new_median = statistics.median(old_ms), statistics.median(new_ms)
            top_p = MODES[mode][1] if MODES[mode][0] is None else None
            print(
                f"{mode:<24}{logits.shape[0]:>6}{old_median:>10.2f}{new_median:>10.2f}"
                f"{old_median / new_median:>9.1f}x{min(old_ms):>10.2f}{min(new_ms):>10.2f}"
                f"{num_flat_rows(logits, top_p):>13}"
            )


if __name__ == "__main__":
    main()
