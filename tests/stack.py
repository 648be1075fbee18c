"""Real processes for integration tests: redis-server, prefill and decode workers, gateway.

Every process listens on 127.0.0.1 on a free port, logs to a file under the test's tmp dir, and
is killed at the end. Workers get one torch thread each (two cores run everything).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from cluster import health
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.conftest import free_port
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    address: str
    role: str = ""                  # a worker's: prefill or decode

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.popen.kill()
            self.popen.wait(10)


@dataclass
class Stack:
    model: str
    workdir: Path
    procs: list[Proc] = field(default_factory=list)
    redis_url: str = ""
    env: dict = field(default_factory=dict)    # given to every process (e.g. the deployment token)

    def _spawn(self, name: str, args: list[str], address: str, **env_extra: str) -> Proc:
        log = self.workdir / f"{name}.log"
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)
        for secret in ("PDSERVE_API_KEY", "PDSERVE_CLUSTER_TOKEN", "PDSERVE_REDIS_PASSWORD"):
            env.pop(secret, None)       # the caller's secrets must not close the stack
        env.update(self.env)
        env.update(env_extra)
        popen = subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                                 cwd=self.workdir)
        p = Proc(name, popen, log, address)
        self.procs.append(p)
        return p

    def start_redis(self, *extra: str, url: str | None = None) -> Proc:
        """`extra`: more redis-server flags; `url`: the URL clients use ({port} is filled in
        both)."""
        port = free_port()
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        p = self._spawn("redis", [exe, "--port", str(port), "--save", "", "--appendonly", "no",
                                  "--bind", "127.0.0.1", *(a.format(port=port) for a in extra)],
                        f"127.0.0.1:{port}")
        self.redis_url = (url or "redis://127.0.0.1:{port}/0").format(port=port)
        wait_until(lambda: _tcp_open(port), 20, "redis", [(p.popen, p.log)])
        return p

    def start_worker(self, role: str, *extra: str, name: str | None = None,
                     env: dict | None = None) -> Proc:
        """`env`: more environment for this worker alone."""
        port, metrics_port = free_port(), free_port()
        name = name or f"{role}-{port}"
        p = self._spawn(name, [sys.executable, "-m", "pdserve.cli", role, "--model", self.model,
                               "--port", str(port), "--metrics-port", str(metrics_port),
                               "--redis-url", self.redis_url,
                               "--threads", "1", "--kv-cache-gib", "0.25", *extra],
                        f"127.0.0.1:{port}", **(env or {}))
        p.role = role
        p.metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        return p

    def start_gateway(self, *extra: str, env_key: str | None = None,
                      name: str = "gateway") -> Proc:
        """`env_key`: an API key handed over in $PDSERVE_API_KEY; `name`: another for a second
        gateway (its log is NAME.log)."""
        http, grpc_port = free_port(), free_port()
        env = {"PDSERVE_API_KEY": env_key} if env_key else {}
        p = self._spawn(name, [sys.executable, "-m", "pdserve.cli", "gateway", "--model",
                                    self.model, "--http-port", str(http), "--grpc-port",
                                    str(grpc_port), "--redis-url", self.redis_url, *extra],
                        f"127.0.0.1:{grpc_port}", **env)
        p.http = f"http://127.0.0.1:{http}"
        return p

    def wait_healthy(self, timeout_s: float = 180) -> None:
        for p in self.procs:
            if p.name == "redis":
                continue
            if p.name == "gateway":
                pred = lambda p=p: gateway_sees_workers(p.http)  # noqa: E731
            else:
                pred = lambda p=p: health.grpc_serving(p.address, 1.0)  # noqa: E731
            wait_until(pred, timeout_s, p.name, [(p.popen, p.log)])

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.alive():
                p.popen.terminate()
        for p in reversed(self.procs):
            try:
                p.popen.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()

    def proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log.read_text()[-2000:]}" for p in self.procs)


def copy_tokenizer(model_dir: Path, dst: Path) -> None:
    """The default model's tokenizer files into `dst` (a tiny random model with its
    vocabulary then serves text through the gateway)."""
    for f in Path(model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name in ("vocab.json",
                                                                             "merges.txt"):
            shutil.copy(f, Path(dst) / f.name)


def metric(url: str, name: str, **labels) -> float:
    """The sum of a Prometheus metric's samples at `url` with these labels (0 when none)."""
    import httpx

    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith(name) and line[len(name)] in "{ " and all(w in line for w in want):
            total += float(line.split()[-1])
    return total


def worker_stats(p: Proc) -> pb.WorkerStats:
    """A worker's Stats RPC: requests running and waiting, KV blocks free of total."""
    with grpc.insecure_channel(p.address) as ch:
        stub = (pb_grpc.DecodeWorkerStub if p.role == "decode" else pb_grpc.PrefillWorkerStub)(ch)
        return stub.Stats(pb.StatsRequest(), timeout=10)


def idle(*workers: Proc) -> bool:
    """Every one of them has no request running or waiting and every KV block free."""
    return all(s.running == 0 and s.waiting == 0 and s.free_blocks == s.total_blocks
               for s in map(worker_stats, workers))


def wait_idle(*workers: Proc, timeout_s: float = 30) -> None:
    """Until idle(*workers) (aborts and frees are asynchronous); a timeout shows their stats."""
    wait_until(lambda: idle(*workers), timeout_s,
               lambda: "idle workers: " + "; ".join(f"{p.name}: {worker_stats(p)}".replace(
                   "\n", " ") for p in workers))


@contextlib.contextmanager
def standard_stack(model_dir, workdir: Path, decode_args: tuple[str, ...] = (),
                   gateway_args: tuple[str, ...] = (), prefills: tuple[str, ...] = ("prefill",),
                   prefill_args: tuple[str, ...] = (), decodes: tuple[str, ...] = ("decode",),
                   env: dict | None = None, redis_args: tuple[str, ...] = (),
                   prefill_env: dict | None = None):
    """redis + prefill and decode workers (one per name) + the gateway, healthy; logs printed
    if startup fails. `env`: given to every process; `prefill_env`: to the prefill workers
    too; `redis_args`: redis-server flags."""
    s = Stack(str(model_dir), workdir, env=dict(env or {}))
    try:
        s.start_redis(*redis_args)
        for name in prefills:
            s.start_worker("prefill", *prefill_args, name=name, env=prefill_env)
        for name in decodes:
            s.start_worker("decode", *decode_args, name=name)
        s.start_gateway(*gateway_args)
        s.wait_healthy()
        wait_until(lambda: gateway_sees_workers(s.procs[-1].http, len(prefills),
                                                 len(decodes)), 60, "every worker at the gateway")
        yield s
    except BaseException:
        print(s.logs())
        raise
    finally:
        s.stop()


def _tcp_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def gateway_sees_workers(base: str, prefills: int = 1, decodes: int = 1) -> bool:
    """The gateway is up and has discovered this many prefill and decode workers."""
    import httpx

    try:
        body = httpx.get(base + "/health", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return False
    workers = body.get("workers", {})
    return workers.get("prefill", 0) >= prefills and workers.get("decode", 0) >= decodes
