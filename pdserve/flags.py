"""The flags of the serving processes (`pdserve prefill`, `decode`, `gateway`) and the pieces
tools share (--model, the deployment's credentials, the CPU paths, the help formatter). Torch-free:
building a parser imports nothing heavy."""

from __future__ import annotations

import argparse
import shlex

from cluster.paths import default_model_dir
from cluster.tracing import PROTOCOLS as OTLP_PROTOCOLS

# engine.config.QUANTIZATION_CHOICES (written out here: --help does not import torch)
QUANTIZATION_CHOICES = ["none", "int8", "gptq", "awq", "compressed-tensors", "w4a16", "w8a8"]
# engine.config.LINEAR_METHODS and CPU_ATTENTION, likewise
LINEAR_METHODS = ["auto", "avx2", "avx512", "amx", "onednn", "torch"]
CPU_ATTENTION = ["auto", "avx2", "sdpa"]
MOE_BACKENDS = ["auto", "reference", "grouped", "triton"]       # engine.config.MOE_BACKENDS

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


def add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="local HF-format model folder (the families of docs/models.md); "
                        f"default: the fetched SmolLM2-135M-Instruct ({default_model_dir()})")
    p.add_argument("--served-model-name", default=None,
                   help="name clients use in the 'model' field (default: the folder name)")


def add_deployment_security(p: argparse.ArgumentParser) -> None:
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


def add_tracing(p: argparse.ArgumentParser) -> None:
    """OpenTelemetry tracing (cluster/tracing.py); every process has it, `pdserve up` passes it
    to all three."""
    g = p.add_argument_group("tracing (OpenTelemetry)")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send request traces over OTLP to this collector, e.g. "
                        "http://127.0.0.1:4317 (off unless set here or in "
                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT)")
    g.add_argument("--otlp-traces-protocol", default=None, choices=OTLP_PROTOCOLS,
                   help="OTLP over gRPC or HTTP/protobuf (default: "
                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else grpc)")


def add_cpu_paths(p: argparse.ArgumentParser) -> None:
    """--linear-method and --cpu-attention: force a CPU path (workers, stepbench)."""
    p.add_argument("--linear-method", default="auto", choices=LINEAR_METHODS,
                   help="the linear layers' CPU path: avx2 (our kernel: any x86 CPU with AVX2 "
                        "and FMA, AVX-512 ones too), avx512 (the same kernel built for AVX-512F: "
                        "the same results), amx (fp32 as three bf16 products on Intel AMX "
                        "tiles, Sapphire Rapids and later; float weights only), onednn (torch's "
                        "oneDNN packed linear; float weights only), torch (F.linear; integer "
                        "weights dequantized); auto: what measured fastest on this kind of host "
                        "(amx on Intel AMX hosts, avx512 on other Intel AVX-512 hosts, avx2 "
                        "where the best ISA is AVX2 and on AMD Zen 4, onednn on other AVX-512 "
                        "hosts)")
    p.add_argument("--cpu-attention", default="auto", choices=CPU_ATTENTION,
                   help="the torch attention backend's path for decodes and short queries on "
                        "CPUs: avx2 (our kernel, blocks read in place), sdpa (gather + torch "
                        "SDPA); auto: avx2 where the best ISA is AVX2, on AMD Zen 4 and on "
                        "Intel AVX-512 hosts, sdpa on other AVX-512 hosts")


