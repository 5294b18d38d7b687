"""APIError: what the client caused (or a server state it must know), as an HTTP error.

Every layer of the api raises it, from the engine client (a full queue is a 429) to a
surface's checks; each surface turns it into its own error body (OpenAI's `to_body` here,
Anthropic's in surfaces/anthropic_protocol.py).
"""

from __future__ import annotations

import msgspec


class APIError(Exception):
    """An error the client caused (or a server state it must know), as an HTTP response.

    Args:
        status_code: the HTTP status.
        message: what went wrong and how to fix it.
        param: the request field at fault, if one is.
        err_type: OpenAI's error type; derived from the status when None.
        headers: response headers (a 429's Retry-After).
    """

    _TYPES = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        405: "MethodNotAllowedError",
        409: "ConflictError",
        413: "BadRequestError",
        429: "RateLimitError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }

    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        err_type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.headers = headers
        self.status_code = status_code
        self.message = message
        self.param = param
        self.err_type = err_type or self._TYPES.get(status_code, "BadRequestError")

    def to_body(self) -> ErrorResponse:
        return ErrorResponse(ErrorInfo(self.message, self.err_type, self.param, self.status_code))


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo
