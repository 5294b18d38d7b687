"""The rejection sampler: keeps the draft tokens the target model agrees with, plus one more.

The model runner verifies each request's k draft tokens in one target step over k + 1
positions, so request b owns k_b + 1 consecutive rows of the target's output:

    num_draft_tokens = [3, 0, 2]
    target rows:  | d0 d1 d2 bonus | bonus | d0 d1 bonus |
                    0  1  2  3       4       5  6  7
    draft rows:   | 0  1  2        |       | 3  4        |

Row j of a request is the target's distribution at the position of draft j; its last row
follows all k drafts (the bonus position). Each request emits its longest accepted draft
prefix and then one target token, so between 1 and k + 1 tokens:

    greedy:  draft j is accepted while it equals the target's argmax of row j; the first
             mismatching row (or the bonus row) emits its argmax.
    random:  speculative sampling (Leviathan et al. 2023; Chen et al. 2023): draft x_j is
             accepted with probability min(1, p(x_j) / q(x_j)); the first rejected row emits
             a draw from norm(max(0, p - q)), the bonus row a draw from p. The emitted tokens
             are then distributed exactly as tokens sampled from the target one at a time.

All rows are verified at once, and the final draw is one inverse-CDF draw per request; the
only Python loop runs over the seeded requests, which draw their uniforms from their own
generators.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kvserve.services.worker.sampler import Sampler, compute_topk_logprobs, inverse_cdf_sample
from kvserve.services.worker.sampling_metadata import LogprobsTensors, SamplingMetadata

# Pads each request's output row past its emitted tokens.
PLACEHOLDER_TOKEN_ID = -1

# Divisor floor for normalising: an all-zero row stays all zero instead of becoming NaN.
_TINY = torch.finfo(torch.float32).tiny


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    target_argmax: torch.Tensor,
    target_probs: torch.Tensor | None,
    is_greedy: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generators: dict[int, torch.Generator],
) -> torch.Tensor:
    """Verifies a batch of draft tokens and returns the tokens each request emits.

    Seeded requests: request b draws from its own generator first k_b uniforms (one per
    draft, in order) for acceptance, then one uniform for the final inverse-CDF draw. That is
    k_b + 1 draws per call, whatever is accepted, so its output depends only on its seed and
    its own rows. Unseeded requests share one batched draw of each kind.

    Args:
        draft_token_ids: [N] int64, all requests' drafts concatenated, request 0's first.
        num_draft_tokens: [B] the number of drafts of each request (0 allowed).
        target_argmax: [N + B] int64, the argmax of the processed target logits per row.
        target_probs: [N + B, V] float32 target probabilities after temperature and the
            top-k / top-p / min-p filters; rows need not sum to 1. None when every request
            is greedy.
        is_greedy: [B] bool.
        draft_probs: [N, V] float32, q: the distribution each draft was drawn from (rows are
            normalised here too). None for deterministic drafts (q one-hot at the draft).
        generators: request index -> that request's generator, for seeded requests.
    Returns [B, max(num_draft_tokens) + 1] int64: row b holds request b's accepted drafts and
    then its target token, padded with PLACEHOLDER_TOKEN_ID.
    """
    num_drafts = draft_token_ids.shape[0]
    assert sum(num_draft_tokens) == num_drafts, "num_draft_tokens must add up to N"
    assert target_argmax.shape[0] == num_drafts + len(num_draft_tokens), "k + 1 rows a request"
    device = target_argmax.device
    rows = _RowIndices.build(num_draft_tokens, device)
    draft_idx, target_idx, is_draft = rows.draft_idx, rows.target_idx, rows.is_draft
    max_num_drafts = draft_idx.shape[1]

    draft_padded = draft_token_ids[draft_idx]
    accepted = is_draft & (draft_padded == target_argmax[target_idx[:, :max_num_drafts]])
    if target_probs is not None:
        uniforms = _acceptance_uniforms(num_draft_tokens, rows.draft_starts_np, generators, device)
        random_accepted = _accept_drafts(
            draft_token_ids, rows.draft_target_rows, target_probs, draft_probs, uniforms
        )
        accepted = torch.where(
            is_greedy.unsqueeze(1), accepted, is_draft & random_accepted[draft_idx]
        )
    # A draft counts only when every earlier draft of its request was accepted too.
    num_accepted_t = accepted.long().cumprod(dim=1).sum(dim=1)

    final_rows = target_idx.gather(1, num_accepted_t.unsqueeze(1)).squeeze(1)
    final_token_ids = target_argmax[final_rows]
    if target_probs is not None:
        is_rejected = num_accepted_t < rows.num_draft_tokens
        final_draft_rows = (rows.draft_starts + num_accepted_t).clamp_(max=max(num_drafts - 1, 0))
        final_probs = _final_probs(
            target_probs[final_rows], draft_token_ids, draft_probs, final_draft_rows, is_rejected
        )
        sampled = inverse_cdf_sample(final_probs, generators)
        # An all-zero target row (the filters always keep a token, so only on bad input)
        # has nothing to draw from: it falls back to the argmax like a greedy row.
        sampled = torch.where(final_probs.sum(dim=-1) > 0, sampled, final_token_ids)
        final_token_ids = torch.where(is_greedy, final_token_ids, sampled)

    positions = torch.arange(max_num_drafts + 1, device=device)
    output = torch.full_like(target_idx, PLACEHOLDER_TOKEN_ID)
    output[:, :max_num_drafts] = torch.where(
        positions[:max_num_drafts] < num_accepted_t.unsqueeze(1),
        draft_padded,
        PLACEHOLDER_TOKEN_ID,
    )
    return output.scatter_(1, num_accepted_t.unsqueeze(1), final_token_ids.unsqueeze(1))


def num_accepted(output: torch.Tensor, num_draft_tokens: list[int]) -> list[int]:
    """The number of accepted drafts per request of a rejection_sample output.

    Args:
        output: [B, K + 1] the emitted tokens, padded with PLACEHOLDER_TOKEN_ID.
        num_draft_tokens: [B] the number of drafts each request proposed.
    """
    assert output.shape[0] == len(num_draft_tokens), "one output row per request"
    counts = ((output != PLACEHOLDER_TOKEN_ID).sum(dim=1) - 1).tolist()
    assert all(0 <= a <= k for a, k in zip(counts, num_draft_tokens)), "more accepted than k"
    return counts


class _RowIndices(NamedTuple):
    """Row indices of the ragged draft and target rows, padded to [B, K] and [B, K + 1].

    For num_draft_tokens = [3, 0, 2] (N = 5, K = 3):

        draft_idx         = [[0, 1, 2], [3, 3, 3], [3, 4, 4]]           clamped to N - 1
        target_idx        = [[0, 1, 2, 3], [4, 4, 4, 4], [5, 6, 7, 7]]  clamped to the bonus row
        is_draft          = [[T, T, T], [F, F, F], [T, T, F]]
        draft_starts      = [0, 3, 3]
        draft_target_rows = [0, 1, 2, 5, 6]                             the row verifying draft i

    Padded entries repeat a real row, so gathers need no mask; is_draft says which count.
    """

    draft_idx: torch.Tensor
    target_idx: torch.Tensor
    is_draft: torch.Tensor
    draft_starts: torch.Tensor
    draft_target_rows: torch.Tensor
    num_draft_tokens: torch.Tensor
    draft_starts_np: np.ndarray

    @classmethod
    def build(cls, num_draft_tokens: list[int], device: torch.device) -> _RowIndices:
        num_draft_np = np.asarray(num_draft_tokens, dtype=np.int64).reshape(-1)
        num_reqs, num_drafts = len(num_draft_np), int(num_draft_np.sum())
        max_num_drafts = int(num_draft_np.max(initial=0))
        draft_starts_np = np.cumsum(num_draft_np) - num_draft_np
        # Request b's target rows come after the b bonus rows of the requests before it.
        target_starts_np = draft_starts_np + np.arange(num_reqs)
        positions_np = np.arange(max_num_drafts + 1)
        target_idx_np = target_starts_np[:, None] + np.minimum(positions_np, num_draft_np[:, None])
        draft_idx_np = np.minimum(
            draft_starts_np[:, None] + positions_np[:max_num_drafts], max(num_drafts - 1, 0)
        )
        is_draft_np = positions_np[:max_num_drafts] < num_draft_np[:, None]
        draft_target_rows_np = np.arange(num_drafts) + np.repeat(np.arange(num_reqs), num_draft_np)

        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device)

        return cls(
            draft_idx=to_device(draft_idx_np),
            target_idx=to_device(target_idx_np),
            is_draft=to_device(is_draft_np),
            draft_starts=to_device(draft_starts_np),
            draft_target_rows=to_device(draft_target_rows_np),
            num_draft_tokens=to_device(num_draft_np),
            draft_starts_np=draft_starts_np,
        )


def _acceptance_uniforms(
    num_draft_tokens: list[int],
    draft_starts_np: np.ndarray,
    generators: dict[int, torch.Generator],
    device: torch.device,
) -> torch.Tensor:
    """[N] uniforms in [0, 1), one per draft; a seeded request's come from its generator."""
    uniforms = torch.rand(sum(num_draft_tokens), device=device)
    for req_index, generator in generators.items():
        start, num = int(draft_starts_np[req_index]), num_draft_tokens[req_index]
        if num > 0:
            uniforms[start : start + num] = torch.rand(num, generator=generator, device=device)
    return uniforms


