"""Per-request state the worker keeps across steps, in persistent numpy arrays.

Each live request owns one row of every array (its `row`). Rows are reused after a request
finishes; a step gathers the rows it schedules with numpy fancy indexing, so building inputs
costs a few vector ops per step, not Python work per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.services.worker.logits_processors import LogitsProcessorState
from kvserve.shared.messages import NewRequestData
from kvserve.shared.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestState:
    req_id: str
    row: int
    sampling_params: SamplingParams
    num_prompt_tokens: int
    output_token_ids: list[int]
    generator: torch.Generator | None
    eos_token_id: int | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    # logit_bias, allowed_token_ids, bad words as arrays; None when the request has none.
    logits_processors: LogitsProcessorState | None = None
    # Mean pooling: the sum of the prompt's final hidden states over the chunks so far.
    pooled_sum: torch.Tensor | None = None


class InputBatch:
    """Rows of token ids, block tables and sampling parameters for up to max_num_reqs requests.

    Args:
        max_num_reqs: rows available (the scheduler's max_num_seqs).
        max_model_len: the longest request in tokens.
        max_num_blocks_per_req: block-table width.
        vocab_size: the logits' width (pads prompt token ids for the repetition penalty,
            bounds logit_bias and allowed ids).
        num_kv_cache_groups: block tables per request (shared/kv_cache_groups.py): block ids
            then arrive group-major, G equal slices; group 0's go to `block_table`, the
            others' to `group_block_tables`.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_blocks_per_req: int,
        vocab_size: int,
        num_kv_cache_groups: int = 1,
    ):
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_kv_cache_groups = num_kv_cache_groups
        self.group_block_tables = [
            np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
            for _ in range(num_kv_cache_groups - 1)
        ]

        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)

        self.requests: dict[str, RequestState] = {}
        self.num_logits_processor_reqs = 0  # live requests with a LogitsProcessorState
        # Low rows first, so the live rows stay dense.
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.requests)

    def add_request(self, new: NewRequestData, seed_offset: int = 0) -> RequestState:
        assert new.req_id not in self.requests, new.req_id
        if not self._free_rows:
            raise RuntimeError(f"more than {self.max_num_reqs} requests in the worker")
        row = self._free_rows.pop()
        params = new.sampling_params
        generator = None
        if params.seed is not None:
            generator = torch.Generator()
            generator.manual_seed(params.seed + seed_offset)
            skip_draws(generator, len(new.output_token_ids))
        state = RequestState(
            new.req_id,
            row,
            params,
            len(new.prompt_token_ids),
            list(new.output_token_ids),
            generator,
            new.eos_token_id,
        )
        if params.repetition_penalty != 1.0:
            state.prompt_token_ids = list(new.prompt_token_ids)
        state.logits_processors = LogitsProcessorState.of(params, self.vocab_size)
        self.num_logits_processor_reqs += state.logits_processors is not None
        self.requests[new.req_id] = state

        tokens = new.prompt_token_ids + new.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_block_ids(row, new.block_ids)

        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k
        self.min_p[row] = params.min_p
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        return state

    def remove_request(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._free_rows.append(state.row)
            self.num_logits_processor_reqs -= state.logits_processors is not None

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        if self.num_kv_cache_groups > 1:
            self._append_group_block_ids(row, start, block_ids)
            return
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def _append_group_block_ids(self, row: int, start: int, block_ids: list[int]) -> None:
        num_new = len(block_ids) // self.num_kv_cache_groups
        assert num_new * self.num_kv_cache_groups == len(block_ids), "ids are not group-major"
        for group, table in enumerate([self.block_table, *self.group_block_tables]):
            table[row, start : start + num_new] = block_ids[group * num_new : (group + 1) * num_new]
        self.num_blocks[row] = start + num_new

    def append_token(self, state: RequestState, token_id: int) -> None:
        row = state.row
        self.token_ids[row, self.num_tokens[row]] = token_id
        self.num_tokens[row] += 1
        state.output_token_ids.append(token_id)


def skip_draws(generator: torch.Generator, num_draws: int) -> None:
    """Advance a seeded request's generator past the draws its output tokens took (a request
    resumed after a preemption, or migrated from a dead engine), so that it goes on as the
    uninterrupted request would. The sampler draws one uniform per sampled token
    (sampler.inverse_cdf_sample), one at a time; with speculative decoding the count differs
    (the rejection sampler's draws), and the resumed tokens keep their distribution only."""
    for _ in range(num_draws):
        torch.rand(1, generator=generator)
