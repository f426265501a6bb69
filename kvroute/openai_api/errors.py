"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Clients (the official SDKs included) pick their exception class from the HTTP status and show the
``message``; the gateway and the replicas raise :class:`APIError` anywhere below a handler and turn
it into this JSON at the edge, so both speak the same error dialect. Torch-free on purpose.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


def error_type_for_status(status: int) -> str:
    """OpenAI's ``error.type`` for an HTTP status (client errors default to invalid_request_error)."""
    if status in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status]
    return "server_error" if status >= 500 else "invalid_request_error"


class APIError(Exception):
    """An error a client should see as an OpenAI error object with HTTP ``status``."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or error_type_for_status(status)
        self.param = param
        self.code = code
        self.headers = headers  # e.g. retry-after on a 503, connection: close on a 408

    def to_dict(self) -> dict[str, Any]:
        """The JSON body, also used as the payload of a streamed SSE error event."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=self.status, headers=self.headers)


ECHO_LIMIT = 100
"""Characters of a client's own value (a model name) an error message repeats at most."""


def echo(value: str) -> str:
    """A client's value as an error message repeats it: a 1 MB model name is not a 1 MB reply."""
    return value if len(value) <= ECHO_LIMIT else f"{value[:ECHO_LIMIT]}… ({len(value)} characters)"


def model_not_found(model: str) -> APIError:
    """OpenAI's exact 404 for a model name this server does not serve."""
    return APIError(
        f"The model `{echo(model)}` does not exist or you do not have access to it.",
        404,
        param="model",
        code="model_not_found",
    )


def internal_error(message: str = "Internal server error.") -> APIError:
    """A 500 that tells the client nothing about internals (the traceback goes to the log)."""
    return APIError(message, 500, code="internal_error")
