"""A failed worker call as the client's GatewayError: the status it maps to, and its message
with no worker id or address in it (the log has those)."""

from __future__ import annotations

import logging
import re
from typing import Iterable

import grpc

from cluster.registry import WorkerInfo
from gateway.errors import GatewayError

log = logging.getLogger(__name__)


# What a worker's error text may hold that a client must not see: addresses (ipv4:1.2.3.4:5,
# [::1]:5, host:port) and default worker ids (decode-HOST-PORT).
_ADDRESS = re.compile(r"\b(?:prefill|decode)-[\w.:\[\]-]+-\d+\b"             # worker ids
                      r"|(?:\bipv[46]:)?(?:\[[0-9a-fA-F:.]+\]"                  # [v6]
                      r"|\b\d{1,3}(?:\.\d{1,3}){3}\b)(?::\d+)?"                  # v4
                      r"|\b[\w.-]+:\d{2,5}\b")                                  # host:port


def scrub(text: str, workers: Iterable[WorkerInfo] = ()) -> str:
    """`text` without worker ids and addresses: the ids and addresses of `workers`, then
    anything that looks like an address or a default worker id."""
    for w in workers:
        text = text.replace(w.id, "<worker>").replace(w.address, "<address>")
    return _ADDRESS.sub("<address>", text)


def worker_error(what: str, worker: WorkerInfo, exc: grpc.aio.AioRpcError,
                 known: Iterable[WorkerInfo] = ()) -> GatewayError:
    """The client's error for a failed worker call: the worker's words for a bad request, else
    the role, the status and the worker's details scrubbed of ids and addresses."""
    code = exc.code()
    details = exc.details() or ""
    log.warning("%s worker %s at %s failed: %s: %s", what, worker.id, worker.address, code.name,
                details)
    clean = scrub(details, [worker, *known])
    message = f"the {what} worker failed: {code.name}" + (f": {clean}" if clean else "")
    if code == grpc.StatusCode.INVALID_ARGUMENT:     # the request's fault: the worker's words
        return GatewayError(clean or message, status=400)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED):
        # the worker is gone (or shutting down), or (ABORTED) the KV transfer between the
        # workers failed
        return GatewayError(message, status=503, code="worker_unavailable", retryable=True)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:   # its queue is full: come back shortly
        return GatewayError(f"the {what} worker is overloaded; retry shortly", status=429,
                            code="overloaded", retry_after=retry_after(exc))
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayError(message, status=504, code="worker_timeout")
    return GatewayError(message, status=500, code="worker_error")


def retry_after(exc: grpc.aio.AioRpcError, default: float = 1.0) -> float:
    """The worker's retry-after trailer (seconds), or `default`."""
    for key, value in exc.trailing_metadata() or ():
        if key == "retry-after":
            try:
                return max(float(value), 0.0)
            except ValueError:
                break
    return default
