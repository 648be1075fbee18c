"""The cpu overlay of deploy/k8s cannot drift from the code: its containers' commands, args and
env are started here as local processes (the image's entrypoint `pdserve`; every Service and
container port mapped to a free loopback port; the ConfigMap's flag files, the Secret and the
model volume mapped to local folders; $(POD_IP) is 127.0.0.1), and the gateway then answers a
chat request. A flag the manifests pass that the CLI does not know ends a process here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import needs_tool
from tests.stack import free_port
from tests.test_k8s import deployment, flags_configmap, objects
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
START_ORDER = ("redis", "prefill", "decode", "gateway")


class Mapping:
    """Cluster names, paths and ports -> this machine's."""

    def __init__(self, tmp: Path, model_dir: Path) -> None:
        self.paths = {"/etc/pdserve/flags": tmp / "flags", "/secrets": tmp / "secrets",
                      "/models/SmolLM2-135M-Instruct": model_dir, "/tmp": tmp / "home",
                      "/cache": Path(os.environ.get("PDSERVE_CACHE", "")) if
                      os.environ.get("PDSERVE_CACHE") else Path.home() / ".cache" / "pdserve"}
        self.ports: dict[int, int] = {}
        self.hosts: dict[str, str] = {}

    def port(self, p: int) -> int:
        return self.ports.setdefault(p, free_port())

    def text(self, s: str) -> str:
        """One pass (a replacement is not read again): hosts, then paths, then the port and
        bind flags."""
        keys = sorted([*self.hosts, *self.paths], key=len, reverse=True)
        pattern = "|".join(rf"(?<![\w{'.-' if k in self.hosts else '/'}]){re.escape(k)}(?![\w-])"
                           for k in keys)
        s = re.sub(pattern, lambda g: str(self.hosts.get(g.group(0)) or
                                          self.paths[g.group(0)]), s)
        return re.sub(r"--(host|http-port|grpc-port|port|metrics-port)=(\S+)", self._flag, s)

    def _flag(self, m: re.Match) -> str:
        name, value = m.groups()
        if name == "host":
            return "--host=127.0.0.1"
        return f"--{name}={self.port(int(value))}"


def _env(container: dict, mapping: Mapping, name: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PDSERVE_API_KEY", "PDSERVE_CLUSTER", "PDSERVE_REDIS"))}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = mapping.text(e["value"])
        else:
            field = e["valueFrom"]["fieldRef"]["fieldPath"]
            env[e["name"]] = {"status.podIP": "127.0.0.1", "metadata.name": name}[field]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


def test_the_cpu_overlay_runs_as_local_processes_and_answers_a_chat(tmp_path, model_dir):
    redis_server = needs_tool("redis-server")
    m = Mapping(tmp_path, Path(model_dir))
    for d in m.paths.values():
        d.mkdir(parents=True, exist_ok=True)
    for name, text in flags_configmap("cpu")["data"].items():
        (tmp_path / "flags" / name).write_text(m.text(text))
    subprocess.run([sys.executable, "-m", "pdserve.cli", "secrets", "--dir",
                    str(tmp_path / "secrets"), "--api-key"], check=True, cwd=ROOT,
                   capture_output=True)
    for svc in objects("cpu", "Service"):
        for p in svc["spec"]["ports"]:
            m.hosts[f"{svc['metadata']['name']}:{p['port']}"] = f"127.0.0.1:{m.port(p['port'])}"
    procs = []
    try:
        for role in START_ORDER:
            c = deployment("cpu", role)["spec"]["template"]["spec"]["containers"][0]
            env = _env(c, m, f"pdserve-{role}")
            if role == "redis":
                # redis-server listens on its default port: mapped like the Service's
                cmd = [redis_server, *[m.text(a) for a in c["args"][1:]],
                       "--port", str(m.port(6379)), "--bind", "127.0.0.1"]
            else:
                assert c["image"].split(":")[0] == "pdserve"        # ENTRYPOINT ["pdserve"]
                args = [re.sub(r"\$\((\w+)\)", lambda g: env[g.group(1)], m.text(a))
                        for a in c["args"]]
                cmd = [sys.executable, "-m", "pdserve.cli", *args]
            log = open(tmp_path / f"{role}.log", "w")
            procs.append((role, subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=log,
                                                 stderr=subprocess.STDOUT), log))
        base = f"http://127.0.0.1:{m.port(8000)}"
        logs = [(p, tmp_path / f"{r}.log") for r, p, _ in procs]

        def ready() -> bool:
            try:
                return httpx.get(base + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(ready, 240, "the gateway ready (a worker of each role)", logs)
        key = (tmp_path / "secrets" / "api-keys").read_text().strip()
        body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "Say hello."}]}
        assert httpx.post(base + "/v1/chat/completions", json=body,
                          timeout=60).status_code == 401          # the API key is required
        resp = httpx.post(base + "/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert out["choices"][0]["message"]["content"] and out["usage"]["completion_tokens"] > 0
        metrics = httpx.get(base + "/metrics", timeout=5).text
        assert 'pdserve_pool_workers{pool="decode"} 1.0' in metrics
    except BaseException:
        for role, _, _ in procs:
            print(f"--- {role}\n" + (tmp_path / f"{role}.log").read_text()[-3000:])
        raise
    finally:
        for _, p, _ in reversed(procs):
            p.terminate()
        for _, p, log in reversed(procs):
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
            log.close()
