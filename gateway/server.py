"""`pdserve gateway`: one asyncio loop serving REST (uvicorn + FastAPI) on --http-port, the gRPC
Generate API on --grpc-port, and polling Redis for workers. SIGINT/SIGTERM stop it cleanly.

Torch-free by design (a test checks that importing this module pulls in neither torch nor
transformers).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
from pathlib import Path
from ssl import CERT_REQUIRED

import grpc
import uvicorn

from gateway.auth import OPEN_PATHS, ApiKeys, AuthInterceptor, AuthMiddleware, grpc_credentials
from gateway.grpc_api import add_services
from gateway.limits import DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_REQUEST_BYTES, BodyLimit, InFlight
from gateway.openai_api import create_app
from gateway.params import RequestPreparer, ServedModel
from gateway.pipeline import Pipeline, PipelineConfig
from gateway.router import CHANNEL_OPTIONS, Router
from gateway.tokenizer import Tokenizer
from cluster.auth import SERVER_KEEPALIVE, ClusterAuth
from cluster.metrics import GatewayMetrics
from cluster.paths import resolve_model
from cluster.registry import RedisSettings, redacted
from cluster.tracing import Tracing

log = logging.getLogger(__name__)


def served_model(model_dir: Path, name: str | None, max_model_len: int,
                 max_tokens_default: int = 0, tool_call_parser: str | None = None) -> ServedModel:
    """The served name (default: the folder's name), context limit (default: config.json's
    max_position_embeddings), output bound of a chat request without max_tokens (0: the
    context left) and tool-call parser (none: tools are refused)."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    limit = max_model_len or int(config.get("max_position_embeddings") or 0)
    if not limit:
        raise SystemExit(f"{model_dir}/config.json has no max_position_embeddings; "
                         "pass --max-model-len")
    return ServedModel(name=name or model_dir.name, max_model_len=limit,
                       max_tokens_default=max_tokens_default,
                       tool_call_parser=tool_call_parser or "")


