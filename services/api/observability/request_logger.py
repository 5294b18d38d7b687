"""--enable-log-requests: one log line per request as it is submitted, as vLLM's RequestLogger.

    Received request cmpl-9f..-0: prompt: 'The capital of', params: SamplingParams(...),
    prompt_token_ids: [504, 3575, 282].

`--max-log-len N` keeps the first N characters of the prompt and its first N token ids.
"""

from __future__ import annotations

import contextvars

from kvserve.shared.logging import init_logger
from kvserve.shared.sampling_params import SamplingParams

logger = init_logger(__name__)

# The name of the API key that authenticated the request being handled (None without keys):
# auth.APIKeyMiddleware sets it, and the request log lines name it (never the key).
API_KEY_NAME: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvserve_api_key_name", default=None
)


def key_name_suffix() -> str:
    """' (API key NAME)' while a named key's request is handled, else ''."""
    name = API_KEY_NAME.get()
    return "" if name is None else f" (API key {name!r})"


class RequestLogger:
    """
    Args:
        max_log_len: characters of the prompt, and token ids, to log (None: all of them).
    """

    def __init__(self, max_log_len: int | None = None):
        self.max_log_len = max_log_len

    def log_inputs(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        """Log one engine request.

        Args:
            request_id: the id the engine knows it by.
            prompt: its text (None when it came as token ids).
            prompt_token_ids: its tokens.
            params: its sampling parameters.
        """
        if self.max_log_len is not None:
            if prompt is not None:
                prompt = prompt[: self.max_log_len]
            prompt_token_ids = prompt_token_ids[: self.max_log_len]
        logger.info(
            "Received request %s%s: prompt: %r, params: %s, prompt_token_ids: %s.",
            request_id,
            key_name_suffix(),
            prompt,
            params,
            prompt_token_ids,
        )
