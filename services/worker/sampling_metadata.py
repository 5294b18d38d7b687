"""The batched per-row sampling state that the model runner hands the Sampler each step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.services.worker.logits_processors import LogitsProcessorBatch


@dataclass(slots=True)
class SamplingMetadata:
    """Row r of every tensor belongs to the r-th sampled request of the step.

    Args:
        temperature: [R] float32; None when every row is greedy.
        all_greedy / all_random: fast paths (all temperature == 0 / all > 0).
        top_p, top_k, min_p: [R] tensors, or None when no row uses the filter.
            top_k is int64 with 0 meaning off.
        generators: row -> torch.Generator, for the rows that have a seed. Their random draws
            must come from that generator only, so a seeded row samples the same tokens
            whatever else is in the batch.
        max_num_logprobs: the largest `logprobs` of any row; None when no row asks.
        no_penalties: True when no row has a penalty (skip that work).
        presence_penalties, frequency_penalties, repetition_penalties: [R] float32.
        prompt_token_ids: [R, max_prompt_len] int64, padded with vocab_size; only set when
            some row has a repetition penalty.
        output_token_ids: per row, the tokens generated so far (penalties, min_tokens).
        min_tokens: row -> (min_tokens, token ids to forbid while fewer outputs exist),
            only for rows whose output is still shorter than min_tokens.
        grammar_bitmask: [N, W] int32, the allowed tokens of the N rows that sample under a
            grammar (structured outputs); None when none does.
        grammar_rows: [N] the row of each bitmask row.
        forced_tokens: (row, token id) of the rows whose token is decided (a thinking budget
            spent): every other token of the row is set to -inf.
        logits_processors: allowed_token_ids, bad words and logit_bias of the rows that use
            them; None when no row does.
    """

    temperature: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: int | None = None
    no_penalties: bool = True
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    prompt_token_ids: torch.Tensor | None = None
    output_token_ids: list[list[int]] = field(default_factory=list)
    min_tokens: dict[int, tuple[int, set[int]]] = field(default_factory=dict)
    grammar_bitmask: np.ndarray | None = None
    grammar_rows: np.ndarray | None = None
    forced_tokens: list[tuple[int, int]] = field(default_factory=list)
    logits_processors: LogitsProcessorBatch | None = None


@dataclass(slots=True)
class LogprobsTensors:
    """token_ids / logprobs: [R, 1 + k], column 0 the chosen token; ranks: [R] (1 = best)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [R] int64
    logprobs: LogprobsTensors | None  # None when max_num_logprobs is None