def kv_shape(model_dir: Path) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of the model's KV, as its workers register it."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    heads = config["num_attention_heads"]
    return (config["num_hidden_layers"], config.get("num_key_value_heads") or heads,
            config.get("head_dim") or config["hidden_size"] // heads)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the gateway owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve(args: argparse.Namespace) -> None:
    """Run the gateway until SIGINT/SIGTERM (or until the HTTP server stops)."""
    model_dir = resolve_model(args.model)
    served = served_model(model_dir, args.served_model_name, args.max_model_len,
                          args.max_tokens_default, args.tool_call_parser)
    preparer = RequestPreparer(Tokenizer(model_dir), served)
    metrics = GatewayMetrics()
    metrics.set_slo(getattr(args, "slo_ttft", 0.0), getattr(args, "slo_tpot", 0.0))
    auth = ClusterAuth.from_sources(getattr(args, "cluster_token_file", None))
    redis_settings = RedisSettings.from_sources(getattr(args, "redis_password_file", None),
                                                getattr(args, "redis_ca_cert", None))
    router = Router(args.redis_url, routing=args.routing, metrics=metrics,
                    expected_shape=kv_shape(model_dir), auth=auth,
                    redis_settings=redis_settings)
    tracing = Tracing.from_args(args, "pdserve-gateway")    # both front doors use pipeline's
    pipeline = Pipeline(router, preparer.tokenizer, _pipeline_config(args), metrics, tracing)
    pipeline.loras.known.update(dict(getattr(args, "lora_modules", None) or ()))
    preparer.adapters = pipeline.loras.names   # a request's `model` may name an adapter

    keys = ApiKeys.from_sources(getattr(args, "api_key", None),
                                getattr(args, "api_key_file", None))
    tls = _tls(args)
    grpc_server = grpc.aio.server(options=[*CHANNEL_OPTIONS, *SERVER_KEEPALIVE],
                                  interceptors=[AuthInterceptor(keys)])
    admission = InFlight(getattr(args, "max_in_flight", DEFAULT_MAX_IN_FLIGHT), metrics)
    health = await add_services(grpc_server, preparer, pipeline, admission)
    address = f"{args.host}:{args.grpc_port}"
    grpc_port = (grpc_server.add_secure_port(address, grpc_credentials(*tls)) if tls
                 else grpc_server.add_insecure_port(address))
    if not grpc_port:
        raise SystemExit(f"cannot bind the gRPC port {args.host}:{args.grpc_port}")
    app = create_app(preparer, pipeline, router, admission)
    open_paths = frozenset() if getattr(args, "protect_metrics", False) else OPEN_PATHS
    ssl = {}
    if tls:
        ssl = dict(ssl_certfile=tls[0], ssl_keyfile=tls[1])
        if tls[2]:
            ssl.update(ssl_ca_certs=tls[2], ssl_cert_reqs=CERT_REQUIRED)
    front = BodyLimit(AuthMiddleware(app, keys, open_paths),
                      getattr(args, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES))
    drain_s = getattr(args, "drain_timeout", 0.0)
    http = _Uvicorn(uvicorn.Config(front, host=args.host,
                                   port=args.http_port, log_level=args.log_level.lower(),
                                   lifespan="off", access_log=False,
                                   timeout_graceful_shutdown=drain_s, **ssl))

    loop = asyncio.get_running_loop()
    grpc_stopped: list[asyncio.Task] = []

    def on_signal() -> None:
        """The first signal drains: /ready answers 503, no new connection is taken, the
        streams running get --drain-timeout to end (gRPC ones too); a second one exits now."""
        if http.should_exit:
            http.force_exit = True
            return
        log.info("gateway draining: %d requests in flight get %g s to end (a second signal "
                 "ends them now)", admission.used, drain_s)
        app.state.draining = True
        http.should_exit = True
        grpc_stopped.append(loop.create_task(grpc_server.stop(grace=drain_s)))
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    await router.start()
    await grpc_server.start()
    log.info("gateway serving %s (max_model_len %d, max_tokens_default %d, tool calls %s, "
             "%s, %s): REST %s://%s:%d, gRPC %s:%d%s, redis %s", served.name,
             served.max_model_len, served.max_tokens_default, served.tool_call_parser or "off",
             f"{len(keys)} API key(s)" if keys.enabled else "no API key: open to anyone",
             "deployment token set" if auth.enabled else "no deployment token: workers open",
             "https" if tls else "http", args.host, args.http_port, args.host, grpc_port,
             " (TLS)" if tls else "", redacted(args.redis_url))
    try:
        await http.serve()
    finally:
        log.info("gateway shutting down")
        await health.enter_graceful_shutdown()
        if grpc_stopped:
            await grpc_stopped[0]
        else:
            await grpc_server.stop(grace=drain_s)
        await pipeline.stop()
        await router.stop()
        tracing.shutdown()          # sends the spans still buffered
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _pipeline_config(args) -> PipelineConfig:
    return PipelineConfig(local_prefill_max_tokens=args.local_prefill_max_tokens,
                          local_prefill_queue=args.local_prefill_queue,
                          local_prefill_share=args.local_prefill_share,
                          max_migrations=getattr(args, "max_migrations", 2),
                          stream_stall_timeout_s=getattr(args, "stream_stall_timeout", 120.0),
                          worker_probe_timeout_s=getattr(args, "worker_probe_timeout", 5.0))


def _tls(args) -> tuple[str, str, str | None] | None:
    """(certfile, keyfile, client CA or None) when TLS is asked for."""
    cert, key = getattr(args, "ssl_certfile", None), getattr(args, "ssl_keyfile", None)
    ca = getattr(args, "ssl_ca_certs", None)
    if not cert and not key:
        if ca:
            raise SystemExit("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile")
        return None
    if not (cert and key):
        raise SystemExit("TLS needs both --ssl-certfile and --ssl-keyfile")
    return cert, key, ca


def main(args: argparse.Namespace) -> int:
    asyncio.run(serve(args))
    return 0
