"""The one error type of the gateway, rendered as an OpenAI error body or a gRPC status."""

from __future__ import annotations

import grpc

_GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class GatewayError(Exception):
    """A request the gateway refuses or cannot complete.

    `status` is the HTTP status (400 bad input, 404 unknown model, 429 overloaded, 503 no worker
    / worker down, 500 worker failure); `param` names the offending request field; `code` is
    OpenAI's error code; `retry_after` (seconds) goes out as the Retry-After header (REST) or
    the retry-after trailing metadata (gRPC).
    """

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str | None = None, retryable: bool = False,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.retryable = retryable     # a worker went away: the request may run elsewhere
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        if self.status == 429:
            return "rate_limit_error"
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def headers(self) -> dict[str, str]:
        """HTTP headers the error response carries (Retry-After, whole seconds)."""
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, int(-(-self.retry_after // 1))))}

    def body(self) -> dict:
        """OpenAI's error body: {"error": {"message", "type", "param", "code"}}; always
        encodable (a lone surrogate quoted from the request is written as an escape)."""
        return {"error": {"message": printable(self.message), "type": self.type,
                          "param": None if self.param is None else printable(self.param),
                          "code": self.code}}

    def grpc_code(self) -> grpc.StatusCode:
        return _GRPC_CODES.get(self.status, grpc.StatusCode.INTERNAL)


def printable(text: str) -> str:
    """TEXT with any lone surrogate written as a \\udXXX escape: always UTF-8 encodable."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(message, status=400, param=param)
