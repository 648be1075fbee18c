"""`pdserve up` as a user runs it: the whole local stack from one command, stopped by Ctrl-C,
torn down when a child dies, and a clear message when redis-server is missing."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.stack import free_port

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 300


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Up:
    """A `pdserve up` process on free ports, its output in a log file."""

    def __init__(self, model: Path, workdir: Path) -> None:
        self.ports = {name: free_port() for name in ("redis", "http", "grpc", "prefill", "decode")}
        self.log = workdir / "up.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                            os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "pdserve.cli", "up", "--model", str(model),
               "--redis-port", str(self.ports["redis"]), "--http-port", str(self.ports["http"]),
               "--grpc-port", str(self.ports["grpc"]), "--prefill-port", str(self.ports["prefill"]),
               "--decode-port", str(self.ports["decode"]), "--kv-cache-gib", "0.25"]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     cwd=workdir, env=env)

    def output(self) -> str:
        return self.log.read_text()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "pdserve is up" not in self.output():
            assert self.proc.poll() is None, f"pdserve up exited early:\n{self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"not up in time:\n{self.output()[-3000:]}"
            time.sleep(0.5)

    def child_pid(self, name: str) -> int:
        return int(re.search(rf"{name} is healthy \(pid (\d+)\)", self.output()).group(1))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def up(model_dir, tmp_path):
    u = Up(model_dir, tmp_path)
    yield u
    u.kill()


@pytest.mark.slow
def test_up_serves_then_ctrl_c_stops_everything(up):
    up.wait_ready()
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8, "temperature": 0}
    reply = httpx.post(f"http://127.0.0.1:{up.ports['http']}/v1/chat/completions", json=body,
                       timeout=120)
    assert reply.status_code == 200, reply.text
    assert "Paris" in reply.json()["choices"][0]["message"]["content"]

    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(timeout=60) == 0, up.output()[-3000:]
    assert not [name for name, port in up.ports.items() if _listening(port)]


@pytest.mark.slow
def test_up_stops_the_stack_and_fails_when_a_child_dies(up):
    up.wait_ready()
    os.kill(up.child_pid("decode"), signal.SIGKILL)
    assert up.proc.wait(timeout=60) == 1
    assert "decode exited with code -9" in up.output()
    assert not [name for name, port in up.ports.items() if _listening(port)]


def test_up_without_redis_server_says_how_to_install_it(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    env = dict(os.environ, PATH=str(tmp_path),  # no redis-server on this PATH
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", "--model", str(model),
                           "--redis-port", str(free_port())],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert proc.returncode != 0
    assert "apt-get install redis-server" in proc.stderr
