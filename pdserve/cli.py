"""The `pdserve` command: its command table and the flags of `pdserve up`. The serving roles'
flags are pdserve.flags'; every tool or bench registers its own (`register(subparsers)` in its
module, which imports nothing heavy until its command runs), so `pdserve gateway` never imports
torch and `--help` is instant."""

from __future__ import annotations

import argparse
import importlib
import logging
import shlex
import sys

from pdserve.flags import (ROLE_DESCRIPTIONS, ROLES, WORKER_PORTS, FlagFileParser, add_gateway,
                           add_model, add_worker, role_parser)


# Per-process plumbing: `pdserve up` sets these for each child itself (or leaves the child's
# default); they are not `up` flags.
WORKER_PLUMBING = frozenset({"--host", "--port", "--advertise-host", "--redis-url", "--worker-id",
                             "--metrics-port"})
# --api-key: secrets never go on a command line `up` builds (`up --api-key` hands them over in
# the gateway's environment: launcher.hand_over_api_keys)
GATEWAY_PLUMBING = frozenset({"--host", "--http-port", "--grpc-port", "--redis-url",
                              "--api-key"})
# Every child gets these from the `up` flag of the same name.
SHARED_FLAGS = frozenset({"--model", "--served-model-name", "--log-level"})
# Worker flags `up` defines itself, with a meaning of its own: --device also takes
# PREFILL,DECODE and --gpu-memory-utilization 0 picks a share (launcher.place_workers);
# --threads 0 (the default) gives each CPU worker the host's cores (launcher.worker_threads).
UP_OWN_FLAGS = frozenset({"--device", "--gpu-memory-utilization", "--threads"})
# Flags `--prefill-args` & co. may not set: `up` gives them to each child and relies on them
# (health checks, discovery, one model everywhere). Each maps to the `up` flag to use instead.
UP_SETS = {"--port": "--prefill-port/--decode-port", "--redis-url": "--redis-url",
           "--http-port": "--http-port", "--grpc-port": "--grpc-port", "--model": "--model",
           "--served-model-name": "--served-model-name"}



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
        elif action.nargs in (None, "+"):
            kind = dict(type=action.type, choices=action.choices, metavar=action.metavar,
                        nargs=action.nargs)
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
    add_model(up)
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
    workers.add_argument("--threads", type=int, default=0,
                         help="torch threads per worker (0: on CPUs every core of the host for "
                              "each worker, split between its tensor-parallel ranks: the two "
                              "take turns, one's idle cores go to the other; on GPUs 1)")
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
    gateway.add_argument("--api-key", action="append", default=None, metavar="KEY",
                         help="a key clients must send, as `pdserve gateway --api-key` "
                              "(repeatable); `up` hands its gateway the keys in "
                              "$PDSERVE_API_KEY, beside any already there, never on its "
                              "command line. Every key of --api-key, --api-key-file and "
                              "$PDSERVE_API_KEY is accepted")
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



# Commands whose module registers its flags (`register(subparsers)`), in `pdserve --help` order;
# a group's modules register its actions.
MODEL_ACTIONS = ("pdserve.modelfetch", "pdserve.quantize")
TOOLS = ("pdserve.bench.runner", "pdserve.bench.kvbench", "pdserve.bench.linearbench",
         "pdserve.bench.stepbench", "pdserve.bench.windowbench", "pdserve.bench.agreebench",
         "pdserve.bench.grammarbench", "pdserve.bench.choicebench", "pdserve.bench.jsonbench",
         "pdserve.chaos",
         "pdserve.deploy_secrets", "pdserve.baseline", "pdserve.traces")


def _register(sub, modules: tuple[str, ...]) -> None:
    for name in modules:
        importlib.import_module(name).register(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = FlagFileParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving; `pdserve ROLE "
                                    "@FILE ...` reads flags from FILE too (a line of flags "
                                    "each, `#` comments).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    model = sub.add_parser("model", help="fetch the default model, quantize a checkpoint",
                           description="Fetch the default model (SmolLM2-135M-Instruct); "
                                       "write a checkpoint in a pre-quantized format.")
    _register(model.add_subparsers(dest="model_command", required=True, metavar="ACTION"),
              MODEL_ACTIONS)

    _add_up(sub)

    gw = sub.add_parser("gateway", help="run the gateway (REST + gRPC front door)",
                        description=ROLE_DESCRIPTIONS["gateway"])
    add_gateway(gw)
    gw.set_defaults(target="gateway.server:main")

    for role, target in (("prefill", "prefill_service.server:main"),
                         ("decode", "decode_service.server:main")):
        worker = sub.add_parser(role, help=f"run a {role} worker",
                                description=ROLE_DESCRIPTIONS[role])
        add_worker(worker, role, WORKER_PORTS[role])
        worker.set_defaults(target=target)

    _register(sub, TOOLS)
    return parser



def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "INFO"),
                        format=f"%(asctime)s {args.command} %(levelname)s %(name)s: %(message)s")
    module_name, func = args.target.split(":")
    return getattr(importlib.import_module(module_name), func)(args) or 0


if __name__ == "__main__":
    sys.exit(main())
