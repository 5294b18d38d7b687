"""Sampling inputs of one step: the SamplingMetadata of the rows that sample, from the
InputBatch's per-request arrays, and the sampled rows' logprobs split back per request."""

from __future__ import annotations

import numpy as np
import torch

from kvserve.services.worker.input_batch import InputBatch, RequestState
from kvserve.services.worker.logits_processors import LogitsProcessorBatch
from kvserve.services.worker.sampling_metadata import LogprobsTensors, SamplingMetadata
from kvserve.shared.messages import Logprobs, SchedulerOutput


def to_logprobs(t: LogprobsTensors) -> Logprobs:
    return Logprobs(t.token_ids.tolist(), t.logprobs.tolist(), t.ranks.tolist())


def build_sampling_metadata(
    b: InputBatch,
    states: list[RequestState],
    rows: np.ndarray,
    so: SchedulerOutput,
    draft_prefixes: list[list[int]] | None = None,
) -> SamplingMetadata:
    """One row per entry of `states`; with draft_prefixes (speculative decoding), row i
    scores the position after draft_prefixes[i], which counts as output for penalties,
    min_tokens and logits processors."""
    if draft_prefixes is None:
        outputs = [s.output_token_ids for s in states]
    else:
        outputs = [s.output_token_ids + p for s, p in zip(states, draft_prefixes)]
    temperature = b.temperature[rows]
    greedy = temperature < 1e-5
    all_greedy = bool(greedy.all())
    md = SamplingMetadata(
        temperature=None if all_greedy else torch.from_numpy(temperature),
        all_greedy=all_greedy,
        all_random=not bool(greedy.any()),
    )
    if not all_greedy:
        _set_filters(md, b, rows, states)
    wanted = [s.sampling_params.logprobs for s in states if s.sampling_params.logprobs is not None]
    md.max_num_logprobs = max(wanted) if wanted else None
    _set_penalties(md, b, rows, states)
    md.min_tokens.update(_min_tokens(states, outputs))
    if not md.no_penalties or md.min_tokens:  # what the outputs are read for
        md.output_token_ids = outputs
    if so.grammar_req_ids:
        md.grammar_bitmask, md.grammar_rows = _grammar_rows(states, so)
    if so.forced_token_ids:
        forced = so.forced_token_ids
        md.forced_tokens = [
            (i, forced[s.req_id]) for i, s in enumerate(states) if s.req_id in forced
        ]
    if b.num_logits_processor_reqs:
        with_processors = [
            (i, s.logits_processors, outputs[i])
            for i, s in enumerate(states)
            if s.logits_processors is not None
        ]
        if with_processors:
            md.logits_processors = LogitsProcessorBatch.gather(with_processors)
    return md


def _set_filters(
    md: SamplingMetadata, b: InputBatch, rows: np.ndarray, states: list[RequestState]
) -> None:
    """top-p, top-k and min-p where some row uses them, and the rows' seeded generators."""
    top_p, top_k, min_p = b.top_p[rows], b.top_k[rows], b.min_p[rows]
    md.top_p = torch.from_numpy(top_p) if (top_p < 1.0).any() else None
    md.top_k = torch.from_numpy(top_k) if (top_k > 0).any() else None
    md.min_p = torch.from_numpy(min_p) if (min_p > 0.0).any() else None
    md.generators = {i: s.generator for i, s in enumerate(states) if s.generator}


def _set_penalties(
    md: SamplingMetadata, b: InputBatch, rows: np.ndarray, states: list[RequestState]
) -> None:
    """The presence, frequency and repetition penalties, unless no row has one (then
    md.no_penalties); the prompts too where some row has a repetition penalty."""
    presence, frequency = b.presence_penalty[rows], b.frequency_penalty[rows]
    repetition = b.repetition_penalty[rows]
    md.no_penalties = not (
        (presence != 0).any() or (frequency != 0).any() or (repetition != 1).any()
    )
    if not md.no_penalties:
        md.presence_penalties = torch.from_numpy(presence)
        md.frequency_penalties = torch.from_numpy(frequency)
        md.repetition_penalties = torch.from_numpy(repetition)
        if (repetition != 1).any():
            md.prompt_token_ids = _padded_prompts(states, b.vocab_size)


def _min_tokens(
    states: list[RequestState], outputs: list[list[int]]
) -> dict[int, tuple[int, set[int]]]:
    """row -> (min_tokens, the stop and EOS ids it forbids) for the rows whose output is
    still shorter than their min_tokens."""
    min_tokens = {}
    for i, s in enumerate(states):
        p = s.sampling_params
        if len(outputs[i]) < p.min_tokens:
            forbidden = set(p.stop_token_ids or ())
            if s.eos_token_id is not None:
                forbidden.add(s.eos_token_id)
            min_tokens[i] = (p.min_tokens, forbidden)
    return min_tokens


def _grammar_rows(states: list[RequestState], so: SchedulerOutput) -> tuple[np.ndarray, np.ndarray]:
    """The step's bitmask as [N, W] int32 (a view of the message's bytes), and the
    sampling row of each of its rows. A request verifying drafts has a row per position,
    in order, as it has bitmask rows (listed once per row in grammar_req_ids)."""
    rows_of: dict[str, list[int]] = {}
    for i, s in enumerate(states):
        rows_of.setdefault(s.req_id, []).append(i)
    bitmask = np.frombuffer(so.grammar_bitmask, dtype=np.int32).reshape(len(so.grammar_req_ids), -1)
    num_taken: dict[str, int] = {}
    rows = np.empty(len(bitmask), np.int64)
    for j, req_id in enumerate(so.grammar_req_ids):
        n = num_taken.get(req_id, 0)
        num_taken[req_id] = n + 1
        rows[j] = rows_of[req_id][n]
    return bitmask, rows


def _padded_prompts(states: list[RequestState], vocab_size: int) -> torch.Tensor:
    width = max(len(s.prompt_token_ids) for s in states) or 1
    out = torch.full((len(states), width), vocab_size, dtype=torch.int64)
    for i, s in enumerate(states):
        out[i, : len(s.prompt_token_ids)] = torch.tensor(s.prompt_token_ids, dtype=torch.int64)
    return out


def split_logprobs(states: list[RequestState], t: LogprobsTensors) -> dict[str, Logprobs]:
    out = {}
    for i, s in enumerate(states):
        n = s.sampling_params.logprobs
        if n is None:
            continue
        out[s.req_id] = Logprobs(
            t.token_ids[i : i + 1, : n + 1].tolist(),
            t.logprobs[i : i + 1, : n + 1].tolist(),
            t.ranks[i : i + 1].tolist(),
        )
    return out
