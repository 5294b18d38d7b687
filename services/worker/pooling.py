"""Embedding requests: a step's hidden states pooled per request, the vector sent once the
prompt is done."""

from __future__ import annotations

import numpy as np
import torch

from kvserve.services.worker.step_inputs import StepBatch


def pool_step(step: StepBatch) -> dict[str, bytes]:
    """The embedding requests of the step: each chunk's hidden states pooled (the sum, for
    "mean"); once the prompt is done, the normalised vector (on the last pipeline stage,
    which has the hidden states). They sample nothing: on every rank they leave
    step.sample_idx."""
    pooled: dict[str, bytes] = {}
    pooling_idx = []
    starts = step.query_start_loc
    for i, state in enumerate(step.states):
        how = state.sampling_params.pooling
        if how is None:
            continue
        pooling_idx.append(i)
        if step.hidden is None:
            continue
        end = int(step.num_computed[i]) + int(step.num_scheduled[i])
        rows = step.hidden[int(starts[i]) : int(starts[i + 1])].float()
        if how == "mean":
            total = rows.sum(dim=0)
            state.pooled_sum = total if state.pooled_sum is None else state.pooled_sum + total
        if end < state.num_prompt_tokens:
            continue
        if how == "last":
            vector = rows[-1]
        else:
            assert state.pooled_sum is not None
            vector = state.pooled_sum / state.num_prompt_tokens
        vector = torch.nn.functional.normalize(vector, dim=0)
        pooled[state.req_id] = vector.cpu().numpy().astype(np.float32).tobytes()
    step.sample_idx = np.setdiff1d(step.sample_idx, pooling_idx)
    return pooled
