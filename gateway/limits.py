"""Bounds the gateway puts on what clients send and how much they ask of it at once.

`BodyLimit` (ASGI): a request body over `max_bytes` (`--max-request-bytes`) gets a 413 in
OpenAI's error body at once: from its Content-Length when it has one, else as soon as the
chunks received pass the bound. Nothing over the bound is buffered or parsed, so one huge body
cannot hold the event loop that serves every other stream.

`InFlight`: at most `--max-in-flight` requests (prompts of a batch count one each) are served
at once; one more gets a 429 with Retry-After at once instead of a long wait and a timeout.
Workers bound their own queues the same way (RESOURCE_EXHAUSTED, which reaches the client as a
429 too). A batch of more prompts than the bound could never be admitted: a 400 naming the flag,
not a 429 that invites retrying it.
"""

from __future__ import annotations

import json

from gateway.errors import GatewayError

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
DEFAULT_MAX_IN_FLIGHT = 1024


class Slots:
    """Slots taken from an InFlight; release() (idempotent) gives them back."""

    def __init__(self, owner: "InFlight", n: int) -> None:
        self._owner, self._n = owner, n

    def release(self) -> None:
        n, self._n = self._n, 0
        self._owner.used -= n


class InFlight:
    """The gateway's bound on requests served at once (0: no bound)."""

    def __init__(self, limit: int = DEFAULT_MAX_IN_FLIGHT, metrics=None,
                 retry_after_s: float = 1.0) -> None:
        self.limit = limit
        self.used = 0
        self.metrics = metrics
        self.retry_after_s = retry_after_s

    def take(self, n: int = 1) -> Slots:
        """n slots (a request's prompts), or GatewayError: 429 (Retry-After) when fewer are
        free, 400 when the bound is below n (no wait would help)."""
        if self.limit and n > self.limit:
            raise GatewayError(f"this request has {n} prompts and each is served as a request "
                               f"of its own; the gateway serves at most {self.limit} at once "
                               f"(--max-in-flight {self.limit}): send at most {self.limit} "
                               "prompts per request", status=400, param="prompt")
        if self.limit and self.used + n > self.limit:
            if self.metrics is not None:
                self.metrics.overloaded.inc()
            raise GatewayError(f"the server is at its bound of {self.limit} requests in flight "
                               "(--max-in-flight); try again shortly", status=429,
                               code="overloaded", retry_after=self.retry_after_s)
        self.used += n
        return Slots(self, n)


def too_large(max_bytes: int) -> GatewayError:
    return GatewayError(f"the request body is larger than this server accepts ({max_bytes} "
                        "bytes; --max-request-bytes)", status=413, code="request_too_large")


class BodyLimit:
    def __init__(self, app, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, send) -> None:
        body = json.dumps(too_large(self.max_bytes).body()).encode("utf-8")
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.max_bytes <= 0:
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared > self.max_bytes:
                return await self._refuse(send)
            return await self.app(scope, receive, send)    # the server holds it to that length
        # no declared length (chunked): gather up to the bound, then hand it over in one piece
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return                                          # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send)
            more = message.get("more_body", False)
        first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()                           # disconnects, as usual
        await self.app(scope, replay, send)
