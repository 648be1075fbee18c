"""gateway/liveness.py against a real gRPC server whose Stats answers when the test says so: a
worker that answers nothing within the probe's timeout is found hung (every watch on it fires,
the router is told), asked again until it answers (the router is told it is back), and a worker
that answers is never found hung, nor one that is gone (its own calls say so)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cluster.registry import WorkerInfo
from gateway.liveness import Liveness
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.conftest import free_port


class Worker(pb_grpc.DecodeWorkerServicer):
    """Stats answers only while `answering` is set (a stopped process answers nothing)."""

    def __init__(self) -> None:
        self.answering = asyncio.Event()
        self.asked = 0

    async def Stats(self, request, context):
        self.asked += 1
        await self.answering.wait()
        return pb.WorkerStats(running=1)


def _info(address: str) -> WorkerInfo:
    return WorkerInfo(id="decode-x", role="decode", address=address, model="m", block_size=16,
                      hash_seed=0, dtype="float32", num_layers=1, num_kv_heads=1, head_dim=8,
                      total_blocks=8)


async def _serve(worker: Worker):
    server = grpc.aio.server()
    pb_grpc.add_DecodeWorkerServicer_to_server(worker, server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    await server.start()
    return server, address


def test_a_silent_worker_is_found_hung_and_routed_to_again_once_it_answers():
    async def body():
        worker = Worker()
        server, address = await _serve(worker)
        said: list[bool] = []
        changed = asyncio.Event()

        def avoid(w, hung):
            said.append(hung)
            changed.set()
        async with grpc.aio.insecure_channel(address) as ch:
            live = Liveness(lambda _: ch, avoid, timeout_s=0.3, interval_s=0.05)
            with live.watch(_info(address)) as first, live.watch(_info(address)) as second:
                why = await asyncio.wait_for(first, 30)
                assert second.done() and second.result() == why
            assert "no Stats call within 0.3 s" in why and said == [True]
            changed.clear()
            worker.answering.set()                      # resumed
            await asyncio.wait_for(changed.wait(), 30)
            assert said == [True, False]
            await live.stop()
        await server.stop(None)

    asyncio.run(body())


def test_a_worker_that_answers_or_is_gone_is_not_found_hung():
    async def body():
        worker = Worker()
        worker.answering.set()
        server, address = await _serve(worker)
        said: list[bool] = []
        async with grpc.aio.insecure_channel(address) as ch:
            live = Liveness(lambda _: ch, lambda w, hung: said.append(hung), timeout_s=5.0,
                            interval_s=0.01)
            with live.watch(_info(address)) as hung:
                while worker.asked < 20:                # probed again and again, answered
                    await asyncio.sleep(0.01)
                assert not hung.done()
                await server.stop(None)                 # gone: calls fail at once, no hang
                asked = worker.asked
                await asyncio.sleep(0.2)
                assert not hung.done() and worker.asked == asked
            await live.stop()
        assert said == []

    asyncio.run(body())


def test_probes_off_never_fire_and_bad_settings_are_refused():
    async def body():
        live = Liveness(lambda _: None, lambda w, hung: None, timeout_s=0)
        with live.watch(_info("127.0.0.1:1")) as hung:
            await asyncio.sleep(0)
            assert not hung.done() and not live._watches["decode-x"].task
        await live.stop()

    asyncio.run(body())
    with pytest.raises(ValueError):
        Liveness(lambda _: None, lambda w, hung: None, timeout_s=-1)
