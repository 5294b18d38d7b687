"""Speculative methods by name: what `SpeculativeConfig.method` selects in the worker."""

from __future__ import annotations

from collections.abc import Callable

from kvserve.services.worker.input_batch import InputBatch
from kvserve.services.worker.spec_decode.methods import (
    DraftModelMethod,
    EagleMethod,
    MedusaMethod,
    MtpMethod,
    NgramMethod,
)
from kvserve.services.worker.spec_decode.proposer import Proposer, ProposerContext
from kvserve.services.worker.step_inputs import StepBatch

ProposerFactory = Callable[[ProposerContext], Proposer]

_PROPOSERS: dict[str, ProposerFactory] = {
    "ngram": NgramMethod,
    "draft_model": DraftModelMethod,
    "eagle": EagleMethod,
    "eagle3": EagleMethod,  # the same proposer over an EAGLE-3 head (eagle3.py)
    "medusa": MedusaMethod,
    # The target's own multi-token-prediction layer (mtp.py); deepseek_mtp is vLLM's name.
    "mtp": MtpMethod,
    "deepseek_mtp": MtpMethod,
}


def register_proposer(method: str, factory: ProposerFactory) -> None:
    """Make `method` a speculative method of the worker.

    Args:
        method: the SpeculativeConfig.method value that selects it.
        factory: builds the proposer from a ProposerContext (once per worker rank).
    """
    _PROPOSERS[method] = factory


class SchedulerSideMethod(Proposer):
    """A method whose drafts the scheduler makes (services/scheduler/core/spec_proposers.py):
    the worker verifies them and proposes nothing."""

    def __init__(self, ctx: ProposerContext):
        del ctx

    def propose(self, step: StepBatch, batch: InputBatch) -> dict[str, list[int]]:
        return {}


def make_proposer(ctx: ProposerContext) -> Proposer:
    """The proposer of ctx.config.method (for a scheduler-side method, one that proposes
    nothing)."""
    if ctx.config.proposes_in_scheduler:
        return SchedulerSideMethod(ctx)
    try:
        factory = _PROPOSERS[ctx.config.method]
    except KeyError:
        raise ValueError(
            f"unknown speculative method {ctx.config.method!r}; registered: {sorted(_PROPOSERS)}"
        ) from None
    return factory(ctx)
