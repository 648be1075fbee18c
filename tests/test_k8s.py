"""deploy/k8s without a cluster: every overlay renders (`kubectl kustomize`), its core objects
validate against Kubernetes' schemas offline (kubernetes-validate, strict: an unknown field is an
error) and its custom resources against their CRDs' vendored schemas (deploy/k8s/schemas, unknown
fields refused as an API server with strict field validation does); the policies hold; and what
the manifests pass to pdserve parses with pdserve's own CLI. tests/test_k8s_local.py starts the
cpu overlay's processes for real."""

from __future__ import annotations

import copy
import functools
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.conftest import needs_tool

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ["cpu", "gpu", "tp", "ep", "keda", "inference-pool"]
KUBE_VERSION = "1.32.0"          # native gRPC probes: 1.27 on
CRDS = {("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_v1alpha1_scaledobject.json",
        ("inference.networking.k8s.io/v1", "InferencePool"):
            "inference.networking.k8s.io_v1_inferencepool.json"}
ROLES = ("gateway", "prefill", "decode")
FLAGS_DIR = "/etc/pdserve/flags"


def render(path: Path) -> list[dict]:
    kubectl = needs_tool("kubectl", "it renders the overlays: kubectl kustomize")
    out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@functools.cache
def rendered(overlay: str) -> tuple:
    return tuple(render(K8S / "overlays" / overlay))


def objects(overlay: str, kind: str) -> list[dict]:
    return [copy.deepcopy(d) for d in rendered(overlay) if d["kind"] == kind]


def deployment(overlay: str, role: str) -> dict:
    return next(d for d in objects(overlay, "Deployment")
                if d["metadata"]["name"] == f"pdserve-{role}")


def flags_configmap(overlay: str) -> dict:
    return next(c for c in objects(overlay, "ConfigMap")
                if c["metadata"]["name"].startswith("pdserve-flags"))


def command_line(overlay: str, role: str) -> list[str]:
    """The container's pdserve arguments, the flags file read in and $(VAR)s filled from its
    env (downward-API values by a stand-in)."""
    c = deployment(overlay, role)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value", f"<{e['name']}>") for e in c.get("env", [])}
    files = flags_configmap(overlay)["data"]
    out = []
    for arg in c["args"]:
        arg = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)
        if arg.startswith("@"):
            assert arg[1:].startswith(FLAGS_DIR + "/"), arg
            for line in files[arg[1:].rsplit("/", 1)[1]].splitlines():
                out += shlex.split(line, comments=True)
        else:
            out.append(arg)
    return out