def add_worker(p: argparse.ArgumentParser, role: str, port: int) -> None:
    """The flags of `pdserve ROLE` for a worker role (prefill or decode)."""
    add_model(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind the gRPC server to")
    p.add_argument("--port", type=int, default=port, help="gRPC port (0 picks a free one)")
    p.add_argument("--advertise-host", default=None,
                   help="host other processes use to reach this worker (default: --host)")
    p.add_argument("--redis-url", default=DEFAULT_REDIS_URL, help="Redis for worker registration")
    p.add_argument("--worker-id", default=None, help=f"unique id (default: {role}-<host>-<port>)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads for this worker (0: torch's default)")
    p.add_argument("--share-cores", choices=("on", "off"), default="on",
                   help="on CPUs with --threads > 1: run each step on as many of them as the "
                        "host's other processes left idle since the last look (from /proc/stat; "
                        "at least one), so two workers computing side by side take a core each "
                        "instead of both slowing on all; off: --threads every step "
                        "(docs/performance.md, \"Sharing the cores\")")
    _add_engine(p)
    _add_kv_offload(p)
    _add_lora(p)
    _add_kv_transfer(p, role)
    p.add_argument("--max-waiting-requests", type=non_negative_int, default=256, metavar="N",
                   help="requests that may wait for a place in the batch; one more is refused "
                        "at once with RESOURCE_EXHAUSTED (429 at the gateway; 0: no bound)")
    p.add_argument("--max-request-kv-share", type=float, default=0.5, metavar="SHARE",
                   help="most of the KV pool one request (all its choices at max_tokens) may "
                        "need; larger ones are refused (default: 0.5)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="HTTP port of GET /metrics (Prometheus); default: gRPC port + 100; "
                        "0 turns it off")
    add_deployment_security(p)
    add_tracing(p)
    add_drain(p)
    p.add_argument("--log-level", default="INFO")


DEFAULT_DRAIN_S = 30.0


def add_drain(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drain-timeout", type=non_negative_float, default=DEFAULT_DRAIN_S,
                   metavar="S",
                   help="on SIGTERM: stop taking requests (readiness fails, a worker leaves the "
                        "registry), give the running ones S seconds to finish, then exit; a "
                        "decode stream still running then is moved to another decode worker by "
                        "the gateway; a second signal exits at once (default: 30)")


def _add_engine(p: argparse.ArgumentParser) -> None:
    """A worker's device, dtypes, KV pool, kernels, parallelism and scheduling budget."""
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
    add_cpu_paths(p)
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
    p.add_argument("--expert-parallel", action="store_true",
                   help="MoE models: split the experts whole over the --tensor-parallel-size "
                        "ranks (each holds about E/N experts and reads only theirs; tokens "
                        "reach their experts' ranks by all-to-all) instead of splitting every "
                        "expert's columns; attention stays tensor-parallel")
    p.add_argument("--moe-backend", default="auto", choices=MOE_BACKENDS,
                   help="how MoE experts compute: reference (a loop over the experts, the "
                        "arithmetic of HF), grouped (tokens grouped by expert through the "
                        "linear layers' own kernels, int8 experts too), triton (the fused-MoE "
                        "kernel, CUDA); auto: triton on CUDA for float weights, grouped "
                        "elsewhere")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: run decode-only steps eagerly too")
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="token budget of one engine step (0: 2048 on CUDA; on CPUs 256 for a "
                        "prefill worker, 512 otherwise)")
    p.add_argument("--max-num-seqs", type=int, default=0,
                   help="most sequences in one step (0: 256 on CUDA, 64 elsewhere)")
    p.add_argument("--long-prefill-tokens", type=int, default=0,
                   help="while requests wait, a prompt that cannot finish within a step's "
                        "budget takes at most this many tokens of it (0: a quarter of "
                        "--max-num-batched-tokens; 128 on a CPU prefill worker of the default "
                        "budget); one that can is taken whole")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="context length limit (0: the model's max_position_embeddings)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="turn the prefix cache off: every prompt is computed in full")
    p.add_argument("--hash-seed", type=int, default=0,
                   help="block hash seed; every worker of a deployment must use the same")


def _add_kv_offload(p: argparse.ArgumentParser) -> None:
    """The KV offload tiers below the pool (engine.kv_offload)."""
    g = p.add_argument_group("KV offload tiers")
    g.add_argument("--kv-offload-gib", type=non_negative_float, default=0.0, metavar="GIB",
                   help="host-memory tier below the KV pool: blocks the prefix cache evicts are "
                        "kept here and restored (checksum checked) when a prompt comes back "
                        "to them (0: off)")
    g.add_argument("--kv-offload-dir", default="", metavar="PATH",
                   help="local-disk tier's folder (with --kv-offload-disk-gib): the host tier's "
                        "least recently used blocks go here, and a restarted worker finds them "
                        "again; files of another model, dtype, layout or hash seed are ignored")
    g.add_argument("--kv-offload-disk-gib", type=non_negative_float, default=0.0, metavar="GIB",
                   help="most the disk tier holds (0: no disk tier)")
    g.add_argument("--kv-offload-min-seen", type=int, default=1, metavar="N",
                   help="admission: an evicted block is kept in a tier only when it was "
                        "computed or hit at least N times (1: every evicted block)")


