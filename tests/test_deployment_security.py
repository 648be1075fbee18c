"""Workers trust no stranger: the deployment token on worker RPCs and registrations, Redis with a
password and TLS, a registration cannot impose its layout, secrets stay out of logs.

Real processes: redis-server (with requirepass, and with TLS on certificates made here),
workers and the gateway from tests.stack, gRPC calls from here.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import pytest
import redis

from cluster.auth import ClusterAuth
from cluster.registry import KEY_PREFIX, WorkerInfo, WorkerRegistration, list_workers, redacted
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.stack import Stack, standard_stack, wait_until
from tests.test_gateway_auth import certs  # noqa: F401  (module fixture: a CA and a server cert)

pytestmark = pytest.mark.slow

TOKEN = "deployment-token-for-tests-0123456789"
REDIS_PASSWORD = "redis-password-for-tests"


def _info(**kw) -> WorkerInfo:
    base = dict(id="decode-x", role="decode", address="127.0.0.1:1", model="m", block_size=16,
                hash_seed=0, dtype="float32", num_layers=30, num_kv_heads=3, head_dim=64,
                total_blocks=10, started_at=time.time())
    base.update(kw)
    return WorkerInfo(**base)


# ---------------------------------------------------------------- units
def test_signatures_bind_every_field_and_the_token():
    auth = ClusterAuth(TOKEN)
    fields = _info().to_redis()
    sig = auth.sign(fields)
    assert auth.verify(fields, sig)
    assert not auth.verify(dict(fields, address="10.0.0.9:50071"), sig)
    assert not auth.verify(fields, ClusterAuth("another-token").sign(fields))
    assert not auth.verify(fields, "") and not auth.verify(fields, None)
    assert ClusterAuth(None).verify(fields, None)           # no token: open, as before
    assert TOKEN not in repr(auth)


def test_redacted_urls_hide_the_password():
    assert redacted("redis://:hunter2@10.0.0.1:6379/0") == "redis://:***@10.0.0.1:6379/0"
    assert redacted("rediss://user:hunter2@h:6380") == "rediss://user:***@h:6380"
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_the_token_interceptor_guards_every_kind_of_call():
    """Unary, server-streaming and client-streaming worker RPCs need the token; the health
    service does not."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    class Decode(pb_grpc.DecodeWorkerServicer):
        async def Decode(self, request, context):
            for i in range(3):
                yield pb.DecodeEvent(tokens=pb.TokenBatch(token_ids=[i]))

        async def PushKV(self, requests, context):
            yield pb.PushKVReply(blocks_received=len([c async for c in requests]))

        async def Stats(self, request, context):
            return pb.WorkerStats(running=7)

    async def run():
        server = grpc.aio.server(interceptors=ClusterAuth(TOKEN).server_interceptors())
        pb_grpc.add_DecodeWorkerServicer_to_server(Decode(), server)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        results = {}
        for name, auth in (("right", ClusterAuth(TOKEN)), ("wrong", ClusterAuth("nope")),
                           ("none", ClusterAuth(None))):
            async with auth.channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.DecodeWorkerStub(ch)
                got = []
                for call in (lambda: stub.Stats(pb.StatsRequest(), timeout=5),
                             lambda: _read_all(stub.Decode(pb.DecodeRequest(), timeout=5)),
                             lambda: _replies(stub.PushKV(_chunks(4), timeout=5))):
                    try:
                        got.append(await call())
                    except grpc.aio.AioRpcError as exc:
                        got.append(exc.code())
                hc = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=5)
                results[name] = got, hc.status
        await server.stop(0)
        return results

    results = asyncio.run(run())
    right, status = results["right"]
    assert right[0].running == 7 and right[1] == [0, 1, 2] and right[2][-1].blocks_received == 4
    for name in ("wrong", "none"):
        codes, status = results[name]
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 3, name
        assert status == 1                                      # SERVING: health stays open


async def _replies(call) -> list:
    """Every reply of a PushKV call (its status raised)."""
    return [reply async for reply in call]


async def _read_all(call):
    out = []
    async for event in call:
        out.append(event.tokens.token_ids[0])
    return out


async def _chunks(n):
    for _ in range(n):
        yield pb.KVChunk(request_id="r")


# ---------------------------------------------------------------- Redis: password, TLS, signatures
@pytest.fixture()
def tls_redis(certs, tmp_path):
    s = Stack("", tmp_path)
    s.start_redis("--port", "0", "--tls-port", "{port}", "--tls-cert-file",
                  str(certs / "server.pem"), "--tls-key-file", str(certs / "server.key"),
                  "--tls-ca-cert-file", str(certs / "ca.pem"), "--tls-auth-clients", "no",
                  "--requirepass", REDIS_PASSWORD, url="rediss://127.0.0.1:{port}/0")
    try:
        yield s
    finally:
        s.stop()


