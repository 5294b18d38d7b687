"""The predicted queue delay an engine publishes for DP routing by TTFT target.

A new request waits for the work ahead of it: the step in flight and the prompt tokens of
every running and waiting request still to compute. With the step-time model (step_time.py)
that is

    delay = sum over the steps that clear those prompt tokens (chunks of the step's token
            budget beside the running decodes) of their predicted time

The model is linear, so the sum is the prediction of the summed shape plus one intercept (and
one jump off the decode-only fast path, while prompts are left) per further step:
O(requests) a call, no per-step loop. It is an estimate (prefix-cache hits,
requests finishing and seats running out are not modelled); the api's DP router compares it
with a request's TTFT target (services/api/engine_client/slo_routing.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvserve.services.scheduler.core.request import Request
from kvserve.services.scheduler.core.step_time import StepShape, StepTimeModel, attended


def predicted_queue_delay_s(
    model: StepTimeModel, requests: Iterable[Request], max_num_batched_tokens: int
) -> float:
    """Seconds until a request arriving now would get its first step (0 when idle).

    Args:
        model: the engine's step-time model.
        requests: every live request, running or waiting (`Scheduler.requests`, in any
            order: a dict's values, not the waiting queue's sorted walk). One with a token
            left to compute is a decode row of each step; one with more, prompt tokens
            ahead of a new arrival.
        max_num_batched_tokens: the step's token budget.
    """
    num_rows = num_decode_context = 0
    num_prompt = num_prompt_context = 0
    for request in requests:
        num_left = request.num_tokens - request.num_computed_tokens
        if num_left <= 1:
            num_rows += 1
            num_decode_context += attended(1, request.num_computed_tokens)
        else:
            num_prompt += num_left
            num_prompt_context += attended(num_left, request.num_computed_tokens)
    room = max(max_num_batched_tokens - num_rows, 1)
    num_steps = -(-num_prompt // room) if num_prompt else int(num_rows > 0)
    if num_steps == 0:
        return 0.0
    # Each step with prompt tokens leaves the decode-only fast path (the prompt-chunk term);
    # the prompts' keys are prompt work (step_time.py).
    per_step = StepShape(num_prefill_chunks=int(num_prompt > 0))
    total = StepShape(
        num_prefill_tokens=num_prompt,
        num_decode_rows=num_rows * num_steps,
        num_context_tokens=num_prompt_context + num_decode_context * num_steps,
        num_prefill_chunks=per_step.num_prefill_chunks,
        num_prefill_context=num_prompt_context,
    )
    return model.predict(total) + (num_steps - 1) * model.predict(per_step)
