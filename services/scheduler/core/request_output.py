"""What the scheduler makes of a request's sampled tokens: grammar steps and logprob rows."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.services.scheduler.core.request import Request, RequestStatus
from kvserve.services.scheduler.core.step_plan import StepPlan
from kvserve.services.scheduler.core.stop_check import check_stop
from kvserve.services.scheduler.structured_output.manager import StructuredOutputManager
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import EngineCoreOutput, Logprobs, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from kvserve.services.scheduler.core.spec_scheduler import SpecDecodeScheduler

logger = init_logger(__name__)


def grammar_bitmask_of(
    plan: StepPlan, requests: dict[str, Request], manager: StructuredOutputManager | None
) -> tuple[list[str], bytes]:
    """The requests that sample under a grammar in this step (their scheduled tokens
    reach the end of what they hold), and the bitmask of their next tokens: a request that
    verifies k drafts is listed k + 1 times, with a row per position
    (structured_output/draft_masks.py)."""
    req_ids, grammars, drafts = [], [], []
    for req_id, num_tokens in plan.num_scheduled_tokens.items():
        request = requests[req_id]
        state = request.structured_output
        if state is None or state.grammar is None:
            continue
        if request.thinking is not None and not request.thinking.ended:
            continue  # the grammar constrains the answer, not the thinking
        if request.num_computed_tokens + num_tokens >= request.num_tokens:
            draft_token_ids = plan.spec_token_ids.get(req_id, [])
            req_ids += [req_id] * (1 + len(draft_token_ids))
            grammars.append(state.grammar)
            drafts.append(draft_token_ids)
    if not grammars:
        return [], b""
    assert manager is not None, "grammars come from the manager"
    return req_ids, manager.grammar_bitmask(grammars, drafts)


def forced_tokens_of(plan: StepPlan, requests: dict[str, Request]) -> dict[str, int]:
    """The requests that sample in this step with a token already decided (a thinking
    budget spent: the next end-of-thinking token), and that token."""
    forced = {}
    for req_id, num_tokens in plan.num_scheduled_tokens.items():
        request = requests[req_id]
        thinking = request.thinking
        if thinking is None or request.num_computed_tokens + num_tokens < request.num_tokens:
            continue
        token_id = thinking.forced_token()
        if token_id is not None:
            forced[req_id] = token_id
    return forced


def take_num_cached_tokens(request: Request) -> int:
    """The prefix-cache hit for the request's first output; 0 for the later ones."""
    if request.sent_first_output:
        return 0
    request.sent_first_output = True
    return max(request.num_cached_tokens, 0)


def take_step_output(
    request: Request,
    row: int | None,
    scheduler_output: SchedulerOutput,
    model_runner_output: ModelRunnerOutput,
    spec_decode: SpecDecodeScheduler | None,
    max_model_len: int,
) -> EngineCoreOutput | None:
    """One running request's part of a step's output: an embedding's vector (it is then
    done), or its rejected drafts rolled back and its sampled tokens appended.

    Args:
        request: a request the step scheduled, still running.
        row: its row in `model_runner_output.sampled_token_ids` (None: nothing sampled).
        scheduler_output: the plan of the step.
        model_runner_output: what the step computed.
        spec_decode: the speculative decoding rules (None: off).
        max_model_len: the longest a request may grow.
    """
    pooled = model_runner_output.pooled.get(request.req_id)
    if pooled is not None:  # an embedding: its prompt is done, and so is it
        request.status = RequestStatus.FINISHED_STOPPED
        return pooled_output(request, pooled)
    sampled_token_ids = model_runner_output.sampled_token_ids[row] if row is not None else []
    if spec_decode is not None and request.spec is not None:
        spec_decode.on_output(
            request,
            scheduler_output.spec_decode,
            sampled_token_ids,
            model_runner_output.spec_token_ids.get(request.req_id, []),
        )
    return make_request_output(request, sampled_token_ids, model_runner_output, max_model_len)