def lora_module(text: str) -> tuple[str, str]:
    """argparse type of --lora-modules: NAME=PATH."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name.strip(), path.strip()


def _add_lora(p: argparse.ArgumentParser) -> None:
    """LoRA adapters (engine.lora)."""
    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters of the model (PEFT folders): a request's `model` "
                        "names one; every worker of a deployment that serves it needs it")
    g.add_argument("--lora-modules", type=lora_module, nargs="+", default=[],
                   metavar="NAME=PATH", help="adapters loaded at start (with --enable-lora)")
    g.add_argument("--max-loras", type=int, default=4, metavar="N",
                   help="adapters one step may use: their slots on the device")
    g.add_argument("--max-lora-rank", type=int, default=16, metavar="R",
                   help="the highest adapter rank served (the slots are this wide)")


def _add_kv_transfer(p: argparse.ArgumentParser, role: str) -> None:
    """How KV moves between the workers; a decode worker's speculation and KV-failure rule."""
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
        spec.add_argument("--speculative", default="auto", metavar="auto|off|ngram|draft:PATH",
                          help="propose tokens ahead and verify them in one pass: ngram = "
                               "prompt lookup; draft:PATH = a smaller model folder with the "
                               "same tokenizer (its KV is computed on this worker); auto = "
                               "ngram on a CPU worker of one process, off on GPUs and "
                               "tensor-parallel workers")
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
        spec.add_argument("--spec-max-step-growth", type=float, default=0.1,
                          help="most a step's expected time may grow over the same step "
                               "without proposals, as a share (0.1: 1.1x); bounds the time per "
                               "token of a sequence whose proposals fail (0: no bound)")
        p.add_argument("--kv-load-failure", default="fail", choices=["fail", "recompute"],
                       help="when the KV does not arrive in time: fail the request, or compute "
                            "the prompt on this decode worker")


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def add_gateway(p: argparse.ArgumentParser) -> None:
    """The flags of `pdserve gateway`; `pdserve up` passes all but GATEWAY_PLUMBING through."""
    add_model(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--http-port", type=int, default=8000, help="REST port")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC port")
    p.add_argument("--redis-url", default=DEFAULT_REDIS_URL, help="Redis for worker discovery")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="context length limit (0: the model's max_position_embeddings)")
    p.add_argument("--lora-modules", type=lora_module, nargs="+", default=[],
                   metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders on the workers' hosts) the gateway loads on "
                        "a worker that lacks one when a request names it (the workers' own "
                        "--lora-modules are loaded at their start)")
    p.add_argument("--routing", default="prefix", choices=["prefix", "load", "round-robin"],
                   help="how workers are chosen: prefix (the prefill worker holding the longest "
                        "cached prefix, weighed against its queue; Redis prefix directory), load "
                        "(fewest requests in flight) or round-robin")
    p.add_argument("--local-prefill-max-tokens", type=non_negative_int, default=1024,
                   help="prompts up to this many tokens may be computed on the decode worker "
                        "when the prefill worker is busy (conditional disaggregation; 0: never)")
    p.add_argument("--local-prefill-queue", type=non_negative_int, default=4,
                   help="'busy': this gateway has at least this many prompts outstanding on the "
                        "chosen prefill worker (0: every prompt up to --local-prefill-max-tokens "
                        "goes to the decode worker)")
    p.add_argument("--local-prefill-share", type=non_negative_float, default=0.75,
                   metavar="SHARE",
                   help="a busy prefill worker's prompt goes to the decode worker while the "
                        "decode worker's outstanding prompt tokens stay within SHARE of the "
                        "prefill worker's")
    p.add_argument("--max-migrations", type=non_negative_int, default=2, metavar="N",
                   help="a stream whose decode worker fails mid-stream goes on on another decode "
                        "worker, at most N times per request (0: the failure ends the stream; "
                        "default: 2)")
    p.add_argument("--stream-stall-timeout", type=non_negative_float, default=120.0,
                   metavar="SECONDS",
                   help="a decode stream that sends nothing for this long counts as failed: it "
                        "moves to another decode worker or ends with an error (0: off; "
                        "default: 120)")
    p.add_argument("--worker-probe-timeout", type=non_negative_float, default=5.0,
                   metavar="SECONDS",
                   help="a worker this gateway has calls on is asked for its Stats every second; "
                        "one that answers none within SECONDS is hung (a stopped process, a "
                        "stuck device): its streams move, its waiting requests run elsewhere, and "
                        "it is avoided until it answers again. A busy worker still answers (0: "
                        "off; default: 5)")
    p.add_argument("--max-tokens-default", type=non_negative_int, default=1024, metavar="N",
                   help="output tokens of a chat request that gives no max_tokens/"
                        "max_completion_tokens, capped by the context left; completions keep "
                        "OpenAI's default of 16 (0: all the context left; default: 1024)")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="how the model writes tool calls; tools are refused without one "
                        "(default: none)")
    p.add_argument("--max-request-bytes", type=non_negative_int, default=8 << 20,
                   metavar="N", help="a REST request body larger than this gets 413 before it "
                                     "is read or parsed (0: no bound; default: 8 MiB)")
    p.add_argument("--max-in-flight", type=non_negative_int, default=1024, metavar="N",
                   help="requests served at once (each prompt of a batch counts); one more gets "
                        "429 with Retry-After at once, a batch of more than N prompts a 400 "
                        "(0: no bound; default: 1024)")
    auth = p.add_argument_group("authentication and TLS")
    auth.add_argument("--api-key", action="append", default=None, metavar="KEY",
                      help="a key clients must send (REST: Authorization: Bearer KEY; gRPC: "
                           "the same authorization metadata); repeatable. Keys come from "
                           "--api-key-file and $PDSERVE_API_KEY (comma-separated) too: every "
                           "key of the three is accepted. None: the gateway is open")
    auth.add_argument("--api-key-file", default=None, metavar="FILE",
                      help="keys, one per line (# comments)")
    auth.add_argument("--protect-metrics", action="store_true",
                      help="/health and /metrics need a key too (default: open)")
    auth.add_argument("--ssl-certfile", default=None, metavar="PEM",
                      help="serve REST and gRPC over TLS with this certificate (chain)")
    auth.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="its private key")
    auth.add_argument("--ssl-ca-certs", default=None, metavar="PEM",
                      help="require client certificates signed by this CA (mutual TLS)")
    add_deployment_security(p)
    add_tracing(p)
    add_drain(p)
    slo = p.add_argument_group("SLO (the autoscaling signals on /metrics)")
    slo.add_argument("--slo-ttft", type=non_negative_float, default=0.0, metavar="S",
                     help="time to first token a request should meet: pdserve_slo_requests"
                          "{kind=\"ttft\"} counts those that met and missed it (0: off)")
    slo.add_argument("--slo-tpot", type=non_negative_float, default=0.0, metavar="S",
                     help="time per output token after the first, the same way (0: off)")
    p.add_argument("--log-level", default="INFO")


def role_parser(role: str, parser_class: type = argparse.ArgumentParser
                ) -> argparse.ArgumentParser:
    """A standalone parser of `pdserve ROLE` (prefill, decode, gateway): the same definitions
    as the subcommand's."""
    p = parser_class(prog=f"pdserve {role}", description=ROLE_DESCRIPTIONS[role],
                     allow_abbrev=False)
    if role == "gateway":
        add_gateway(p)
    else:
        add_worker(p, role, WORKER_PORTS[role])
    return p


class FlagFileParser(argparse.ArgumentParser):
    """Reads `@FILE` arguments as flags, a line of whitespace-separated words each (shell
    quoting; `#` starts a comment): how deploy/k8s passes a ConfigMap of flags. Takes no
    abbreviation of a flag (`--api-key` is never read as `--api-key-file`); its subcommands'
    parsers are FlagFileParsers too (argparse makes them of the parent's class), so neither
    does any `pdserve` command."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("fromfile_prefix_chars", "@")
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def convert_arg_line_to_args(self, arg_line: str) -> list[str]:
        return shlex.split(arg_line, comments=True)


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks; appends "(default: X)" to an option's help unless X
    is None/False or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default is None
                or action.default is False or action.default == argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"
