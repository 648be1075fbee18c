"""docker-compose.yml is valid and wires the stack as documented.

`docker-compose config` (the standalone 1.x tool, as Debian ships it) validates and normalizes the
file without a Docker engine; the test is skipped only where that tool is not installed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
MODEL = "/models/SmolLM2-135M-Instruct"
REDIS_URL = "redis://redis:6379/0"


def _flag(command: list[str], name: str) -> str:
    """The value after --name in an argv list."""
    assert name in command, f"{name} missing from {command}"
    return command[command.index(name) + 1]


@pytest.fixture(scope="module")
def normalized() -> dict:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    proc = subprocess.run([exe, "-f", str(COMPOSE), "config"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def test_services_present(normalized):
    assert set(normalized["services"]) == {"redis", "model", "prefill", "decode", "gateway"}
    assert normalized["services"]["redis"]["image"] == "redis:7"


def test_gateway_ports_and_command(normalized):
    gw = normalized["services"]["gateway"]
    published = {(int(p["published"]), int(p["target"])) for p in gw["ports"]}
    assert published == {(8000, 8000), (50051, 50051)}
    cmd = gw["command"]
    assert cmd[0] == "gateway"
    assert _flag(cmd, "--host") == "0.0.0.0"
    assert _flag(cmd, "--http-port") == "8000"
    assert _flag(cmd, "--grpc-port") == "50051"
    assert _flag(cmd, "--redis-url") == REDIS_URL
    assert _flag(cmd, "--model") == MODEL


@pytest.mark.parametrize("role,port", [("prefill", "50061"), ("decode", "50071")])
def test_worker_commands(normalized, role, port):
    svc = normalized["services"][role]
    cmd = svc["command"]
    assert cmd[0] == role
    assert _flag(cmd, "--host") == "0.0.0.0"
    assert _flag(cmd, "--port") == port
    assert _flag(cmd, "--advertise-host") == role
    assert _flag(cmd, "--redis-url") == REDIS_URL
    assert _flag(cmd, "--model") == MODEL
    assert svc["healthcheck"]["test"][-2:] == ["grpc", f"127.0.0.1:{port}"]
    assert "ports" not in svc  # reached by service name inside the compose network only


@pytest.mark.parametrize("name", ["prefill", "decode", "gateway"])
def test_serving_depends_on_redis_and_model(normalized, name):
    svc = normalized["services"][name]
    assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
    assert svc["depends_on"]["model"]["condition"] == "service_completed_successfully"
    assert svc["volumes"] == ["models:/models:ro"]
    assert "healthcheck" in svc


def test_model_service_fetches_into_the_volume(normalized):
    svc = normalized["services"]["model"]
    assert svc["command"] == ["model", "fetch", "--dest", MODEL]
    assert svc["restart"] == "no"
    assert "models" in normalized["volumes"]


def test_raw_file_parses_with_pyyaml():
    raw = yaml.safe_load(COMPOSE.read_text())
    assert {"redis", "model", "prefill", "decode", "gateway"} <= set(raw["services"])
    assert raw["services"]["gateway"]["ports"] == ["8000:8000", "50051:50051"]
    for name in ("prefill", "decode", "gateway", "model"):
        assert raw["services"][name]["image"] == "pdserve:latest"
        assert raw["services"][name]["build"] == "."

