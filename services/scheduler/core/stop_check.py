"""Token-level stop conditions, checked by the engine core after every appended token.

Stop strings need text, so the api checks them and aborts the request in the core.
"""

from __future__ import annotations

from kvserve.services.scheduler.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Finish the request if its last output token ends it.

    Sets `request.status` (and `stop_reason` for a stop token) when it does.

    Args:
        request: a request whose last token was just appended.
        max_model_len: the engine's longest sequence.

    Returns:
        True if the request is now finished.
    """
    sampling_params = request.sampling_params
    # min_tokens only suppresses EOS and stop tokens: the length caps still apply.
    if request.num_output_tokens >= sampling_params.min_tokens:
        last_token_id = request.output_token_ids[-1]
        if not sampling_params.ignore_eos and last_token_id == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last_token_id in request.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    max_tokens = request.max_tokens
    if (
        max_tokens is not None and request.num_output_tokens >= max_tokens
    ) or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
