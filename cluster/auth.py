"""The deployment's credential: a shared secret every process of one pdserve deployment holds.

Why a shared token and not mutual TLS: one secret covers every path the same way (the workers'
gRPC services, the gRPC KV stream, the registrations in Redis, which are signed with it), it
needs no certificate authority, and `pdserve up` makes a fresh one for every local stack without
the operator doing anything. What it does not do is encrypt: on a network an attacker can read,
run the workers behind TLS or a private network (the gateway's own REST and gRPC have TLS).

Where it comes from: `--cluster-token-file FILE` or the PDSERVE_CLUSTER_TOKEN environment
variable (`pdserve up` sets it for its children), read once by a process's main
(`ClusterAuth.from_sources`) and passed to what needs it: the worker's server, the gateway's
router, the KV transports, the registry. No token: the deployment is open, as before.

- Worker gRPC services (DecodeWorker, PrefillWorker, PushKV included) refuse calls without the
  token (UNAUTHENTICATED); the health service stays open.
- Channels from `channel()` attach it to every call.
- `sign()` / `verify()`: an HMAC-SHA256 of a registration's fields, so a process that can write
  to Redis but does not hold the token cannot register a worker.

Torch-free: the gateway imports this. The token never appears in logs or error messages.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from pathlib import Path
from types import MappingProxyType
from typing import Iterable

import grpc

ENV_VAR = "PDSERVE_CLUSTER_TOKEN"
METADATA_KEY = "x-pdserve-cluster-token"
PROTECTED_PREFIXES = ("/pdserve.v1.DecodeWorker/", "/pdserve.v1.PrefillWorker/")
_STREAMING = MappingProxyType({"/pdserve.v1.DecodeWorker/Decode": "unary_stream",
                               "/pdserve.v1.DecodeWorker/PushKV": "stream_stream"})
_SIGNATURE_CONTEXT = b"pdserve-registration-v1\n"
# Keepalive on every channel of a deployment: a peer that vanishes without closing its TCP
# connection (a killed host, a cut cable) is noticed within ~30 s instead of never. Servers
# accept the clients' pings (gRPC's default would answer them with GOAWAY "too_many_pings").
CLIENT_KEEPALIVE = (("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000),
                    ("grpc.keepalive_permit_without_calls", 1),
                    ("grpc.http2.max_pings_without_data", 0))
SERVER_KEEPALIVE = (("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000),
                    ("grpc.keepalive_permit_without_calls", 1),
                    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                    ("grpc.http2.max_pings_without_data", 0))


class ClusterAuth:
    """The deployment token (None: authentication off)."""

    def __init__(self, token: str | bytes | None = None) -> None:
        if isinstance(token, str):
            token = token.strip().encode("utf-8")
        self._token = token or None

    @classmethod
    def from_sources(cls, file: str | None = None, env: str | None = None) -> "ClusterAuth":
        """From a file (its first non-empty, non-comment line) or else the environment."""
        if file:
            path = Path(file)
            if not path.is_file():
                raise SystemExit(f"--cluster-token-file {file}: no such file")
            for line in path.read_text(encoding="utf-8").splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    return cls(line)
            raise SystemExit(f"--cluster-token-file {file}: the file holds no token")
        return cls(os.environ.get(ENV_VAR, "") if env is None else env)

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def __repr__(self) -> str:            # never the token itself
        return f"ClusterAuth(enabled={self.enabled})"

    # ------------------------------------------------------------------ gRPC
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((METADATA_KEY, self._token.decode("utf-8")),) if self._token else ()

    def accepts(self, value: str | bytes | None) -> bool:
        if self._token is None:
            return True
        if value is None:
            return False
        if isinstance(value, str):
            value = value.encode("utf-8", "replace")
        return hmac.compare_digest(value, self._token)

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [_TokenInterceptor(self)] if self.enabled else []

    def channel(self, address: str, options: Iterable = ()) -> grpc.aio.Channel:
        """An insecure aio channel with keepalive whose every call carries the token."""
        interceptors = _client_interceptors(self.metadata()) if self.enabled else None
        return grpc.aio.insecure_channel(address, options=[*CLIENT_KEEPALIVE, *options],
                                         interceptors=interceptors)

    # ------------------------------------------------------------------ registrations
    def sign(self, fields: dict[str, str]) -> str:
        """HMAC-SHA256 (hex) of the fields (name=value lines, sorted); "" when off."""
        if self._token is None:
            return ""
        return hmac.new(self._token, _SIGNATURE_CONTEXT + _canonical(fields),
                        hashlib.sha256).hexdigest()

    def verify(self, fields: dict[str, str], signature: str | None) -> bool:
        if self._token is None:
            return True
        return bool(signature) and hmac.compare_digest(self.sign(fields), signature)


def _canonical(fields: dict[str, str]) -> bytes:
    return "".join(f"{k}={fields[k]}\n" for k in sorted(fields)).encode("utf-8")


def unauthenticated_message() -> str:
    return ("missing or wrong deployment token: every process of a deployment needs the same "
            f"--cluster-token-file or ${ENV_VAR}")


class _TokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, auth: ClusterAuth) -> None:
        self.auth = auth

    async def intercept_service(self, continuation, details):
        method = details.method or ""
        if not method.startswith(PROTECTED_PREFIXES):
            return await continuation(details)
        value = next((v for k, v in details.invocation_metadata or () if k == METADATA_KEY),
                     None)
        if self.auth.accepts(value):
            return await continuation(details)
        return refusal(_STREAMING.get(method, "unary_unary"), grpc.StatusCode.UNAUTHENTICATED,
                       unauthenticated_message())


_REFUSAL_DRAIN_MESSAGES = 64
_REFUSAL_DRAIN_SECONDS = 1.0


def refusal(kind: str, code: grpc.StatusCode, message: str):
    """A method handler of that kind (unary_unary, unary_stream, stream_stream)
    that ends the call with `code` and `message` (a server interceptor's answer instead of the
    servicer's)."""
    async def refuse(request, context):
        await context.abort(code, message)

    async def refuse_client_stream(requests, context):
        # Read what the client has already sent before answering: a client write that
        # fails because the call has ended makes grpc's asyncio client report INTERNAL in
        # place of our status (grpc/grpc#36066). Bounded in messages and time, so a
        # refused client cannot keep the server reading.
        async def drain():
            count = 0
            async for _ in requests:
                count += 1
                if count >= _REFUSAL_DRAIN_MESSAGES:
                    return
        try:
            await asyncio.wait_for(drain(), _REFUSAL_DRAIN_SECONDS)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError):
            pass
        await context.abort(code, message)

    async def refuse_stream(request, context):
        await context.abort(code, message)
        yield                                   # never reached: a server stream

    if kind == "unary_stream":
        return grpc.unary_stream_rpc_method_handler(refuse_stream)
    if kind == "stream_stream":
        return grpc.stream_stream_rpc_method_handler(refuse_client_stream)
    return grpc.unary_unary_rpc_method_handler(refuse)


def _with_metadata(details: grpc.aio.ClientCallDetails, extra) -> grpc.aio.ClientCallDetails:
    metadata = list(details.metadata or ()) + list(extra)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                      details.credentials, details.wait_for_ready)


def _client_interceptors(extra) -> list:
    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, details, request):
            return await continuation(_with_metadata(details, extra), request)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, details, request):
            return await continuation(_with_metadata(details, extra), request)

    class StreamStream(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation, details, request_iterator):
            return await continuation(_with_metadata(details, extra), request_iterator)

    return [UnaryUnary(), UnaryStream(), StreamStream()]

