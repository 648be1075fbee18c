"""`pdserve up` as a real process, for the tests that start it the way a user does: free ports,
one torch thread per worker, its output in a log file; and the checks that it left nothing
behind."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from tests.stack import free_port
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Up:
    """A `pdserve up` process on free ports, its output in a log file; one torch thread per
    worker (two cores run everything). EXTRA: more `up` flags; ENV: more environment (the
    caller's own keys, token and Redis password are dropped)."""

    def __init__(self, model: Path, workdir: Path, *extra: str, env: dict | None = None) -> None:
        self.ports = {name: free_port() for name in ("redis", "http", "grpc", "prefill", "decode")}
        self.log = workdir / "up.log"
        child_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                         PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                  os.environ.get("PYTHONPATH")])))
        for secret in ("PDSERVE_API_KEY", "PDSERVE_CLUSTER_TOKEN", "PDSERVE_REDIS_PASSWORD"):
            child_env.pop(secret, None)
        child_env.update(env or {})
        cmd = [sys.executable, "-m", "pdserve.cli", "up", "--model", str(model),
               "--redis-port", str(self.ports["redis"]), "--http-port", str(self.ports["http"]),
               "--grpc-port", str(self.ports["grpc"]), "--prefill-port", str(self.ports["prefill"]),
               "--decode-port", str(self.ports["decode"]), "--kv-cache-gib", "0.25",
               "--threads", "1", *extra]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     cwd=workdir, env=child_env)

    def output(self) -> str:
        return self.log.read_text()

    def wait_ready(self) -> None:
        wait_until(lambda: "pdserve is up" in self.output(), START_TIMEOUT_S,
                   lambda: f"pdserve up:\n{self.output()[-3000:]}", [(self.proc, self.log)],
                   interval_s=0.5)

    def children(self) -> dict[str, int]:
        """Every child `up` reported healthy: name -> pid."""
        return {name: int(pid) for name, pid in
                re.findall(r"(\w+) is healthy \(pid (\d+)\)", self.output())}

    def stop(self, signum: int) -> tuple[int, dict[str, int]]:
        """Send SIGNUM to `up`; its exit code and its children, once it has exited."""
        children = self.children()
        self.proc.send_signal(signum)
        return self.proc.wait(timeout=STOP_TIMEOUT_S), children

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def sessions_left(pids) -> list[str]:
    """Processes still alive in the sessions of PIDS (each child of `up` leads its own session,
    so its own children, tensor-parallel ranks or compiler workers, are in it too)."""
    sids = set(pids)
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:                     # gone meanwhile
            continue
        # pid (comm) state ppid pgrp session ...: comm may hold spaces, so split after ')'
        fields = text.rpartition(")")[2].split()
        if int(fields[3]) in sids and fields[0] != "Z":
            left.append(text[:80])
    return left


def assert_all_gone(up: Up, children: dict[str, int]) -> None:
    assert set(children) == {"redis", "prefill", "decode", "gateway"}, up.output()[-3000:]
    # the kernel tears a dead process down meanwhile
    wait_until(lambda: not sessions_left(children.values()), 10,
               lambda: f"every process gone; left: {sessions_left(children.values())}")
    assert not [name for name, port in up.ports.items() if listening(port)]


def stream_chat(client, question: str) -> str:
    """The text of a streamed, greedy chat answer of at most 8 tokens."""
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=8,
        temperature=0, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
