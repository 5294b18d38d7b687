"""The sort-based top-k / top-p filter kvserve's Sampler used before performance round two:
the oracle of tests/unit/worker/test_sampler_filters.py and the baseline of
bench/sampler_paths.py."""

from __future__ import annotations

import numpy as np
import torch

NEG_INF = float("-inf")


def reference_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus with -inf, from a full sort."""
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[1]
    sorted_logits = torch.from_numpy(np.sort(logits.numpy(), axis=-1))
    threshold_idx = torch.zeros(logits.shape[0], 1, dtype=torch.int64)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size).long()
        threshold_idx = (vocab_size - k).unsqueeze(1)
    if top_p is not None:
        if top_k is not None:
            kth_largest = sorted_logits.gather(1, threshold_idx)
            sorted_logits.masked_fill_(sorted_logits < kth_largest, NEG_INF)
        probs_cumsum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        mass_outside = (1.0 - top_p).to(probs_cumsum.dtype).unsqueeze(1)
        num_outside = torch.searchsorted(probs_cumsum, mass_outside, right=True)
        num_outside.clamp_(max=vocab_size - 1)
        threshold_idx = torch.maximum(threshold_idx, num_outside)
    thresholds = sorted_logits.gather(1, threshold_idx)
    return logits.masked_fill_(logits < thresholds, NEG_INF)
