"""`pdserve up` under TLS, mutual TLS and API keys: the command of docs/operations.md as a user
runs it, and the probe `up` waits on its gateway with (GatewayProbe) against a small HTTPS
server that asks for client certificates the way the gateway does.

Certificates are made here with the openssl CLI: a CA; a server certificate for 127.0.0.1 for
server authentication only (so it cannot stand in for a client); a client certificate; a
server certificate without extendedKeyUsage (valid for both); a certificate of another CA."""

from __future__ import annotations

import http.server
import json
import signal
import ssl
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from pdserve import cli
from pdserve.launcher import GatewayProbe, child_commands
from tests.conftest import needs_tool
from tests.stack import free_port
from tests.up_process import (START_TIMEOUT_S, Up, assert_all_gone, listening, sessions_left,
                              stream_chat)

KEY = "sk-mine"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _signed(d: Path, name: str, subject: str, extensions: str) -> None:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout",
             f"{name}.key", "-out", f"{name}.csr", cwd=d)
    (d / f"{name}.ext").write_text(extensions)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem",
             cwd=d)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    needs_tool("openssl")
    d = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             "/CN=pdserve test CA", "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    san = "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
    _signed(d, "server", "/CN=127.0.0.1", san + "extendedKeyUsage=serverAuth\n")
    _signed(d, "client", "/CN=client", "extendedKeyUsage=clientAuth\n")
    _signed(d, "anyuse", "/CN=127.0.0.1", san)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             "/CN=stranger", "-keyout", "stranger.key", "-out", "stranger.pem", cwd=d)
    return d


# ---- the probe ----------------------------------------------------------------------------

class MutualTLSHealth:
    """GET /health over mutual TLS on a free port, as the gateway answers it once it sees both
    workers; with `key`, only to `Authorization: Bearer KEY` (--protect-metrics)."""

    def __init__(self, certs: Path, server: str, key: str | None = None) -> None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(certs / f"{server}.pem", certs / f"{server}.key")
        context.load_verify_locations(certs / "ca.pem")
        context.verify_mode = ssl.CERT_REQUIRED

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                ok = key is None or self.headers.get("Authorization") == f"Bearer {key}"
                body = json.dumps({"status": "ok", "workers": {"prefill": 1, "decode": 1}}
                                  if ok else {"error": "invalid_api_key"}).encode()
                self.send_response(200 if ok else 401)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def serve(certs):
    servers = []

    def start(server: str = "server", key: str | None = None) -> MutualTLSHealth:
        servers.append(MutualTLSHealth(certs, server, key))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def _probe(certs: Path, port: int, *up_argv: str, server: str = "server",
           client: str | None = None) -> GatewayProbe:
    """The probe `pdserve up --ssl-* (the SERVER certificate, the CA) UP_ARGV` would use; with
    CLIENT, that certificate as --ssl-client-certfile/--ssl-client-keyfile."""
    args = cli.build_parser().parse_args([
        "up", "--ssl-certfile", str(certs / f"{server}.pem"), "--ssl-keyfile",
        str(certs / f"{server}.key"), "--ssl-ca-certs", str(certs / "ca.pem"), *up_argv])
    gateway = child_commands(args, Path("/models/smol"), "redis://127.0.0.1:6390/0",
                             num_gpus=1)["gateway"]
    if client:
        return GatewayProbe.for_gateway(gateway, port, str(certs / f"{client}.pem"),
                                        str(certs / f"{client}.key"))
    return GatewayProbe.for_gateway(gateway, port, args.ssl_client_certfile,
                                    args.ssl_client_keyfile)


def test_probe_presents_the_client_certificate_it_is_given(certs, serve):
    gateway = serve()
    probe = _probe(certs, gateway.port, client="client")
    assert probe.url == f"https://127.0.0.1:{gateway.port}/health"
    assert probe.client_cert == (str(certs / "client.pem"), str(certs / "client.key"))
    assert probe() is True


def test_probe_presents_the_servers_own_certificate_by_default(certs, serve):
    """A server certificate the CA signed for any use (no extendedKeyUsage) is a client
    certificate too: `up --ssl-certfile --ssl-keyfile --ssl-ca-certs` needs nothing more."""
    gateway = serve("anyuse")
    probe = _probe(certs, gateway.port, server="anyuse")
    assert probe.client_cert == (str(certs / "anyuse.pem"), str(certs / "anyuse.key"))
    assert probe() is True


@pytest.mark.parametrize("server,client,alert", [
    ("server", None, "UNSUPPORTED_CERTIFICATE"),     # its own: for server authentication only
    ("server", "stranger", "UNKNOWN_CA"),
])
def test_a_refused_certificate_stops_up_at_once(certs, serve, server, client, alert):
    gateway = serve(server)
    probe = _probe(certs, gateway.port, server=server, client=client)
    with pytest.raises(SystemExit) as exc:
        probe()
    message = str(exc.value)
    assert f"the gateway refused the client certificate {certs / (client or server)}.pem" \
        in message and alert in message
    assert "--ssl-client-certfile/--ssl-client-keyfile" in message