def test_registrations_over_tls_redis_with_a_password_and_only_signed_ones_count(
        tls_redis, certs, tmp_path, monkeypatch):
    from cluster import registry

    password_file = tmp_path / "redis-password"
    password_file.write_text(REDIS_PASSWORD + "\n")
    monkeypatch.delenv(registry.PASSWORD_ENV, raising=False)
    url = tls_redis.redis_url
    auth = ClusterAuth(TOKEN)

    no_password = registry.RedisSettings.from_sources(None, str(certs / "ca.pem"))
    settings = registry.RedisSettings.from_sources(str(password_file), str(certs / "ca.pem"))
    assert REDIS_PASSWORD not in repr(settings)

    async def run():
        bare = registry.connect(url, no_password, socket_timeout=2)     # no password: refused
        with pytest.raises(redis.AuthenticationError):
            await bare.ping()
        await bare.aclose()

        reg = WorkerRegistration(url, _info(id="decode-good"), auth=auth, redis_settings=settings)
        await reg.beat()
        client = registry.connect(url, settings, socket_timeout=2)
        # a stranger who can write to Redis but lacks the token: an unsigned entry, an entry
        # signed with another token, and the good entry's address rewritten
        stranger = _info(id="decode-evil", address="10.6.6.6:1").to_redis()
        await client.hset(KEY_PREFIX + "decode-evil", mapping=stranger)
        forged = _info(id="decode-forged").to_redis()
        forged["sig"] = ClusterAuth("guessed").sign(forged)
        await client.hset(KEY_PREFIX + "decode-forged", mapping=forged)
        seen_before = [w.id for w in await list_workers(client, auth=auth)]
        # the good entry copied under another key, and written back after it expired
        good = await client.hgetall(reg.key)
        await client.hset(KEY_PREFIX + "decode-copy", mapping=good)
        copied = [w.id for w in await list_workers(client, auth=auth)]
        await client.delete(KEY_PREFIX + "decode-copy")
        stale = dict(good)
        await client.hset(reg.key, mapping=dict(stale, expires_at=f"{time.time() - 60:.3f}"))
        expired = [w.id for w in await list_workers(client, auth=auth)]
        await client.hset(reg.key, mapping=good)
        await client.hset(reg.key, "address", "10.6.6.6:2")
        seen_after = [w.id for w in await list_workers(client, auth=auth)]
        open_view = sorted(w.id for w in await list_workers(client, auth=ClusterAuth(None)))
        await reg.stop()
        await client.aclose()
        return seen_before, seen_after, open_view, copied, expired

    seen_before, seen_after, open_view, copied, expired = asyncio.run(run())
    assert seen_before == ["decode-good"]
    assert copied == ["decode-good"]           # the copy under another key does not verify
    assert expired == []                        # nor does an entry past its signed expiry
    assert seen_after == []                     # a tampered entry no longer verifies
    assert open_view == ["decode-evil", "decode-forged", "decode-good"]


def test_an_old_registration_cannot_impose_another_layout():
    """The gateway refuses workers whose KV shape is not its model's, however early they claim
    to have started; the reference layout is taken among the others."""
    from gateway.router import split_by_layout

    real = [_info(id="decode-a", started_at=100.0), _info(id="prefill-a", role="prefill",
                                                          started_at=101.0)]
    hijack = _info(id="decode-old", num_layers=2, num_kv_heads=1, head_dim=8, started_at=0.0)
    accepted, refused = split_by_layout(real + [hijack], expected=(30, 3, 64))
    assert sorted(w.id for w in accepted) == ["decode-a", "prefill-a"]
    assert [w.id for w in refused] == ["decode-old"]
    accepted, refused = split_by_layout(real + [hijack])          # without the check: hijacked
    assert [w.id for w in accepted] == ["decode-old"]


# ---------------------------------------------------------------- the real stack with a token
@pytest.fixture(scope="module")
def secured(model_dir, tmp_path_factory):
    """redis with a password, one prefill and one decode worker and the gateway, all holding
    the deployment token (the environment, as `pdserve up` hands it over)."""
    with standard_stack(model_dir, tmp_path_factory.mktemp("secured"),
                        env={"PDSERVE_CLUSTER_TOKEN": TOKEN,
                             "PDSERVE_REDIS_PASSWORD": REDIS_PASSWORD},
                        redis_args=("--requirepass", REDIS_PASSWORD)) as s:
        s.prefill, s.decode, s.gateway = (next(p for p in s.procs if p.name == name)
                                           for name in ("prefill", "decode", "gateway"))
        yield s