def strict(schema):
    """The schema with unknown fields refused wherever it lists the fields."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@functools.cache
def crd_schema(api_version: str, kind: str) -> dict:
    schema = json.loads((K8S / "schemas" / CRDS[(api_version, kind)]).read_text())
    schema.pop("$comment", None)
    schema = strict(schema)
    schema["properties"]["metadata"] = {"type": "object"}     # the API server checks it
    return schema


def validate(doc: dict) -> None:
    key = (doc["apiVersion"], doc["kind"])
    if key in CRDS:
        jsonschema.validate(doc, crd_schema(*key))
    else:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def containers(doc: dict, init: bool = True) -> list[dict]:
    spec = doc["spec"]["template"]["spec"]
    return spec["containers"] + (spec.get("initContainers", []) if init else [])


# ---------------------------------------------------------------------------- rendering, schemas

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_and_validates_offline(overlay):
    docs = rendered(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget",
            "NetworkPolicy"} <= kinds
    for doc in docs:
        validate(doc)
        assert doc["metadata"].get("namespace") == "pdserve", doc["metadata"]["name"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pdserve"


def test_the_validators_refuse_what_an_api_server_refuses():
    gw = deployment("cpu", "gateway")
    gw["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(gw)
    so = objects("keda", "ScaledObject")[0]
    so["spec"]["triggers"][0]["metadta"] = {}
    with pytest.raises(jsonschema.ValidationError):
        validate(so)
    pool = objects("inference-pool", "InferencePool")[0]
    pool["spec"]["targetPorts"] = []                      # minItems 1
    with pytest.raises(jsonschema.ValidationError):
        validate(pool)


def test_the_vendored_crd_schemas_are_the_served_versions():
    for (api_version, kind), name in CRDS.items():
        text = (K8S / "schemas" / name).read_text()
        assert f"{api_version} {kind}" in json.loads(text)["$comment"]


# ---------------------------------------------------------------------------- policies

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_is_bounded_probed_and_unprivileged(overlay):
    for d in objects(overlay, "Deployment"):
        spec = d["spec"]["template"]["spec"]
        name = d["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["automountServiceAccountToken"] is False, name
        for c in containers(d):
            where = f"{name}/{c['name']}"
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][bound]), where
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert set(sc["capabilities"].get("add", [])) <= {"IPC_LOCK"}, where
            image = c["image"]
            assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), where
            for e in c.get("env", []):
                if re.search(r"TOKEN|PASSWORD|SECRET|API_KEY", e["name"]):
                    assert "value" not in e, f"{where}: {e['name']} is a literal"
        for c in containers(d, init=False):
            assert "readinessProbe" in c and "livenessProbe" in c, name
            if name != "pdserve-redis":
                assert "startupProbe" in c, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_secret_is_written_in_the_manifests(overlay):
    assert not objects(overlay, "Secret")
    for c in objects(overlay, "ConfigMap"):
        for key, value in c.get("data", {}).items():
            assert not re.search(r"(?i)password|token|api-key\b", key + " " + value
                                 .replace("--cluster-token-file", "")
                                 .replace("--redis-password-file", "")), (key, value)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_grace_period_covers_the_drain(overlay):
    """terminationGracePeriodSeconds >= preStop + --drain-timeout + 5 s to exit."""
    for role in ROLES:
        args = command_line(overlay, role)
        drain = float(args[args.index("--drain-timeout") + 1])
        spec = deployment(overlay, role)["spec"]["template"]["spec"]
        pre = spec["containers"][0].get("lifecycle", {}).get("preStop", {})
        sleep = float(pre["exec"]["command"][1]) if pre else 0.0
        assert spec["terminationGracePeriodSeconds"] >= sleep + drain + 5, role


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_advertise_the_pod_ip(overlay):
    for role in ("prefill", "decode"):
        c = deployment(overlay, role)["spec"]["template"]["spec"]["containers"][0]
        assert "--advertise-host=$(POD_IP)" in c["args"]
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    for role in ROLES:
        line = " ".join(command_line(overlay, role))
        assert "localhost" not in line and "127.0.0.1" not in line, (role, line)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_manifests_flags_are_the_clis(overlay):
    from pdserve.cli import build_parser

    for role in ROLES:
        args = build_parser().parse_args(command_line(overlay, role))      # exits if unknown
        assert args.command == role
        c = deployment(overlay, role)["spec"]["template"]["spec"]["containers"][0]
        ports = {p["containerPort"] for p in c["ports"]}
        mine = ({args.http_port, args.grpc_port} if role == "gateway"
                else {args.port, args.metrics_port})
        assert mine == ports, role


def test_a_flag_the_cli_does_not_know_fails():
    from pdserve.cli import build_parser

    args = command_line("cpu", "decode") + ["--decode-speed", "fast"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(args)


def test_only_the_gateway_reaches_the_workers_grpc_ports_and_only_pdserve_redis():
    pols = {p["metadata"]["name"]: p for p in objects("cpu", "NetworkPolicy")}
    for role, port in (("prefill", 50061), ("decode", 50071)):
        rules = pols[f"pdserve-{role}"]["spec"]["ingress"]
        other = "decode" if role == "prefill" else "prefill"
        for rule in rules:
            peers = [p.get("podSelector", {}).get("matchLabels", {}).get(
                "app.kubernetes.io/component") for p in rule["from"]]
            ports = [p["port"] for p in rule.get("ports", [])]
            if port in ports or not ports:
                assert set(peers) <= {"gateway", other}, (role, rule)
            else:
                assert ports == [port + 100], (role, rule)      # metrics only
    (rule,) = pols["pdserve-redis"]["spec"]["ingress"]
    sel = rule["from"][0]["podSelector"]
    assert sel["matchLabels"] == {"app.kubernetes.io/name": "pdserve"}
    assert sel["matchExpressions"][0]["values"] == ["gateway", "prefill", "decode"]


def test_the_gpu_overlays_give_each_worker_its_gpus():
    for overlay, gpus in (("gpu", 1), ("tp", 3)):
        for role in ("prefill", "decode"):
            args = command_line(overlay, role)
            c = deployment(overlay, role)["spec"]["template"]["spec"]["containers"][0]
            assert c["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
            assert args[args.index("--device") + 1] == "cuda:0"
            assert args[args.index("--dtype") + 1] == "bfloat16"
            tp = int(args[args.index("--tensor-parallel-size") + 1]) if gpus > 1 else 1
            assert tp == gpus
            assert args[args.index("--kv-transport") + 1] == ("nixl" if gpus == 1 else "torch")
        for role in ROLES:
            vols = {v["name"]: v for v in deployment(overlay, role)["spec"]["template"]["spec"]
                    ["volumes"]}
            assert vols["models"]["persistentVolumeClaim"]["claimName"] == "pdserve-models"


def test_the_ep_overlay_starts_an_expert_parallel_decode_pool():
    """Decode over 4 GPUs with the experts split whole, prefill over 2 (tensor parallel), each
    size one the worker's start check accepts for Qwen3-30B-A3B's shape."""
    from engine.config import ModelConfig
    from engine.parallel import check_split
    from pdserve.bench.stepbench import SHAPES

    model = ModelConfig.from_hf(dict(SHAPES["qwen3-30b-a3b"], num_hidden_layers=48))
    for role, gpus, ep in (("prefill", 2, False), ("decode", 4, True)):
        args = command_line("ep", role)
        c = deployment("ep", role)["spec"]["template"]["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
        assert int(args[args.index("--tensor-parallel-size") + 1]) == gpus
        assert ("--expert-parallel" in args) == ep
        assert args[args.index("--model") + 1] == "/models/Qwen3-30B-A3B"
        check_split(model, gpus, ep)


def test_the_scaling_queries_name_the_gateways_metrics():
    from prometheus_client.parser import text_string_to_metric_families

    from cluster.metrics import GatewayMetrics
    from cluster.registry import WorkerInfo

    m = GatewayMetrics()
    m.set_pools({"prefill": [WorkerInfo("p", "prefill", "h:1", "m", 16, 0, "float32", 1, 1, 1,
                                        10)], "decode": []})
    names = {s.name for f in text_string_to_metric_families(m.exposition()[0].decode())
             for s in f.samples}
    queries = [t["metadata"]["query"] for so in objects("keda", "ScaledObject")
               for t in so["spec"]["triggers"]]
    assert {so["spec"]["scaleTargetRef"]["name"] for so in objects("keda", "ScaledObject")} == {
        "pdserve-prefill", "pdserve-decode"}
    for q in queries:
        for name in re.findall(r"pdserve_\w+", q):
            assert name in names, (name, q)


def test_the_inference_pool_selects_the_gateways():
    (pool,) = objects("inference-pool", "InferencePool")
    gw = deployment("inference-pool", "gateway")
    labels = gw["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = [p["containerPort"] for p in gw["spec"]["template"]["spec"]["containers"][0]["ports"]]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [8000] and 8000 in ports


def test_the_core_validation_needs_no_network(tmp_path):
    """kubernetes-validate reads the schemas it bundles: the check runs in a network namespace
    of its own (no interface but loopback, no name resolution)."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a network namespace here (unshare -n needs root)")
    doc = tmp_path / "gateway.json"
    doc.write_text(json.dumps(deployment("cpu", "gateway")))
    code = ("import json, socket, sys, kubernetes_validate\n"
            "try:\n    socket.create_connection(('pypi.org', 443), timeout=3)\n"
            "    sys.exit('the namespace has a network')\nexcept OSError:\n    pass\n"
            f"kubernetes_validate.validate(json.load(open({str(doc)!r})), {KUBE_VERSION!r}, "
            "strict=True)\n")
    out = subprocess.run(["unshare", "-n", sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
