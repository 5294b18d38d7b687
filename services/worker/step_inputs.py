"""One step's flattened inputs, built from a SchedulerOutput over the InputBatch.

`StepBatch` is the per-step struct the runner, the sampler path and the proposers share: who
runs (states, rows), how many tokens each computes and verifies, the flattened model inputs,
and, once the step ran, what it sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvserve.services.worker.input_batch import InputBatch, RequestState
from kvserve.services.worker.kv_cache_groups import prepare_group_tables
from kvserve.services.worker.layers.attention import AttentionMetadata
from kvserve.shared.messages import Logprobs, SchedulerOutput


@dataclass
class StepBatch:
    """One step, one entry per scheduled request (in SchedulerOutput order).

    Args:
        so: the step's SchedulerOutput.
        req_ids, states, rows: the scheduled requests, their state and InputBatch row.
        num_scheduled, num_computed: query tokens (drafts included) and tokens already in
            the cache, per request.
        num_drafts: drafts each request verifies (they follow its known tokens).
        query_start_loc: [R + 1] offsets of each request's tokens in the flat inputs.
        seq_lens: [R] num_computed + num_scheduled.
        sample_idx: the requests that sample (their context reaches every token they have).
        token_rows: [T] the InputBatch row of each flat token (LoRA picks adapters by it).
        input_ids, positions, metadata: the forward's inputs on the device.
        hidden: the last stage's final hidden states [T, hidden] (None on other stages).
        sampled: the tokens each request emitted in this step ([] for a prompt chunk).
        logprobs: the sampled tokens' logprobs, per request that asked.
        last_rows: the hidden row of each request's last emitted token.
    """

    so: SchedulerOutput
    req_ids: list[str]
    states: list[RequestState]
    rows: np.ndarray
    num_scheduled: np.ndarray
    num_computed: np.ndarray
    num_drafts: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    sample_idx: np.ndarray
    token_rows: np.ndarray
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    hidden: torch.Tensor | None = None
    sampled: list[list[int]] = field(default_factory=list)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    last_rows: np.ndarray | None = None
    # A VLM's image embeddings and M-RoPE positions (services/worker/multimodal.py).
    multimodal: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def verifies_drafts(self) -> bool:
        return bool(self.so.spec_decode.draft_token_ids)


def prepare_inputs(
    so: SchedulerOutput, batch: InputBatch, block_size: int, device: torch.device
) -> StepBatch:
    """The flattened inputs of the scheduled requests (their states already updated)."""
    req_ids = list(so.num_scheduled_tokens)
    states = [batch.requests[r] for r in req_ids]
    rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
    num_scheduled = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(rows))
    num_computed = batch.num_computed_tokens[rows]
    num_drafts = _place_drafts(so, batch, req_ids, rows)

    # Example: num_scheduled = [3, 1, 2], num_computed = [0, 7, 4]
    #   query_start_loc = [0, 3, 4, 6]; req_indices = [0 0 0 1 2 2]
    #   positions = [0 1 2 | 7 | 4 5]
    query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(num_scheduled, out=query_start_loc[1:])
    total = int(query_start_loc[-1])
    req_indices = np.repeat(np.arange(len(rows)), num_scheduled)
    offsets = np.arange(total) - np.repeat(query_start_loc[:-1], num_scheduled)
    positions = num_computed[req_indices] + offsets
    token_rows = rows[req_indices]
    input_ids = batch.token_ids[token_rows, positions]
    seq_lens = (num_computed + num_scheduled).astype(np.int32)
    metadata = _attention_metadata(
        batch, rows, token_rows, positions, query_start_loc, num_scheduled, seq_lens, block_size,
        device,
    )  # fmt: skip
    return StepBatch(
        so=so,
        req_ids=req_ids,
        states=states,
        rows=rows,
        num_scheduled=num_scheduled,
        num_computed=num_computed,
        num_drafts=num_drafts,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        # A request samples once its context reaches every token it has (the prompt chunk,
        # or the whole prompt plus outputs after a resume, is done).
        sample_idx=np.flatnonzero(seq_lens >= batch.num_tokens[rows]),
        token_rows=token_rows,
        input_ids=torch.from_numpy(input_ids).to(device),
        positions=torch.from_numpy(positions).to(device),
        metadata=metadata,
        sampled=[[] for _ in req_ids],
        last_rows=query_start_loc[1:] - 1,
    )


def _attention_metadata(
    batch: InputBatch,
    rows: np.ndarray,
    token_rows: np.ndarray,
    positions: np.ndarray,
    query_start_loc: np.ndarray,
    num_scheduled: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """The attention inputs of the flat tokens: each token's cache slot, and each request's
    block table row cut to the blocks the longest one reads (every KV cache group's)."""
    slot_mapping = (
        batch.block_table[token_rows, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )
    max_seq_len = int(seq_lens.max())
    num_blocks_needed = -(-max_seq_len // block_size)
    metadata = AttentionMetadata(
        query_start_loc=torch.from_numpy(query_start_loc).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device),
        block_table=torch.from_numpy(
            np.ascontiguousarray(batch.block_table[rows, :num_blocks_needed])
        ).to(device),
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        max_query_len=int(num_scheduled.max()),
        max_seq_len=max_seq_len,
    )
    if batch.group_block_tables:
        metadata.group_tables = prepare_group_tables(
            batch.group_block_tables,
            rows,
            token_rows,
            positions,
            num_blocks_needed,
            block_size,
            device,
        )
    return metadata


def _place_drafts(
    so: SchedulerOutput, batch: InputBatch, req_ids: list[str], rows: np.ndarray
) -> np.ndarray:
    """Write each request's drafts after its known tokens in its row, so the inputs pick
    them up (num_tokens does not count them); the number of drafts per request."""
    num_drafts = np.zeros(len(req_ids), dtype=np.int64)
    drafts_of = so.spec_decode.draft_token_ids
    if not drafts_of:
        return num_drafts
    for i, req_id in enumerate(req_ids):
        drafts = drafts_of.get(req_id)
        if drafts:
            row, n = rows[i], batch.num_tokens[rows[i]]
            batch.token_ids[row, n : n + len(drafts)] = drafts
            num_drafts[i] = len(drafts)
    return num_drafts
