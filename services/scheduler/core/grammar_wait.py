"""Structured-output requests wait for their grammar to compile before they are queued.

A request with `structured_outputs` waits in `Scheduler.waiting_for_grammar` while its
grammar compiles on the StructuredOutputManager's threads (`wait_for_grammar`); once the
compile is done it joins the waiting queue holding a matcher, or ends with the compile's
error (`admit_compiled_grammars`). Each takes the Scheduler whose queues it moves the
request between.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvserve.services.scheduler.core.request import (
    Request,
    RequestStatus,
    StructuredOutputState,
)

if TYPE_CHECKING:
    from kvserve.services.scheduler.core.features import LiveFeatureCounts
    from kvserve.services.scheduler.core.request_queue import RequestQueue
    from kvserve.services.scheduler.structured_output.manager import StructuredOutputManager


class GrammarScheduler(Protocol):
    """What of the Scheduler these functions use (the Scheduler is one)."""

    structured_output_manager: StructuredOutputManager | None
    waiting: RequestQueue
    waiting_for_grammar: dict[str, Request]
    live: LiveFeatureCounts

    def _fail_request(self, request: Request, error: str) -> None: ...


def wait_for_grammar(scheduler: GrammarScheduler, request: Request) -> None:
    """Start compiling the grammar of a newly arrived request, which waits for it."""
    params = request.sampling_params.structured_outputs
    assert params is not None and scheduler.structured_output_manager is not None
    future = scheduler.structured_output_manager.compile(params)
    request.structured_output = StructuredOutputState(future)
    request.status = RequestStatus.WAITING_FOR_GRAMMAR
    scheduler.waiting_for_grammar[request.req_id] = request


def admit_compiled_grammars(scheduler: GrammarScheduler) -> None:
    """Requests whose grammar compiled join the waiting queue; a failed compile ends its
    request with the compile's error (the api answers it as a 400)."""
    manager = scheduler.structured_output_manager
    assert manager is not None, "only a manager's compiles wait here"
    for request in list(scheduler.waiting_for_grammar.values()):
        state = request.structured_output
        assert state is not None, f"{request} waits for a grammar it does not have"
        if not state.future.done():
            continue
        del scheduler.waiting_for_grammar[request.req_id]
        try:
            state.grammar = manager.make_grammar(state.future)
        except Exception as exc:  # noqa: BLE001 - a bad grammar costs its request only
            scheduler._fail_request(request, str(exc))
            continue
        scheduler.live.num_grammars += 1
        replay, request.grammar_replay = request.grammar_replay, []
        if replay and not state.grammar.accept_tokens(replay):
            scheduler._fail_request(
                request, "the tokens it emitted before it moved do not fit its grammar"
            )
            continue
        request.status = RequestStatus.WAITING
        scheduler.waiting.add_request(request)
