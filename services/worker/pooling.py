"""Embedding, score and classify requests: a step's hidden states pooled per request, the
vector sent once the prompt is done."""

from __future__ import annotations

import numpy as np
import torch

from kvserve.services.worker.step_inputs import StepBatch


def pool_step(step: StepBatch, model: torch.nn.Module) -> dict[str, bytes]:
    """The pooling requests of the step: each chunk's hidden states pooled (the sum, for
    "mean"; the first row, for "cls"); once the prompt is done, the vector (on the last
    pipeline stage, which has the hidden states): through the model's classifier head when
    it has one (`classify`: logits, not normalised), else L2-normalised if the request asks.
    They sample nothing: on every rank they leave step.sample_idx.

    Args:
        step: the step's inputs and, on the last stage, its hidden states.
        model: the model (its `classify` head, for a cross-encoder or a classifier).
    """
    pooled: dict[str, bytes] = {}
    pooling_idx = []
    for i, state in enumerate(step.states):
        if state.sampling_params.pooling is None:
            continue
        pooling_idx.append(i)
        if step.hidden is None:
            continue
        vector = _pool_chunk(step, i)
        if vector is not None:
            pooled[state.req_id] = _finish(vector, state.sampling_params.normalize, model)
    step.sample_idx = np.setdiff1d(step.sample_idx, pooling_idx)
    return pooled


def _pool_chunk(step: StepBatch, i: int) -> torch.Tensor | None:
    """Fold request i's rows of this step into its pooling state; its pooled vector once
    its prompt is done, else None."""
    assert step.hidden is not None
    state = step.states[i]
    how = state.sampling_params.pooling
    starts = step.query_start_loc
    begin = int(step.num_computed[i])
    end = begin + int(step.num_scheduled[i])
    rows = step.hidden[int(starts[i]) : int(starts[i + 1])].float()
    if how == "mean":
        total = rows.sum(dim=0)
        state.pooled_sum = total if state.pooled_sum is None else state.pooled_sum + total
    elif how == "cls" and begin == 0:
        state.pooled_sum = rows[0]  # the first token's row (the prompt is never cached)
    if end < state.num_prompt_tokens:
        return None
    if how == "last":
        return rows[-1]
    assert state.pooled_sum is not None
    return state.pooled_sum / state.num_prompt_tokens if how == "mean" else state.pooled_sum


def _finish(vector: torch.Tensor, normalize: bool, model: torch.nn.Module) -> bytes:
    classify = getattr(model, "classify", None)
    if classify is not None:
        vector = classify(vector[None].to(next(model.parameters()).dtype))[0].float()
    elif normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.cpu().numpy().astype(np.float32).tobytes()


def encoder_token_types(step: StepBatch) -> torch.Tensor | None:
    """Token type ids [T] of an encoder's step: 1 from each pair request's
    `token_type_start` on (its second segment), else 0; None when no request has a pair."""
    starts = [state.sampling_params.token_type_start for state in step.states]
    if all(start is None for start in starts):
        return None
    positions = step.positions
    types = torch.zeros_like(positions)
    loc = step.query_start_loc
    for i, start in enumerate(starts):
        if start is not None:
            rows = slice(int(loc[i]), int(loc[i + 1]))
            types[rows] = (positions[rows] >= start).to(types.dtype)
    return types
