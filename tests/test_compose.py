"""docker-compose.yml and its GPU overrides are valid and wire the stack as documented.

`docker-compose config` (the standalone 1.x tool, as Debian ships it) validates, merges and
normalizes the files without a Docker engine; those tests are skipped only where that tool is not
installed. The CPU stack is `docker-compose.yml` alone; the GPU variants are
`-f docker-compose.yml -f docker-compose.gpu.yml` (2 GPUs) and `... -f docker-compose.gpu8.yml`
(8 GPUs, in place of docker-compose.gpu.yml).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import needs_tool

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
GPU2 = ROOT / "docker-compose.gpu.yml"
GPU8 = ROOT / "docker-compose.gpu8.yml"
GPU_TP = ROOT / "docker-compose.gpu-tp.yml"
MODEL = "/models/SmolLM2-135M-Instruct"
REDIS_URL = "redis://redis:6379/0"
PORTS = {"prefill": "50061", "decode": "50071"}
BASE_SERVICES = {"secrets", "redis", "model", "prefill", "decode", "gateway"}
ROLES = ("prefill", "decode", "gateway")
PDSERVE_SERVICES = ("secrets", "model", "prefill", "decode", "gateway")
SECRET_FLAGS = ["--cluster-token-file", "/secrets/cluster-token",
                "--redis-password-file", "/secrets/redis-password"]
SERVING_VOLUMES = ["models:/models:ro", "secrets:/secrets:ro"]

# What every GPU worker container gets (docker-compose.gpu.yml explains each line).
GPU_ENV = {
    "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
    "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    "UCX_TLS": "cuda_ipc,cuda_copy,sm,tcp,self",
    "UCX_PROTO_INFO": "used",
    "NCCL_HOSTID": "pdserve-compose",
    "NCCL_CUMEM_ENABLE": "0",
    "NCCL_DEBUG": "WARN",
}
GPU_CAPS = {"IPC_LOCK", "SYS_PTRACE", "SYS_NICE"}
CUDA_IMAGE = "pdserve:cuda"
CUDA_BUILD_ARGS = {"TORCH_INDEX_URL": "https://pypi.org/simple"}
# Keys a GPU override may add to a service; none of them may appear in the CPU stack.
# (environment too, but for TRACING_ENV, which every serving service has.)
GPU_ONLY_KEYS = {"deploy", "ipc", "pid", "ulimits", "cap_add", "shm_size"}
# The host's OpenTelemetry settings, passed to the gateway and every worker; empty: tracing off.
TRACING_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
TRACING_ENV = dict.fromkeys(TRACING_VARS, "")

# The 8-GPU layout: service -> (role, GPU).
GPU8_LAYOUT = {
    "prefill": ("prefill", 0), "prefill-1": ("prefill", 1),
    "prefill-2": ("prefill", 2), "prefill-3": ("prefill", 3),
    "decode": ("decode", 4), "decode-1": ("decode", 5),
    "decode-2": ("decode", 6), "decode-3": ("decode", 7),
}
GPU2_LAYOUT = {"prefill": ("prefill", 0), "decode": ("decode", 1)}


def _flag(command: list[str], name: str) -> str:
    """The value after --name in an argv list."""
    assert name in command, f"{name} missing from {command}"
    return command[command.index(name) + 1]


def cpu_worker_command(role: str, advertise: str) -> list[str]:
    return [role, "--model", MODEL, "--host", "0.0.0.0", "--port", PORTS[role],
            "--advertise-host", advertise, "--redis-url", REDIS_URL, *SECRET_FLAGS]


def gpu_worker_command(role: str, advertise: str, gpu: int) -> list[str]:
    return cpu_worker_command(role, advertise) + [
        "--device", f"cuda:{gpu}", "--dtype", "bfloat16", "--kv-transport", "nixl",
        "--gpu-memory-utilization", "0.90"]


@functools.lru_cache(maxsize=None)
def _config(*files: Path, tracing: tuple[tuple[str, str], ...] = ()) -> dict:
    """The normalized config, with the host's tracing variables unset but for `tracing`."""
    env = {k: v for k, v in os.environ.items() if k not in TRACING_VARS} | dict(tracing)
    exe = needs_tool("docker-compose", "apt-get install docker-compose")
    args = [exe]
    for f in files:
        args += ["-f", str(f)]
    proc = subprocess.run(args + ["config"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


@pytest.fixture(scope="module")
def normalized() -> dict:
    return _config(COMPOSE)


@pytest.fixture(scope="module")
def gpu2() -> dict:
    return _config(COMPOSE, GPU2)


@pytest.fixture(scope="module")
def gpu8() -> dict:
    return _config(COMPOSE, GPU8)


@pytest.fixture(scope="module")
def gpu_tp() -> dict:
    return _config(COMPOSE, GPU_TP)


# --------------------------------------------------------------------------- the CPU stack

def test_services_present(normalized):
    assert set(normalized["services"]) == BASE_SERVICES
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
    assert svc["volumes"] == SERVING_VOLUMES
    assert "healthcheck" in svc


def test_secrets_come_first_and_stay_off_command_lines(normalized):
    """The token and Redis's password are made once into the secrets volume; Redis reads its
    password from a config file there, and its healthcheck authenticates from the file."""
    services = normalized["services"]
    made = services["secrets"]
    assert made["command"] == ["secrets", "--dir", "/secrets", "--redis-uid", "999"]
    assert made["volumes"] == ["secrets:/secrets:rw"] and made["restart"] == "no"
    redis = services["redis"]
    assert redis["command"][:2] == ["redis-server", "/secrets/redis.conf"]
    assert redis["volumes"] == ["secrets:/secrets:ro"]
    assert redis["depends_on"] == {"secrets": {"condition": "service_completed_successfully"}}
    assert "/secrets/redis-password" in " ".join(redis["healthcheck"]["test"])
    for name in ("prefill", "decode", "gateway"):
        command = services[name]["command"]
        assert _flag(command, "--cluster-token-file") == "/secrets/cluster-token"
        assert _flag(command, "--redis-password-file") == "/secrets/redis-password"
    assert "secrets" in normalized["volumes"]


def test_the_secrets_command_makes_files_once(tmp_path):
    from pdserve import deploy_secrets

    assert deploy_secrets.make(tmp_path) == ["cluster-token", "redis-password", "redis.conf"]
    token = (tmp_path / "cluster-token").read_text()
    assert deploy_secrets.make(tmp_path) == []
    assert (tmp_path / "cluster-token").read_text() == token
    password = (tmp_path / "redis-password").read_text().strip()
    assert (tmp_path / "redis.conf").read_text() == f"requirepass {password}\n"
    for name in ("cluster-token", "redis-password", "redis.conf"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o600


def test_model_service_fetches_into_the_volume(normalized):
    svc = normalized["services"]["model"]
    assert svc["command"] == ["model", "fetch", "--dest", MODEL]
    assert svc["restart"] == "no"
    assert "models" in normalized["volumes"]


def test_raw_file_parses_with_pyyaml():
    raw = yaml.safe_load(COMPOSE.read_text())
    assert BASE_SERVICES <= set(raw["services"])
    assert raw["services"]["gateway"]["ports"] == ["8000:8000", "50051:50051"]
    for name in ("prefill", "decode", "gateway", "model", "secrets"):
        assert raw["services"][name]["image"] == "pdserve:latest"
        assert raw["services"][name]["build"] == "."


def test_cpu_stack_has_no_gpu_settings(normalized):
    """docker-compose.yml alone is the CPU stack: CPU image, default device, dtype and
    transport, no GPU reservation and no host namespaces."""
    for name, svc in normalized["services"].items():
        assert not GPU_ONLY_KEYS & set(svc), (name, GPU_ONLY_KEYS & set(svc))
    for name in PDSERVE_SERVICES:
        svc = normalized["services"][name]
        assert svc["image"] == "pdserve:latest"
        assert svc["build"] == {"context": str(ROOT)}  # no build args: the Dockerfile's CPU torch
    for role in ("prefill", "decode"):
        assert normalized["services"][role]["command"] == cpu_worker_command(role, role)
    for name in ("prefill", "decode", "gateway"):
        assert normalized["services"][name]["environment"] == TRACING_ENV, name
    for name in ("secrets", "model", "redis"):
        assert "environment" not in normalized["services"][name], name


# --------------------------------------------------------------------------- the GPU variants

def _check_gpu_worker(svc: dict, gpus: list[str]) -> None:
    assert svc["image"] == CUDA_IMAGE
    assert svc["build"] == {"context": str(ROOT), "args": CUDA_BUILD_ARGS}
    assert svc["deploy"] == {"resources": {"reservations": {"devices": [
        {"driver": "nvidia", "device_ids": gpus, "capabilities": ["gpu"]}]}}}
    assert svc["ipc"] == "host"
    assert svc["pid"] == "host"
    assert svc["ulimits"] == {"memlock": -1}
    assert set(svc["cap_add"]) == GPU_CAPS and len(svc["cap_add"]) == len(GPU_CAPS)
    assert svc["environment"] == GPU_ENV | TRACING_ENV
    # With the host's IPC namespace /dev/shm is the host's: a shm_size would be ignored.
    assert "shm_size" not in svc
    # What the CPU stack gives a worker, unchanged.
    assert svc["volumes"] == SERVING_VOLUMES
    assert svc["restart"] == "unless-stopped"
    assert svc["depends_on"] == {"redis": {"condition": "service_healthy"},
                                 "model": {"condition": "service_completed_successfully"}}
    assert "ports" not in svc


def _check_layout(config: dict, layout: dict[str, tuple[str, int]], gpus: list[str]) -> None:
    services = config["services"]
    assert set(services) == BASE_SERVICES | set(layout)
    for name, (role, gpu) in layout.items():
        svc = services[name]
        _check_gpu_worker(svc, gpus)
        assert svc["command"] == gpu_worker_command(role, name, gpu)
        port = PORTS[role]
        assert svc["expose"] == [port]
        assert svc["healthcheck"] == {
            "test": ["CMD", "python", "-m", "cluster.health", "grpc", f"127.0.0.1:{port}"],
            "interval": "10s", "timeout": "5s", "start_period": "2m", "retries": 5}
    # One worker per GPU, every GPU used: disaggregation, not sharing.
    used = sorted(gpu for _, gpu in layout.values())
    assert used == [int(g) for g in gpus]


def _check_non_workers(config: dict, cpu: dict) -> None:
    services = config["services"]
    for name in ("gateway", "model", "secrets"):
        svc = services[name]
        assert not GPU_ONLY_KEYS & set(svc), (name, GPU_ONLY_KEYS & set(svc))  # no GPU
        assert svc["image"] == CUDA_IMAGE  # one image to build for the whole stack
        assert svc["build"] == {"context": str(ROOT), "args": CUDA_BUILD_ARGS}
        rest = {k: v for k, v in svc.items() if k not in ("image", "build")}
        assert rest == {k: v for k, v in cpu["services"][name].items()
                        if k not in ("image", "build")}
    assert services["redis"] == cpu["services"]["redis"]
    assert config["volumes"] == cpu["volumes"]


def test_gpu2_workers(gpu2):
    _check_layout(gpu2, GPU2_LAYOUT, ["0", "1"])


def test_gpu2_prefill_and_decode_on_different_gpus(gpu2):
    assert _flag(gpu2["services"]["prefill"]["command"], "--device") == "cuda:0"
    assert _flag(gpu2["services"]["decode"]["command"], "--device") == "cuda:1"


def test_gpu2_gateway_model_redis_reserve_no_gpu(gpu2, normalized):
    _check_non_workers(gpu2, normalized)


def test_gpu8_workers(gpu8):
    _check_layout(gpu8, GPU8_LAYOUT, [str(i) for i in range(8)])
    roles = [role for role, _ in GPU8_LAYOUT.values()]
    assert roles.count("prefill") == 4 and roles.count("decode") == 4


def test_gpu8_gateway_model_redis_reserve_no_gpu(gpu8, normalized):
    _check_non_workers(gpu8, normalized)


def test_gpu_tp_workers_split_over_three_gpus_each(gpu_tp, normalized):
    """Prefill ranks on GPUs 0-2, decode ranks on 3-5, KV over NCCL (NIXL cannot write a pool
    spread over ranks)."""
    services = gpu_tp["services"]
    assert set(services) == BASE_SERVICES
    for role, first in (("prefill", 0), ("decode", 3)):
        svc = services[role]
        _check_gpu_worker(svc, [str(i) for i in range(6)])
        base = gpu_worker_command(role, role, first)
        base[base.index("--kv-transport") + 1] = "torch"
        assert svc["command"] == base + ["--tensor-parallel-size", "3"]
    _check_non_workers(gpu_tp, normalized)


@pytest.mark.parametrize("variant", ["gpu2", "gpu8", "gpu_tp"])
def test_gpu_overrides_only_add_gpu_settings(variant, normalized, request):
    """Against the CPU stack, a GPU worker differs in its image, its command's GPU flags and
    the GPU-only keys, nothing else."""
    config = request.getfixturevalue(variant)
    for role in ("prefill", "decode"):
        cpu, gpu = normalized["services"][role], config["services"][role]
        assert set(gpu) - set(cpu) == GPU_ONLY_KEYS - {"shm_size"}
        assert set(cpu) <= set(gpu)
        assert gpu["environment"] == cpu["environment"] | GPU_ENV
        for key in set(cpu) - {"image", "build", "command", "environment"}:
            assert gpu[key] == cpu[key], (role, key)
        assert gpu["command"][:len(cpu["command"])] == cpu["command"]


@pytest.mark.parametrize("files", [(COMPOSE,), (COMPOSE, GPU2), (COMPOSE, GPU8),
                                   (COMPOSE, GPU_TP)], ids=["cpu", "gpu2", "gpu8", "gpu_tp"])
def test_the_hosts_otlp_endpoint_reaches_every_serving_process(files):
    """`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://collector:4317 docker compose up` traces the
    gateway and every worker (the 8-GPU file's added workers too)."""
    sent = (("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4317"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"))
    services = _config(*files, tracing=sent)["services"]
    serving = [n for n, svc in services.items() if svc["command"][0] in ROLES]
    assert {"prefill", "decode", "gateway"} <= set(serving)
    for name in serving:
        env = services[name]["environment"]
        assert {k: env.get(k) for k, _ in sent} == dict(sent), name


# --------------------------------------------------------------------------- what the workers load

# Every compose file, as it is used: alone (the CPU stack) or over docker-compose.yml.
STACKS = {"cpu": (COMPOSE,), "gpu2": (COMPOSE, GPU2), "gpu8": (COMPOSE, GPU8),
          "gpu_tp": (COMPOSE, GPU_TP)}


def test_every_compose_file_is_checked():
    assert set(ROOT.glob("docker-compose*.yml")) == {f for fs in STACKS.values() for f in fs}


def _services(files: tuple[Path, ...]) -> dict:
    """The services of FILES merged as compose does for what the checks below read: an
    override's command and deploy replace the base's (none of the base's services has a
    deploy), an override's new services are added."""
    services: dict = {}
    for f in files:
        for name, svc in yaml.safe_load(f.read_text())["services"].items():
            services[name] = {**services.get(name, {}), **svc}
    return services


@pytest.mark.parametrize("stack", STACKS)
def test_every_worker_can_split_its_model_as_its_command_says(stack, model_dir):
    """Each worker's command, read by that worker's own parser: its model is the one the
    `model` service fetches (the default model, fetched here too), its tensor-parallel size
    passes the check a worker makes at start (engine.parallel.check_split) on that model's
    config.json, and on GPUs its ranks (--device and the size - 1 GPUs after it) are GPUs its
    service reserves, none shared with another worker."""
    from engine.config import ModelConfig
    from engine.parallel import check_split
    from pdserve.cli import role_parser

    services = _services(STACKS[stack])
    fetched = _flag(services["model"]["command"], "--dest")
    assert Path(fetched).name == model_dir.name         # `model fetch` gets the default model
    config = ModelConfig.from_dir(model_dir)
    owner: dict[int, str] = {}
    workers = [(name, svc) for name, svc in services.items()
               if (svc.get("command") or [""])[0] in ("prefill", "decode")]
    assert {svc["command"][0] for _, svc in workers} == {"prefill", "decode"}
    for name, svc in workers:
        args = role_parser(svc["command"][0]).parse_args(svc["command"][1:])
        assert args.model == fetched, f"{name} serves {args.model}, which nothing fetches"
        check_split(config, args.tensor_parallel_size)  # ValueError: what does not split
        if not args.device.startswith("cuda"):
            assert "deploy" not in svc
            continue
        first = int(args.device.partition(":")[2] or 0)
        ranks = range(first, first + args.tensor_parallel_size)
        reserved = {int(d) for d in
                    svc["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]}
        assert set(ranks) <= reserved, (name, list(ranks), sorted(reserved))
        for gpu in ranks:
            assert gpu not in owner, f"GPU {gpu}: {owner.get(gpu)} and {name}"
            owner[gpu] = name


# --------------------------------------------------------------------------- the image

def _dockerfile_args() -> dict[str, str | None]:
    args = {}
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        m = re.match(r"\s*ARG\s+(\w+)(?:=(\S+))?\s*$", line)
        if m:
            args[m.group(1)] = m.group(2)
    return args


def _makefile_pin(var: str) -> str:
    m = re.search(rf"^{var} \?= \w+==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, f"{var} pin not found in the Makefile"
    return m.group(1)


def test_dockerfile_cpu_default_and_pins():
    args = _dockerfile_args()
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert args["TORCH_VERSION"] == _makefile_pin("TORCH")
    assert args["TRITON_VERSION"] == _makefile_pin("TRITON")
    text = (ROOT / "Dockerfile").read_text()
    # The project's install is held to the torch (and a CUDA torch's own triton) installed first.
    assert "pip install -c /etc/pdserve-constraints.txt -e ." in text


@pytest.mark.parametrize("override", [GPU2, GPU8, GPU_TP], ids=lambda p: p.name)
def test_gpu_build_args_are_dockerfile_args(override):
    raw = yaml.safe_load(override.read_text())
    declared = _dockerfile_args()
    for name in PDSERVE_SERVICES:
        build = raw["services"][name]["build"]
        assert build["args"] == CUDA_BUILD_ARGS
        assert set(build["args"]) <= set(declared), set(build["args"]) - set(declared)