def pooled_output(request: Request, pooled: bytes) -> EngineCoreOutput:
    """The one output of an embedding request: its pooled vector, and its end."""
    num_cached_tokens = take_num_cached_tokens(request)
    return EngineCoreOutput(
        request_id=request.req_id,
        new_token_ids=[],
        finish_reason=request.get_finished_reason(),
        num_cached_tokens=num_cached_tokens,
        events=request.take_events(),
        pooled=pooled,
        trace_spans=request.trace.finish() if request.trace is not None else None,
    )


def make_request_output(
    request: Request,
    sampled_token_ids: list[int],
    model_runner_output: ModelRunnerOutput,
    max_model_len: int,
) -> EngineCoreOutput | None:
    """Append the request's sampled tokens up to the first that ends it, and its output
    (None when it has nothing to report this step)."""
    assert not sampled_token_ids or request.num_computed_tokens >= request.num_tokens, (
        f"{request} got tokens sampled before its prompt was computed"
    )
    new_token_ids = []
    # Several tokens may arrive at once (speculative decoding): stop at the first that
    # ends the request and drop the rest.
    for token_id in sampled_token_ids:
        request.append_output_token_ids(token_id)
        new_token_ids.append(token_id)
        answering = request.thinking is None or not request.thinking.take(token_id)
        grammar = request.structured_output is not None and answering
        if grammar and not advance_grammar(request, token_id):
            break
        if check_stop(request, max_model_len):
            break
        if grammar and grammar_complete(request):
            break
    logprobs = model_runner_output.logprobs.get(request.req_id)
    if logprobs is not None and len(logprobs.ranks) > len(new_token_ids):
        logprobs = slice_logprobs(logprobs, 0, len(new_token_ids))
    prompt_logprobs = take_new_prompt_logprobs(
        request, model_runner_output.prompt_logprobs.get(request.req_id)
    )
    if not new_token_ids and prompt_logprobs is None and not request.is_finished:
        return None
    num_cached_tokens = take_num_cached_tokens(request)
    return EngineCoreOutput(
        request_id=request.req_id,
        new_token_ids=new_token_ids,
        new_logprobs=logprobs if new_token_ids else None,
        new_prompt_logprobs=prompt_logprobs,
        finish_reason=request.get_finished_reason(),
        stop_reason=request.stop_reason,
        num_cached_tokens=num_cached_tokens,
        error=request.error,
        events=request.take_events(),
        trace_spans=(
            request.trace.finish() if request.trace is not None and request.is_finished else None
        ),
    )


def advance_grammar(request: Request, token_id: int) -> bool:
    """Move the request's matcher over its new token; False (the request failed) when
    the grammar forbids it, which the bitmask should have made impossible."""
    assert request.structured_output is not None and request.structured_output.grammar
    if request.structured_output.grammar.accept_tokens([token_id]):
        return True
    request.status = RequestStatus.FINISHED_ERROR
    request.error = f"sampled token {token_id} is not allowed by the request's grammar"
    logger.error("request %s: %s", request.req_id, request.error)
    return False


def grammar_complete(request: Request) -> bool:
    """A grammar that took its stop token ends the request (even with ignore_eos)."""
    assert request.structured_output is not None and request.structured_output.grammar
    if not request.structured_output.grammar.is_terminated:
        return False
    request.status = RequestStatus.FINISHED_STOPPED
    return True


def take_new_prompt_logprobs(request: Request, prompt_logprobs: Logprobs | None) -> Logprobs | None:
    """Drop rows already sent before a preemption made the prompt run again."""
    if prompt_logprobs is None:
        return None
    num_rows = len(prompt_logprobs.ranks)
    first_new_row = max(0, request.num_prompt_logprobs_sent - request.num_prompt_logprobs_seen)
    request.num_prompt_logprobs_seen += num_rows
    if first_new_row >= num_rows:
        return None
    request.num_prompt_logprobs_sent += num_rows - first_new_row
    return slice_logprobs(prompt_logprobs, first_new_row, num_rows)


def slice_logprobs(logprobs: Logprobs, start: int, stop: int) -> Logprobs:
    return Logprobs(
        token_ids=logprobs.token_ids[start:stop],
        logprobs=logprobs.logprobs[start:stop],
        ranks=logprobs.ranks[start:stop],
    )
