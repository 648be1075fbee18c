"""Shared fixtures: real Redis servers on free ports, the default model folder, a tiny
random-weight model folder; `make_engine`, the engines of the unit tests; `unavailable` and
`needs_tool`, what a test does without something the host lacks (skip; under CI, fail)."""

from __future__ import annotations

import os
import random

# Triton kernels run under the interpreter, on CPU tensors, unless the tests target a GPU
# (PDSERVE_TEST_DEVICE=cuda...); set before anything imports triton.
if not os.environ.get("PDSERVE_TEST_DEVICE", "").startswith("cuda"):
    os.environ["TRITON_INTERPRET"] = "1"

import shutil
import socket
import subprocess
from pathlib import Path
from typing import NoReturn

import pytest


def unavailable(message: str) -> NoReturn:
    """A test cannot run here (`message` says what is missing): skipped on a developer's host,
    failed under CI (CI=true: .ci/run installs every tool and `make test` fetches the model
    first, so there a missing one is a broken CI machine, never a quiet skip)."""
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI: the tests must not skip for it)", pytrace=False)
    pytest.skip(message)


def needs_tool(name: str, hint: str = "") -> str:
    """The path of the program `name` on PATH; `unavailable` (with `hint`) when it is not
    installed."""
    exe = shutil.which(name)
    if exe is None:
        unavailable(f"{name} is not installed" + (f" ({hint})" if hint else ""))
    return exe


_GIVEN: set[int] = set()         # the ports free_port handed out in this session
_PORTS = random.Random()         # its own: the global one is Hypothesis's to seed and watch


def _ephemeral_low() -> int:
    """The lowest port the kernel gives outgoing connections (Linux's default: 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1, below the kernel's ephemeral range,
    never the same one twice in a session. Every outgoing connection on the host takes its port
    from that range, so a port from bind(0) could be taken before the server meant for it bound
    it (a worker's metrics server then failed with EADDRINUSE); one below it stays free for its
    server unless another server binds it on purpose."""
    low = _ephemeral_low()
    if low > 21000:
        for _ in range(1000):
            port = _PORTS.randrange(20000, low)
            if port in _GIVEN:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _GIVEN.add(port)
            return port
    with socket.socket() as s:          # a host whose ephemeral range starts low
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private redis-server process (no persistence) on a free port."""

    def __init__(self, workdir: Path) -> None:
        exe = needs_tool("redis-server", "apt-get install redis-server")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._argv = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                      "--appendonly", "no", "--dir", str(workdir)]
        self.start()

    def start(self) -> None:
        """Starts the server (again, after stop(): same port, empty, as a restart leaves it)."""
        self.proc = subprocess.Popen(self._argv, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        import redis

        from tests.waiting import wait_until

        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)

        def answers() -> bool:
            try:
                return client.ping()
            except redis.ConnectionError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} exited") from None
                return False
        try:
            wait_until(answers, timeout_s, f"redis-server on port {self.port}", interval_s=0.05)
        finally:
            client.close()

    def flush(self) -> None:
        import redis

        client = redis.Redis.from_url(self.url)
        client.flushall()
        client.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One redis-server for the whole session. Tests that need an empty database use `redis_url`."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of the session's redis-server, flushed before the test."""
    redis_server.flush()
    return redis_server.url


@pytest.fixture
def private_redis(tmp_path):
    """A redis-server of this test's own, which the test may stop (e.g. to test Redis loss)."""
    server = RedisServer(tmp_path)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default model folder (SmolLM2-135M-Instruct); skips when it has not been fetched."""
    from cluster.paths import default_model_dir

    path = default_model_dir()
    if not (path / ".pdserve-complete").is_file():
        unavailable(f"the default model is not at {path}: run `pdserve model fetch`")
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Llama saved as an HF folder (tests.test_model_parity.make_model:
    seeded, so every session's is the same), for engine tests that need no real tokens."""
    from tests.test_model_parity import make_model

    path = tmp_path_factory.mktemp("tiny")
    make_model(path, "llama")
    return path


# A small pool in blocks of 4 tokens and a small step budget: prompts of a few dozen tokens span
# several blocks and chunks.
SMALL_ENGINE = dict(num_blocks=32, block_size=4, max_num_batched_tokens=16)


def make_engine(model_dir, **overrides):
    """An Engine of `model_dir` (tiny_model_dir, model_dir or a folder a test wrote) with
    SMALL_ENGINE's config, `overrides` (EngineConfig fields) replacing or adding to it. A module
    whose tests share other values names them once: functools.partial(make_engine, ...)."""
    from engine.config import EngineConfig
    from engine.engine import Engine

    return Engine(model_dir, EngineConfig(**{**SMALL_ENGINE, **overrides}))