def _complete(base: str) -> dict:
    r = httpx.post(base + "/v1/completions", json={"prompt": "The capital of France is",
                                                   "max_tokens": 4, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_deployment_with_a_token_serves(secured):
    assert _complete(secured.gateway.http)["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_worker_rpcs_refuse_callers_without_the_token(secured, token):
    auth = ClusterAuth(token)

    async def run():
        codes = []
        async with auth.channel(secured.decode.address) as ch:
            stub = pb_grpc.DecodeWorkerStub(ch)
            for call in (lambda: stub.Stats(pb.StatsRequest(), timeout=10),
                         lambda: stub.Abort(pb.AbortRequest(request_id="someone-else"),
                                            timeout=10),
                         lambda: _read_all(stub.Decode(pb.DecodeRequest(
                             request_id="x", prompt_token_ids=[1, 2, 3],
                             params=pb.SamplingParams(max_tokens=2)), timeout=10)),
                         lambda: _replies(stub.PushKV(_chunks(2), timeout=10))):
                try:
                    await call()
                    codes.append("OK")
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
        async with auth.channel(secured.prefill.address) as ch:
            try:
                await pb_grpc.PrefillWorkerStub(ch).Stats(pb.StatsRequest(), timeout=10)
                codes.append("OK")
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
        return codes

    assert asyncio.run(run()) == [grpc.StatusCode.UNAUTHENTICATED] * 5
    assert _complete(secured.gateway.http)["usage"]["completion_tokens"] == 4


def test_a_worker_without_the_token_is_not_taken_in(secured):
    """A stranger's worker that reaches Redis (it knows the password) but not the token:
    the gateway ignores its registration and says so in its log."""
    stranger = _start_without_token(secured)
    try:
        wait_until(lambda: "stranger" in _registered(secured), 120, "the stranger registers",
                   [(stranger.popen, stranger.log)])
        # the gateway's poll that read the stranger's entry logs this before it applies the
        # list it read, in the same turn of its event loop: /health after it sees that list
        wait_until(lambda: "ignoring the registration of 'stranger'"
                   in secured.gateway.log.read_text(), 60, "the gateway reading the stranger",
                   [(secured.gateway.popen, secured.gateway.log)])
        health = httpx.get(secured.gateway.http + "/health", timeout=5).json()
        assert health["workers"]["decode"] == 1
    finally:
        stranger.kill()
        secured.procs.remove(stranger)


def _start_without_token(s: Stack):
    import sys

    from tests.stack import free_port

    port = free_port()
    return s._spawn("stranger", [sys.executable, "-m", "pdserve.cli", "decode", "--model",
                                 s.model, "--port", str(port), "--metrics-port", "0",
                                 "--redis-url", s.redis_url, "--worker-id", "stranger",
                                 "--threads", "1", "--kv-cache-gib", "0.05"],
                    f"127.0.0.1:{port}", PDSERVE_CLUSTER_TOKEN="")


def _registered(s: Stack) -> list[str]:
    with redis.Redis.from_url(s.redis_url, password=REDIS_PASSWORD, socket_timeout=2) as r:
        return [k.decode()[len(KEY_PREFIX):] for k in r.scan_iter(KEY_PREFIX + "*")]


def test_secrets_never_reach_logs_or_error_bodies(secured):
    r = httpx.post(secured.gateway.http + "/v1/completions",
                   json={"prompt": "x", "max_tokens": 10 ** 9}, timeout=30)
    assert r.status_code == 400
    bodies = r.text + json.dumps(httpx.get(secured.gateway.http + "/health", timeout=5).json())
    for p in secured.procs:
        text = p.log.read_text()
        assert TOKEN not in text and REDIS_PASSWORD not in text, p.name
    assert TOKEN not in bodies and REDIS_PASSWORD not in bodies


def test_a_refused_client_stream_reports_its_status_every_time():
    """A client-streaming call refused before the server reads it: the client's writes can
    race the end of the call, and grpc's asyncio client then reports INTERNAL
    (grpc/grpc#36066). The refusal reads what was sent first, so 60 refusals all say
    UNAUTHENTICATED (before that, about 5 in 100 said INTERNAL)."""
    class Decode(pb_grpc.DecodeWorkerServicer):
        async def PushKV(self, requests, context):
            yield pb.PushKVReply(blocks_received=len([c async for c in requests]))

    async def run():
        server = grpc.aio.server(interceptors=ClusterAuth(TOKEN).server_interceptors())
        pb_grpc.add_DecodeWorkerServicer_to_server(Decode(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        codes = []
        async with ClusterAuth("nope").channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.DecodeWorkerStub(ch)
            for i in range(60):
                try:
                    await _replies(stub.PushKV(_chunks(4 if i % 2 else 40), timeout=5))
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
        await server.stop(0)
        return codes

    codes = asyncio.run(run())
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 60, set(codes)
