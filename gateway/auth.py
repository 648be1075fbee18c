"""Who may use the gateway: API keys on REST (`Authorization: Bearer KEY`) and gRPC (the same
`authorization` metadata), and TLS on both.

Keys come from `--api-key` (repeatable), `--api-key-file` (one key per line; blank lines and
`#` comments skipped) and the PDSERVE_API_KEY environment variable (comma-separated: the way to
hand keys to `pdserve up` without putting them on any command line). No key configured: the
gateway is open. Keys are compared in constant time and never logged. `/health` and `/metrics`
stay open unless `--protect-metrics`.
"""

from __future__ import annotations

import hmac
import json
import os
from pathlib import Path
from typing import Iterable

import grpc

from gateway.errors import GatewayError

ENV_VAR = "PDSERVE_API_KEY"
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/ping"})
PROTECTED_SERVICE = "/pdserve.v1.Generation/"


class ApiKeys:
    """The accepted keys (empty: authentication off)."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._keys = [k.encode("utf-8") for k in dict.fromkeys(keys) if k]

    @classmethod
    def from_sources(cls, flags: Iterable[str] | None = None, file: str | None = None,
                     env: str | None = None) -> "ApiKeys":
        keys = [k.strip() for k in flags or () if k.strip()]
        if file:
            path = Path(file)
            if not path.is_file():
                raise SystemExit(f"--api-key-file {file}: no such file")
            for line in path.read_text(encoding="utf-8").splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(line)
        env = os.environ.get(ENV_VAR, "") if env is None else env
        keys += [k.strip() for k in env.split(",") if k.strip()]
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def first(self) -> str | None:
        """One accepted key (a process probing its own gateway), or None."""
        return self._keys[0].decode("utf-8") if self._keys else None

    def accepts(self, authorization: str | bytes | None) -> bool:
        """An `Authorization` header / metadata value "Bearer KEY" with a known key."""
        if not self._keys:
            return True
        if authorization is None:
            return False
        if isinstance(authorization, str):
            authorization = authorization.encode("utf-8", "replace")
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        ok = False
        for key in self._keys:          # every key compared: timing says nothing of which
            ok |= hmac.compare_digest(token, key)
        return ok


def unauthorized() -> GatewayError:
    return GatewayError("invalid or missing API key: send it as `Authorization: Bearer <key>`",
                        status=401, code="invalid_api_key")


class AuthMiddleware:
    """ASGI: every HTTP request but the open paths needs an accepted key (401 otherwise)."""

    def __init__(self, app, keys: ApiKeys, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if (scope["type"] == "http" and self.keys.enabled
                and scope.get("path") not in self.open_paths):
            header = dict(scope.get("headers") or ()).get(b"authorization")
            if not self.keys.accepts(header):
                body = json.dumps(unauthorized().body()).encode("utf-8")
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"www-authenticate", b"Bearer"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """gRPC: the Generation service needs `authorization: Bearer KEY` metadata
    (UNAUTHENTICATED otherwise); the health service stays open."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, details):
        if not self.keys.enabled or not details.method.startswith(PROTECTED_SERVICE):
            return await continuation(details)
        value = next((v for k, v in details.invocation_metadata or ()
                      if k == "authorization"), None)
        if self.keys.accepts(value):
            return await continuation(details)

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, unauthorized().message)
            yield                                   # never reached: a server stream

        return grpc.unary_stream_rpc_method_handler(refuse)


def grpc_credentials(certfile: str, keyfile: str, ca_certs: str | None = None):
    """Server TLS credentials; with `ca_certs`, clients must present a certificate it signed."""
    cert = Path(certfile).read_bytes()
    key = Path(keyfile).read_bytes()
    ca = Path(ca_certs).read_bytes() if ca_certs else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=ca is not None)
