"""Liveness probes shared by `pdserve up` and the container healthchecks.

Workers answer the standard gRPC health service (`grpc.health.v1.Health/Check`): service ""
is readiness (SERVING once the worker is registered, NOT_SERVING from its drain on or when its
engine died), service "pdserve.liveness" liveness (SERVING while the process serves RPCs, which
a long engine step does not stop; NOT_SERVING once the engine died). The gateway answers `GET
/health` with 200 while it runs (liveness) and `GET /ready` with 200 only while it has a worker
of each role and is not draining. Torch-free.

    python -m cluster.health grpc 127.0.0.1:50061      # exit 0 when SERVING
    python -m cluster.health grpc 127.0.0.1:50061 pdserve.liveness
    python -m cluster.health http http://127.0.0.1:8000/health
"""

from __future__ import annotations

import json
import ssl
import sys
import urllib.error
import urllib.request


LIVENESS_SERVICE = "pdserve.liveness"


def grpc_serving(address: str, timeout_s: float = 2.0, service: str = "") -> bool:
    """True when the gRPC server at host:port reports SERVING for `service` ("": readiness)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def unverified_context(certfile: str | None = None, keyfile: str | None = None
                       ) -> ssl.SSLContext:
    """A client TLS context that does not check the server's certificate (a process probing its
    own child on 127.0.0.1), presenting certfile/keyfile when given (a server under mutual TLS).
    ssl.SSLError or OSError when they cannot be loaded."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if certfile:
        context.load_cert_chain(certfile, keyfile)
    return context


def get_json(url: str, timeout_s: float = 2.0, headers: dict | None = None,
             context: ssl.SSLContext | None = None) -> dict:
    """The JSON body of GET url. Raises what urllib raises: HTTPError for a status other than
    2xx, URLError or OSError (ssl.SSLError among them) when no answer came, ValueError for a
    body that is not JSON."""
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                timeout=timeout_s, context=context) as resp:
        return json.loads(resp.read())


def http_json(url: str, timeout_s: float = 2.0, headers: dict | None = None,
              verify: bool = True) -> dict | None:
    """The JSON body of GET url when it answers 200, else None. `verify` False: an https
    server's certificate is not checked."""
    context = unverified_context() if url.startswith("https") and not verify else None
    try:
        return get_json(url, timeout_s, headers, context)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when GET url answers 200 with a JSON body."""
    return http_json(url, timeout_s) is not None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not (argv[:1] == ["grpc"] and len(argv) in (2, 3) or argv[:1] == ["http"] and len(argv) == 2):
        print("usage: python -m cluster.health grpc HOST:PORT [SERVICE] | http URL",
              file=sys.stderr)
        return 2
    ok = (grpc_serving(argv[1], service=argv[2] if len(argv) == 3 else "") if argv[0] == "grpc"
          else http_ok(argv[1]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