def test_probe_sends_a_key_where_health_needs_one(certs, serve, monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", f"{KEY},sk-other")
    gateway = serve(key=KEY)
    assert _probe(certs, gateway.port, client="client").headers == {}  # /health is open
    probe = _probe(certs, gateway.port, "--protect-metrics", client="client")
    assert probe.headers == {"Authorization": f"Bearer {KEY}"} and probe.keyed
    assert probe() is True
    late = _probe(certs, gateway.port, "--gateway-args=--protect-metrics", client="client")
    assert late.headers == probe.headers                # the gateway's last word counts
    with pytest.raises(SystemExit, match="wants an API key on /health"):
        GatewayProbe(probe.url, {}, probe.context, probe.client_cert, keyed=True)()


def test_probe_waits_while_nothing_answers(certs):
    assert _probe(certs, free_port(), client="client")() is False


def test_plain_and_one_way_tls_probes(certs):
    args = cli.build_parser().parse_args(["up"])
    plain = GatewayProbe.for_gateway(child_commands(args, Path("/m"), "redis://r", 1)["gateway"],
                                     8000)
    assert (plain.url, plain.context, plain.client_cert) == ("http://127.0.0.1:8000/health",
                                                             None, None)
    args = cli.build_parser().parse_args(["up", "--ssl-certfile", str(certs / "server.pem"),
                                          "--ssl-keyfile", str(certs / "server.key")])
    tls = GatewayProbe.for_gateway(child_commands(args, Path("/m"), "redis://r", 1)["gateway"],
                                   8000)
    assert tls.url == "https://127.0.0.1:8000/health"
    assert tls.context is not None and tls.client_cert is None


@pytest.mark.parametrize("argv,message", [
    (["--ssl-client-certfile", "c.pem"], "--ssl-client-certfile and --ssl-client-keyfile go "
                                         "together"),
    (["--ssl-client-keyfile", "c.key"], "go together"),
    (["--ssl-client-certfile", "missing.pem", "--ssl-client-keyfile", "missing.key"],
     "cannot load the client certificate missing.pem"),
])
def test_bad_client_certificate_flags_stop_up_before_the_workers_start(certs, argv, message):
    with pytest.raises(SystemExit, match=message):
        _probe(certs, 8000, *argv)


def test_a_client_certificate_needs_mutual_tls(certs):
    args = cli.build_parser().parse_args([
        "up", "--ssl-certfile", str(certs / "server.pem"), "--ssl-keyfile",
        str(certs / "server.key"), "--ssl-client-certfile", str(certs / "client.pem"),
        "--ssl-client-keyfile", str(certs / "client.key")])
    with pytest.raises(SystemExit, match="it needs --ssl-ca-certs"):
        GatewayProbe.for_gateway(child_commands(args, Path("/m"), "redis://r", 1)["gateway"],
                                 8000, args.ssl_client_certfile, args.ssl_client_keyfile)


# ---- docs/operations.md's command ---------------------------------------------------------

@pytest.mark.slow
def test_up_with_api_keys_and_mutual_tls_as_the_docs_run_it(model_dir, certs, tmp_path):
    """`PDSERVE_API_KEY=sk-mine pdserve up --ssl-certfile server.pem --ssl-keyfile server.key
    --ssl-ca-certs ca.pem --ssl-client-certfile client.pem --ssl-client-keyfile client.key`
    comes up; the official client with the key and the client certificate gets a streamed
    answer; without the certificate the handshake is refused, without the key it is a 401;
    SIGTERM stops everything."""
    import openai

    up = Up(model_dir, tmp_path, "--ssl-certfile", str(certs / "server.pem"),
            "--ssl-keyfile", str(certs / "server.key"), "--ssl-ca-certs", str(certs / "ca.pem"),
            "--ssl-client-certfile", str(certs / "client.pem"),
            "--ssl-client-keyfile", str(certs / "client.key"), env={"PDSERVE_API_KEY": KEY})
    try:
        up.wait_ready()
        assert "(API keys required) over mutual TLS" in up.output()
        base = f"https://127.0.0.1:{up.ports['http']}/v1"
        mine = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        mine.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key"))
        with httpx.Client(verify=mine, timeout=120) as http:
            client = openai.OpenAI(base_url=base, api_key=KEY, http_client=http, max_retries=0)
            assert "Paris" in stream_chat(client, "What is the capital of France?")
            assert http.get(base + "/models").status_code == 401          # no key
        anonymous = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        with pytest.raises(httpx.TransportError):
            httpx.get(base + "/models", verify=anonymous, timeout=10,
                      headers={"Authorization": f"Bearer {KEY}"})

        code, children = up.stop(signal.SIGTERM)
        assert code == 0, up.output()[-3000:]
        assert_all_gone(up, children)
    finally:
        up.kill()


@pytest.mark.slow
def test_up_stops_at_once_when_its_gateway_refuses_the_probes_certificate(model_dir, certs,
                                                                          tmp_path):
    """Mutual TLS with a server certificate for server authentication only and no client
    certificate of `up`'s own: the real gateway closes the handshake (no alert reaches the
    client), and `up` says so as soon as the gateway listens, not after its start timeout."""
    up = Up(model_dir, tmp_path, "--ssl-certfile", str(certs / "server.pem"),
            "--ssl-keyfile", str(certs / "server.key"), "--ssl-ca-certs", str(certs / "ca.pem"))
    try:
        assert up.proc.wait(timeout=START_TIMEOUT_S) == 1
        children = up.children()
        assert f"the gateway refused the client certificate {certs / 'server.pem'}" \
            in up.output()
        assert set(children) == {"redis", "prefill", "decode"}     # the gateway never was
        assert sessions_left(children.values()) == []
        assert not [name for name, port in up.ports.items() if listening(port)]
        assert "not healthy after" not in up.output()
    finally:
        up.kill()