def _accept_drafts(
    draft_token_ids: torch.Tensor,
    draft_target_rows: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """[N] bool: whether each draft passes its test u < p(x) / q(x), on its own.

    Written as u * q(x) < p(x), which needs no division by q and never accepts a token the
    target gives zero probability. Only the drafted columns and the row sums are read, not
    [N, V] copies.

    Args:
        draft_token_ids: [N] the drafts x.
        draft_target_rows: [N] the target row verifying each draft.
        target_probs: [N + B, V] unnormalised p.
        draft_probs: [N, V] q, or None for one-hot q (then q(x) = 1).
        uniforms: [N] u in [0, 1).
    """
    target_sums = target_probs.sum(dim=-1)[draft_target_rows].clamp_(min=_TINY)
    p_draft = target_probs[draft_target_rows, draft_token_ids] / target_sums
    if draft_probs is None:
        return uniforms < p_draft
    draft_rows = torch.arange(draft_token_ids.shape[0], device=draft_token_ids.device)
    q_draft = draft_probs[draft_rows, draft_token_ids] / draft_probs.sum(dim=-1).clamp_(min=_TINY)
    return uniforms * q_draft < p_draft


def _final_probs(
    target_rows: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    final_draft_rows: torch.Tensor,
    is_rejected: torch.Tensor,
) -> torch.Tensor:
    """[B, V] (unnormalised) distribution of each request's last emitted token.

    A request that rejected draft j draws from max(0, p - q) of row j; one that accepted all
    draws from p of its bonus row (q = 0 there). The residual is all zero only when p == q,
    up to rounding, and then p itself is the right distribution.

    Args:
        target_rows: [B, V] unnormalised p of each request's final row.
        draft_token_ids: [N] the drafts, for one-hot q.
        draft_probs: [N, V] q, or None for one-hot q.
        final_draft_rows: [B] the draft row of each final row (valid where is_rejected).
        is_rejected: [B] bool, whether the final row rejected a draft.
    """
    target = target_rows / target_rows.sum(dim=-1, keepdim=True).clamp_(min=_TINY)
    if not draft_token_ids.numel():
        return target
    rejected = is_rejected.to(target.dtype).unsqueeze(1)
    if draft_probs is None:
        draft = torch.zeros_like(target)
        draft.scatter_(1, draft_token_ids[final_draft_rows].unsqueeze(1), rejected)
    else:
        draft = draft_probs[final_draft_rows]
        draft = draft * (rejected / draft.sum(dim=-1, keepdim=True).clamp_(min=_TINY))
    residual = (target - draft).clamp_(min=0.0)
    return torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, target)


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    is_greedy: torch.Tensor,
    generators: dict[int, torch.Generator],
) -> tuple[torch.Tensor, LogprobsTensors | None]:
    """Speculative decoding: keep each request's drafts that the target agrees with,
    plus one token. The logits go through the sampler's own processing first (penalties,
    processors, min_tokens, then temperature and top-k/top-p/min-p for random rows).

    Args:
        logits: [N + B, V], request b's k_b + 1 rows in a row: the target's scores at
            each draft's position, then after the last draft.
        metadata: one row per logits row (each sees the drafts before it as output).
        draft_token_ids: [N] the drafts, concatenated.
        num_draft_tokens: k_b per request.
        is_greedy: [B] per request.
        generators: request index -> its seeded generator.

    Returns:
        ([B, max k + 1] emitted tokens padded with -1, the logprobs of every logits row
        for the token emitted at it (rows past a request's emitted tokens are garbage),
        or None).
    """
    logits = logits.float()
    raw_logprobs = sampler.process(logits, metadata)
    target_argmax = logits.argmax(dim=-1)
    target_probs = None
    if not metadata.all_greedy:
        target_probs = sampler._random_probs(logits, metadata)
    emitted = rejection_sample(
        draft_token_ids,
        num_draft_tokens,
        target_argmax,
        target_probs,
        is_greedy,
        None,  # drafts are deterministic (greedy guesses, n-gram lookups)
        generators,
    )
    logprobs = None
    if raw_logprobs is not None:
        assert metadata.max_num_logprobs is not None  # raw logprobs only when asked for
        # Row j of request b scores its j-th emitted token.
        counts = torch.tensor(num_draft_tokens, dtype=torch.int64) + 1
        cols = torch.arange(int(counts.sum())) - torch.repeat_interleave(
            torch.cumsum(counts, 0) - counts, counts
        )
        tokens = emitted[torch.repeat_interleave(torch.arange(len(counts)), counts), cols]
        logprobs = compute_topk_logprobs(
            raw_logprobs, tokens.clamp(min=0), metadata.max_num_logprobs
        )
    return emitted, logprobs
