"""The proposer seam: what the runner asks of a speculative method, and how methods register.

A proposer guesses each request's next tokens after a step. The runner holds one
(`ModelRunner.proposer`) and calls it at fixed points: `after_forward(step)` right after the
target's forward (a draft model's catch-up), then `propose(step, batch)` once the step's
tokens are sampled and appended. The KV hooks size and bind a proposer's own cache.

`SpeculativeConfig.method` picks the proposer from the registry (registry.py); a new method
registers a factory there and touches nothing else in the worker.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvserve.shared.config import SpeculativeConfig

if TYPE_CHECKING:
    from kvserve.services.worker.input_batch import InputBatch, RequestState
    from kvserve.services.worker.step_inputs import StepBatch


@dataclass
class ProposerContext:
    """What a proposer is built from.

    Args:
        config: the speculative config.
        target_model: the target model (a proposer may share its layers or LM head).
        dtype, device: the target's.
        block_size: the KV cache's block size.
        max_model_len: no draft past it.
        is_driver: this rank's guesses reach the scheduler (TP rank 0 of the last stage).
        single_stage: no pipeline parallelism (the whole model is on this rank).
        lora_manager: the runner's LoRA manager, or None.
        model_dir: the target's checkpoint folder (a method may read more of it: the MTP
            layers), or None.
        quantization: the target's --quantization, to read more of its checkpoint alike.
    """

    config: SpeculativeConfig
    target_model: torch.nn.Module
    dtype: torch.dtype
    device: torch.device
    block_size: int
    max_model_len: int
    is_driver: bool
    single_stage: bool
    lora_manager: Any = None
    model_dir: str | None = None
    quantization: str | None = None


class Proposer(ABC):
    """One speculative method in the worker (see the module docstring)."""

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes per KV block of the proposer's own layers (0: it has none)."""
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:  # noqa: B027 - an optional hook
        """Allocate the proposer's own KV cache, with the target's block ids."""

    def after_forward(self, step: StepBatch) -> None:  # noqa: B027 - an optional hook
        """Right after the target's forward, before sampling."""

    @abstractmethod
    def propose(self, step: StepBatch, batch: InputBatch) -> dict[str, list[int]]:
        """Drafts for the next step, per request that asked
        (step.so.spec_decode.num_to_propose), after the step's tokens were appended.
        Every rank calls it; only the driver's answer reaches the scheduler."""


@dataclass
class ProposalRequests:
    """The requests of a step that sampled and asked for drafts.

    Args:
        states, rows: their state and InputBatch row.
        idx: their index in the step.
        num_tokens: tokens each holds (the ones this step emitted included).
        num_drafts: drafts wanted, capped so that none lies past max_model_len.
    """

    states: list[RequestState]
    rows: np.ndarray
    idx: list[int]
    num_tokens: np.ndarray
    num_drafts: np.ndarray


def proposal_requests(
    step: StepBatch, batch: InputBatch, max_model_len: int
) -> ProposalRequests | None:
    """The step's requests to propose for, or None when there are none."""
    wanted = step.so.spec_decode.num_to_propose
    if not wanted:
        return None
    idx = [int(i) for i in step.sample_idx if wanted.get(step.states[i].req_id, 0) > 0]
    if not idx:
        return None
    states = [step.states[i] for i in idx]
    rows = step.rows[idx]
    num_tokens = batch.num_tokens[rows]
    num = np.fromiter((wanted[s.req_id] for s in states), np.int64, len(idx))
    return ProposalRequests(
        states, rows, idx, num_tokens, np.minimum(num, max_model_len - num_tokens)
    )
