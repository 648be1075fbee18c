"""`pdserve up`: the local stack as separate processes.

    redis-server (unless --redis-url)  ->  prefill and decode workers (in parallel)  ->  gateway

Each child is started with `python -m pdserve.cli <role> ...` (child_commands: every `up` flag
given that the role has, then that role's --<role>-args) and waited on until it is healthy
(workers: the gRPC health service; gateway: GET /health lists both workers, asked the way the
gateway serves it: TLS, mutual TLS with a client certificate, an API key; GatewayProbe). Ctrl-C
or SIGTERM stops them all, newest first (SIGTERM, then SIGKILL after a grace period), and exits
0; a child that dies on its own stops the rest and exits 1. On Linux the kernel sends children
SIGTERM if this process dies without cleaning up.

Secrets: unless a deployment token is given (--cluster-token-file or $PDSERVE_CLUSTER_TOKEN),
`up` makes a fresh one and hands it to its children in their environment; the Redis it starts
has a fresh password (in a 0600 config file, never on a command line), handed over the same way;
so are the client API keys of `up --api-key` ($PDSERVE_API_KEY, hand_over_api_keys).
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from cluster import health
from pdserve.cli import long_flag, passthrough_actions
from pdserve.flags import DEFAULT_DRAIN_S
from cluster.paths import default_model_dir, resolve_model

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # a worker loads the model and sizes its KV pool before it serves
STOP_GRACE_S = 10.0
POLL_S = 0.5
REFUSAL_WAIT_S = 2.0  # a gateway that accepts the probe's certificate has said no by then
CLI = (sys.executable, "-m", "pdserve.cli")  # a child's command line: CLI, its role, its flags


class _Stop(Exception):
    """Raised by the SIGINT/SIGTERM handler to unwind into the shutdown path."""


def _loggable(cmd: list[str]) -> list[str]:
    """A command line as the log shows it: Redis URLs without their password, no key values."""
    from cluster.registry import redacted

    out = []
    for arg in cmd:
        if arg.startswith("--api-key="):
            arg = "--api-key=***"
        elif out and out[-1] == "--api-key":
            arg = "***"
        elif "://" in arg:
            flag, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
            arg = flag + eq + redacted(value)
        out.append(arg)
    return out


def _die_with_parent() -> None:
    """Runs in the child before exec: ask the kernel to SIGTERM it when the launcher dies."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    healthy: Callable[[], bool]


