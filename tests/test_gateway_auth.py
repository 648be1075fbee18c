"""API keys and TLS on the gateway, as a real process with certificates made here (a CA and a
server certificate for 127.0.0.1): the official `openai` client with a key and the CA works;
no key or a wrong one is a 401 in OpenAI's error body (UNAUTHENTICATED on gRPC); /health stays
open unless --protect-metrics; plain HTTP to the TLS port does not get an answer."""

from __future__ import annotations

import ssl
import subprocess

import grpc
import httpx
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.conftest import needs_tool
from tests.stack import Stack, wait_until

pytestmark = pytest.mark.slow

KEYS = ("sk-first-key", "sk-second-key")


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    needs_tool("openssl")
    d = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             "/CN=pdserve test CA", "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout",
             "server.key", "-out", "server.csr", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "server.pem", cwd=d)
    return d


@pytest.fixture(scope="module")
def gateway(model_dir, certs, tmp_path_factory):
    """A gateway (no workers: requests that pass authentication get 503) over TLS with two
    keys, one from --api-key and one from a key file."""
    keyfile = certs / "keys.txt"
    keyfile.write_text(f"# team keys\n{KEYS[1]}\n")
    s = Stack(str(model_dir), tmp_path_factory.mktemp("auth"))
    try:
        s.start_redis()
        g = s.start_gateway("--api-key", KEYS[0], "--api-key-file", str(keyfile),
                            "--ssl-certfile", str(certs / "server.pem"),
                            "--ssl-keyfile", str(certs / "server.key"))
        base = g.http.replace("http://", "https://")
        ca = ssl.create_default_context(cafile=str(certs / "ca.pem"))

        def up() -> bool:
            try:
                return httpx.get(base + "/health", verify=ca, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(up, 60, "gateway over TLS", [(g.popen, g.log)])
        yield base, g.address, ca, g
    except BaseException:
        print(s.logs())
        raise
    finally:
        s.stop()


def test_openai_client_with_a_key_and_the_ca(gateway):
    import openai

    base, _, ca, _ = gateway
    for key in KEYS:
        with openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0,
                           http_client=httpx.Client(verify=ca)) as client:
            assert client.models.list().data[0].id
            with pytest.raises(openai.APIStatusError) as e:   # authenticated: no worker here
                client.completions.create(model="x", prompt="hi", max_tokens=2)
            assert e.value.status_code in (404, 503)
    with openai.OpenAI(base_url=base + "/v1", api_key="sk-wrong", max_retries=0,
                       http_client=httpx.Client(verify=ca)) as client:
        with pytest.raises(openai.AuthenticationError) as e:
            client.models.list()
        assert e.value.body["code"] == "invalid_api_key"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "sk-first-key"},
                                     {"Authorization": "Bearer sk-first-keyX"},
                                     {"Authorization": "Basic c2stZmlyc3Qta2V5"}])
def test_missing_or_wrong_keys_are_401_with_an_openai_body(gateway, headers):
    base, _, ca, _ = gateway
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                         ("POST", "/tokenize"), ("GET", "/version"), ("POST", "/invocations")):
        r = httpx.request(method, base + path, headers=headers, json={}, verify=ca)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(base + "/health", verify=ca).status_code == 200
    assert httpx.get(base + "/metrics", verify=ca).status_code == 200
    assert httpx.get(base + "/ping", verify=ca).status_code == 200


def test_plain_http_to_the_tls_port_gets_no_answer(gateway):
    base, _, _, _ = gateway
    with pytest.raises(httpx.HTTPError):
        httpx.get(base.replace("https://", "http://") + "/health", timeout=5)


def test_grpc_over_tls_needs_the_key(gateway, certs):
    address = gateway[1]
    creds = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
    with grpc.secure_channel(address, creds) as ch:
        stub = pb_grpc.GenerationStub(ch)
        req = pb.GenerateRequest(text="hi", params=pb.SamplingParams(max_tokens=2))
        for metadata in ((), (("authorization", "Bearer sk-nope"),)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, metadata=metadata, timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:          # authenticated: no worker here
            list(stub.Generate(req, metadata=(("authorization", f"Bearer {KEYS[1]}"),),
                               timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_keys_never_reach_the_log(gateway):
    *_, g = gateway
    text = g.log.read_text()
    assert "2 API key(s)" in text and all(k not in text for k in KEYS)


def test_protect_metrics_closes_health_and_metrics(model_dir, tmp_path):
    s = Stack(str(model_dir), tmp_path)
    try:
        s.start_redis()
        g = s.start_gateway("--protect-metrics", env_key="sk-env-key")
        wait_until(lambda: _status(g.http + "/health", "sk-env-key") == 200, 60, "gateway",
                   [(g.popen, g.log)])
        assert _status(g.http + "/health") == 401 and _status(g.http + "/metrics") == 401
        assert _status(g.http + "/metrics", "sk-env-key") == 200
    finally:
        s.stop()


def _status(url: str, key: str | None = None) -> int:
    try:
        return httpx.get(url, headers={"Authorization": f"Bearer {key}"} if key else {},
                         timeout=2).status_code
    except httpx.HTTPError:
        return 0


def test_mutual_tls_needs_a_client_certificate_the_ca_signed(model_dir, certs, tmp_path):
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=client", "-keyout",
             "client.key", "-out", "client.csr", cwd=certs)
    _openssl("x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "2", "-out", "client.pem", cwd=certs)
    s = Stack(str(model_dir), tmp_path)
    try:
        s.start_redis()
        g = s.start_gateway("--ssl-certfile", str(certs / "server.pem"), "--ssl-keyfile",
                            str(certs / "server.key"), "--ssl-ca-certs", str(certs / "ca.pem"))
        base = g.http.replace("http://", "https://")
        mine = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        mine.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key"))
        anon = ssl.create_default_context(cafile=str(certs / "ca.pem"))

        def status(ctx) -> int:
            try:
                return httpx.get(base + "/health", verify=ctx, timeout=3).status_code
            except httpx.HTTPError:
                return 0
        wait_until(lambda: status(mine) == 200, 60, "gateway over mutual TLS",
                   [(g.popen, g.log)])
        assert status(anon) == 0                     # the handshake is refused
        ca = (certs / "ca.pem").read_bytes()
        with grpc.secure_channel(g.address, grpc.ssl_channel_credentials(
                ca, (certs / "client.key").read_bytes(),
                (certs / "client.pem").read_bytes())) as ch:
            from grpc_health.v1 import health_pb2, health_pb2_grpc
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=5).status == 1
        with grpc.secure_channel(g.address, grpc.ssl_channel_credentials(ca)) as ch:
            from grpc_health.v1 import health_pb2, health_pb2_grpc
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        s.stop()