@dataclass
class Stack:
    """The processes started so far, in start order."""

    children: list[Child] = field(default_factory=list)
    tmpdir: Path | None = None
    grace_s: float = STOP_GRACE_S      # a child's drain (--drain-timeout) and then some

    def spawn(self, name: str, cmd: list[str], healthy: Callable[[], bool], **popen) -> Child:
        log.info("starting %s: %s", name, " ".join(_loggable(cmd)))
        # Own session: a terminal's Ctrl-C reaches only the launcher, which stops children in order.
        proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent, **popen)
        child = Child(name, proc, healthy)
        self.children.append(child)
        return child

    def wait_healthy(self, child: Child, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not child.healthy():
            code = child.proc.poll()
            if code is not None:
                raise SystemExit(f"{child.name} exited with code {code} before it became healthy "
                                 "(see its log above)")
            if time.monotonic() > deadline:
                raise SystemExit(f"{child.name} not healthy after {timeout_s:.0f}s")
            time.sleep(POLL_S)
        log.info("%s is healthy (pid %d)", child.name, child.proc.pid)

    def first_dead(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop(self) -> None:
        """Stop children newest first (gateway, workers, then redis, which workers deregister
        from): SIGTERM, then SIGKILL if one is still running after the grace period."""
        for child in reversed(self.children):
            if child.proc.poll() is not None:
                continue
            log.info("stopping %s (pid %d)", child.name, child.proc.pid)
            child.proc.terminate()
            try:
                child.proc.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs, killing it", child.name, self.grace_s)
                child.proc.kill()
                child.proc.wait()
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


def _ensure_model(model: str | None) -> Path:
    if model is None:
        from pdserve import modelfetch

        if not modelfetch.is_complete(default_model_dir()):
            log.info("default model not found, fetching it first")
            modelfetch.fetch(default_model_dir())
    return resolve_model(model)


def _start_redis(stack: Stack, port: int) -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed: `apt-get install redis-server` "
                         "(or pass --redis-url to use a running Redis)")
    import redis

    from cluster.registry import PASSWORD_ENV

    url = f"redis://127.0.0.1:{port}/0"
    stack.tmpdir = Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
    logfile = stack.tmpdir / "redis.log"
    password = os.environ.get(PASSWORD_ENV) or secrets.token_urlsafe(24)
    os.environ[PASSWORD_ENV] = password              # the children's Redis password
    config = stack.tmpdir / "redis.conf"
    config.touch(mode=0o600)
    config.write_text(f"requirepass {password}\n", encoding="utf-8")

    def ping(password: str | None = password) -> bool:
        try:
            with redis.Redis.from_url(url, password=password, socket_timeout=1) as client:
                return bool(client.ping())
        except redis.AuthenticationError:
            return True                               # someone else's Redis answers
        except redis.RedisError:
            return False

    if ping(None):
        raise SystemExit(f"something already answers on port {port}: stop it, pick another "
                         "--redis-port, or pass --redis-url to use it")
    cmd = [exe, str(config), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
           "--appendonly", "no", "--dir", str(stack.tmpdir), "--logfile", str(logfile)]
    child = stack.spawn("redis", cmd, ping, stdin=subprocess.DEVNULL)
    try:
        stack.wait_healthy(child, timeout_s=20.0)
    except SystemExit as exc:
        tail = logfile.read_text()[-2000:] if logfile.exists() else ""
        raise SystemExit(f"{exc}\nredis log:\n{tail}") from None
    return url


def _common(args, model: Path) -> list[str]:
    out = ["--model", str(model), "--log-level", args.log_level]
    if args.served_model_name:
        out += ["--served-model-name", args.served_model_name]
    return out


def place_workers(device: str, num_gpus: int | None = None, prefill_tp: int = 1,
                  decode_tp: int = 1) -> tuple[str, str, float]:
    """`pdserve up --device`: (prefill device, decode device, default memory share each). A
    worker of tensor-parallel size N takes its device and the N-1 after it: on "cuda" the
    decode worker starts after the prefill worker's GPUs when there are enough for both, else
    both share from GPU 0 (half the memory each)."""
    if "," in device:
        prefill, decode = (d.strip() for d in device.split(",", 1))
        return prefill, decode, 0.45 if _overlap(prefill, prefill_tp, decode, decode_tp) else 0.9
    if device != "cuda":
        return device, device, 0.9
    if num_gpus is None:
        import torch
        num_gpus = torch.cuda.device_count()
    if num_gpus >= prefill_tp + decode_tp:
        return "cuda:0", f"cuda:{prefill_tp}", 0.9
    if max(prefill_tp, decode_tp) > num_gpus:
        raise ValueError(f"tensor parallel size {max(prefill_tp, decode_tp)} needs as many "
                         f"GPUs; {num_gpus} visible")
    return "cuda:0", "cuda:0", 0.45


def _overlap(a: str, a_ranks: int, b: str, b_ranks: int) -> bool:
    """Whether two workers' devices (each its device and the ranks - 1 after it) share one."""
    def devices(d: str, n: int) -> set[str]:
        if not d.startswith("cuda"):
            return {d}
        first = int(d.partition(":")[2] or 0)
        return {f"cuda:{first + r}" for r in range(n)}
    return bool(devices(a, a_ranks) & devices(b, b_ranks))


def role_tensor_parallel(args, role: str) -> int:
    """ROLE's --tensor-parallel-size: `up`'s flag, or the last one in --ROLE-args."""
    size = getattr(args, "tensor_parallel_size", None) or 1
    extra = list(getattr(args, f"{role}_args", None) or [])
    for i, a in enumerate(extra):
        if a == "--tensor-parallel-size" and i + 1 < len(extra):
            size = int(extra[i + 1])
        elif a.startswith("--tensor-parallel-size="):
            size = int(a.split("=", 1)[1])
    return size


def worker_threads(requested: int, device: str, tensor_parallel: int = 1) -> int:
    """`up --threads`: as given, or for 0 (the default) on CPUs every core this process may use
    for each worker, split between its tensor-parallel ranks; on GPUs 1. The two workers share
    the cores step by step (engine.core_share, `--share-cores`): while one has nothing to compute
    (the prefill worker once a burst's prompts are done, the decode worker while it waits for
    their KV) the other's threads use them all, while both compute each takes one's worth
    (docs/performance.md, "Threads per worker")."""
    if requested > 0:
        return requested
    if not device.startswith("cpu"):
        return 1
    return max(1, len(os.sched_getaffinity(0)) // max(1, tensor_parallel))


def passthrough_args(args, role: str, **computed) -> list[str]:
    """The `up` flags given for ROLE as that role's flags (`--flag=value`, or `--flag` for a
    switch). `computed` replaces values `up` works out per role (--device)."""
    out = []
    for action in passthrough_actions(role):
        value = computed.get(action.dest, getattr(args, action.dest, None))
        if action.nargs == 0:           # a switch: `up` holds its const when it was given
            if value is not None and value == action.const:
                out.append(long_flag(action))
        elif isinstance(value, list):       # nargs "+": the flag, then each value
            if value:
                out += [long_flag(action), *("=".join(v) if isinstance(v, tuple) else str(v)
                                             for v in value)]
        elif value is not None:
            out.append(f"{long_flag(action)}={value}")
    return out


def child_commands(args, model: Path, redis_url: str,
                   num_gpus: int | None = None) -> dict[str, list[str]]:
    """The command lines of the prefill and decode workers and the gateway: `up`'s plumbing and
    shared flags, the passed-through flags, then --prefill-args/--decode-args/--gateway-args
    (last, so they win)."""
    cli = list(CLI)
    prefill_dev, decode_dev, share = place_workers(
        args.device, num_gpus, role_tensor_parallel(args, "prefill"),
        role_tensor_parallel(args, "decode"))
    memory = args.gpu_memory_utilization or share
    commands = {}
    for role, port, dev in (("prefill", args.prefill_port, prefill_dev),
                            ("decode", args.decode_port, decode_dev)):
        commands[role] = cli + [
            role, *_common(args, model), "--port", str(port), "--redis-url", redis_url,
            *passthrough_args(args, role, device=dev, gpu_memory_utilization=memory,
                              threads=worker_threads(args.threads, dev,
                                                     role_tensor_parallel(args, role))),
            *getattr(args, f"{role}_args")]
    commands["gateway"] = cli + [
        "gateway", *_common(args, model), "--http-port", str(args.http_port),
        "--grpc-port", str(args.grpc_port), "--redis-url", redis_url,
        *passthrough_args(args, "gateway"), *args.gateway_args]
    return commands


def hand_over_api_keys(args) -> None:
    """`up --api-key KEY`: the keys go to the gateway in $PDSERVE_API_KEY (children inherit the
    environment; the workers do not read it), after any keys already there, so they are on no
    child's command line. The variable is comma-separated: a key holding a comma is refused
    (SystemExit), a key file takes it."""
    from gateway.auth import ENV_VAR

    keys = [k.strip() for k in getattr(args, "api_key", None) or () if k.strip()]
    if not keys:
        return
    if any("," in k for k in keys):
        raise SystemExit("--api-key: a key holding ',' cannot be handed to the gateway in "
                         f"${ENV_VAR} (comma-separated); put it in a file for --api-key-file")
    given = [k for k in os.environ.get(ENV_VAR, "").split(",") if k.strip()]
    os.environ[ENV_VAR] = ",".join(given + keys)


def _deployment_token(args) -> None:
    """Make the stack's token unless one is given (children inherit the environment)."""
    from cluster.auth import ENV_VAR

    if not getattr(args, "cluster_token_file", None) and not os.environ.get(ENV_VAR):
        os.environ[ENV_VAR] = secrets.token_urlsafe(32)


def _start_all(args, stack: Stack) -> tuple[Path, str, "GatewayProbe"]:
    model = _ensure_model(args.model)
    _deployment_token(args)
    hand_over_api_keys(args)
    redis_url = args.redis_url or _start_redis(stack, args.redis_port)
    commands = child_commands(args, model, redis_url)
    probe = GatewayProbe.for_gateway(commands["gateway"], args.http_port,
                                     getattr(args, "ssl_client_certfile", None),
                                     getattr(args, "ssl_client_keyfile", None))
    workers = []
    for role, port in (("prefill", args.prefill_port), ("decode", args.decode_port)):
        addr = f"127.0.0.1:{port}"
        workers.append(stack.spawn(role, commands[role],
                                   lambda a=addr: health.grpc_serving(a)))
    for worker in workers:  # both load the model at the same time
        stack.wait_healthy(worker)
    stack.wait_healthy(stack.spawn("gateway", commands["gateway"], probe))
    return model, redis_url, probe


@dataclass(frozen=True)
class GatewayProbe:
    """How `up` asks its gateway whether the stack is ready: GET /health answers 200 and lists
    a prefill and a decode worker. The probe speaks what the gateway's own command line asks
    for (after --gateway-args): plain HTTP or TLS (the server's certificate is not checked: it
    is our child on 127.0.0.1); under mutual TLS (--ssl-ca-certs) it presents a client
    certificate, --ssl-client-certfile/--ssl-client-keyfile or else the server's own; with
    --protect-metrics it sends one of the gateway's API keys.

    A gateway that answers but refuses the probe (its certificate, its key) ends the wait at
    once with SystemExit: waiting longer would not change the answer."""

    url: str
    headers: dict = field(default_factory=dict)
    context: ssl.SSLContext | None = None
    client_cert: tuple[str, str] | None = None      # (certfile, keyfile) under mutual TLS
    keyed: bool = False                             # the gateway needs API keys

    @classmethod
    def for_gateway(cls, gateway_cmd: list[str], port: int, client_certfile: str | None = None,
                    client_keyfile: str | None = None) -> "GatewayProbe":
        """The probe of the gateway started with GATEWAY_CMD (python -m pdserve.cli gateway
        ...); SystemExit when the client certificate is incomplete or does not load."""
        from gateway.auth import ApiKeys

        from pdserve.flags import role_parser

        ns = role_parser("gateway").parse_args(gateway_cmd[len(CLI) + 1:])
        keys = ApiKeys.from_sources(ns.api_key, ns.api_key_file)
        headers = {"Authorization": "Bearer " + keys.first()} if (
            ns.protect_metrics and keys.enabled) else {}
        if bool(client_certfile) != bool(client_keyfile):
            raise SystemExit("--ssl-client-certfile and --ssl-client-keyfile go together")
        if client_certfile and not ns.ssl_ca_certs:
            raise SystemExit("--ssl-client-certfile is the certificate pdserve up presents "
                             "under mutual TLS: it needs --ssl-ca-certs")
        if not ns.ssl_certfile:
            return cls(f"http://127.0.0.1:{port}/health", headers, keyed=keys.enabled)
        client = None
        if ns.ssl_ca_certs:
            client = ((client_certfile, client_keyfile) if client_certfile
                      else (ns.ssl_certfile, ns.ssl_keyfile))
        try:
            context = health.unverified_context(*(client or ()))
        except (ssl.SSLError, OSError) as exc:
            raise SystemExit(f"cannot load the client certificate {client[0]} (key "
                             f"{client[1]}): {exc}") from None
        return cls(f"https://127.0.0.1:{port}/health", headers, context, client, keys.enabled)

    @property
    def base(self) -> str:
        """The gateway's REST root."""
        return self.url.removesuffix("/health")

    def refusal(self) -> str | None:
        """Why the gateway refuses the probe's certificate, or None when it does not (or does
        not answer). Under TLS 1.3 the server checks the client's certificate after the
        handshake has completed on the client's side and sends its alert then, which a client
        writing its request meanwhile may never read; so: handshake, then only read. A server
        that accepts the certificate waits for a request (the read times out); one that
        refuses it sends an alert or closes the connection."""
        try:
            raw = socket.create_connection(("127.0.0.1", urllib.parse.urlsplit(self.url).port),
                                           timeout=REFUSAL_WAIT_S)
        except OSError:
            return None
        with raw:
            try:
                with self.context.wrap_socket(raw) as tls:
                    data = tls.recv(1)
            except ssl.SSLError as exc:             # e.g. SSLV3_ALERT_UNSUPPORTED_CERTIFICATE
                return str(exc.reason or exc)
            except ConnectionResetError:
                return "the connection was reset after the handshake"
            except OSError:                         # the read timed out: accepted
                return None
        return None if data else "the connection was closed after the handshake"

    def __call__(self) -> bool:
        try:
            body = health.get_json(self.url, headers=self.headers, context=self.context)
        except urllib.error.HTTPError as exc:
            if exc.code == 401:
                raise SystemExit("the gateway wants an API key on /health (--protect-metrics) "
                                 "and pdserve up has none: give the keys with --api-key, in "
                                 "$PDSERVE_API_KEY or with --api-key-file") from None
            return False
        except (urllib.error.URLError, OSError, ValueError):
            # No answer: not listening yet (cheap to ask again), or a refused handshake, which
            # surfaces as whatever the request was doing when the server hung up.
            if self.client_cert and (refused := self.refusal()):
                raise SystemExit(
                    f"the gateway refused the client certificate {self.client_cert[0]} "
                    f"({refused}): under mutual TLS pdserve up probes its gateway with "
                    "--ssl-client-certfile/--ssl-client-keyfile, else with the server's own "
                    "certificate, which --ssl-ca-certs must then have signed for client "
                    "authentication (extendedKeyUsage clientAuth, or none)") from None
            return False
        workers = body.get("workers", {}) if isinstance(body, dict) else {}
        return workers.get("prefill", 0) >= 1 and workers.get("decode", 0) >= 1


def _banner(args, model: Path, redis_url: str, probe: GatewayProbe) -> str:
    from cluster.registry import redacted

    name = args.served_model_name or model.name
    tls = probe.context is not None
    base = probe.base
    extra = ((" -H 'Authorization: Bearer $KEY'" if probe.keyed else "") + (" -k" if tls else "")
             + (f" --cert {probe.client_cert[0]} --key {probe.client_cert[1]}"
                if probe.client_cert else ""))
    how = ((" (API keys required)" if probe.keyed else "")
           + (" over mutual TLS" if probe.client_cert else " over TLS" if tls else ""))
    return f"""
pdserve is up: {name}{how}
  REST (OpenAI-compatible)  {base}/v1
  gRPC (pdserve.v1.Generation)  127.0.0.1:{args.grpc_port}
  workers  prefill 127.0.0.1:{args.prefill_port}, decode 127.0.0.1:{args.decode_port}
  redis    {redacted(redis_url)}

Try it:
  curl -N {base}/v1/chat/completions{extra} -H 'Content-Type: application/json' \\
    -d '{{"model": "{name}", "messages": [{{"role": "user", "content": "Hello!"}}], "stream": true, "max_tokens": 64}}'
  curl {base}/v1/models{extra}

Ctrl-C stops everything.
"""


def main(args) -> int:
    def on_signal(signum, frame):
        raise _Stop()

    # Set both explicitly: a shell starts background jobs with SIGINT ignored.
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    drain = getattr(args, "drain_timeout", None)     # None: the roles' default
    stack = Stack(grace_s=(DEFAULT_DRAIN_S if drain is None else drain) + STOP_GRACE_S)
    try:
        model, redis_url, probe = _start_all(args, stack)
        print(_banner(args, model, redis_url, probe), flush=True)
        while (dead := stack.first_dead()) is None:
            time.sleep(POLL_S)
        log.error("%s exited with code %s; stopping the stack", dead.name, dead.proc.returncode)
        return 1
    except _Stop:
        log.info("shutting down")
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.stop()
