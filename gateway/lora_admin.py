"""Loading and unloading LoRA adapters on every worker (POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, as vLLM spells them).

A request with an adapter runs on a prefill and a decode worker that both serve it, so an
adapter is loaded on every registered worker of both roles (each worker's LoRA RPC; the path is
read on the worker's host). A load that any worker refuses (a bad adapter, a worker without
--enable-lora) is undone on those that took it, and the refusal is the answer; the router
learns each worker's adapters from the calls at once (its registry view follows with the
heartbeats).
"""

from __future__ import annotations

import asyncio

import grpc

from gateway.errors import GatewayError
from proto import pdserve_pb2, pdserve_pb2_grpc

CALL_TIMEOUT_S = 120.0     # reading an adapter's tensors on a worker

_STUBS = {"prefill": pdserve_pb2_grpc.PrefillWorkerStub,
          "decode": pdserve_pb2_grpc.DecodeWorkerStub}


async def _call(router, worker, name: str, path: str) -> list[str]:
    stub = _STUBS[worker.role](router.channel(worker.address))
    reply = await stub.LoRA(pdserve_pb2.LoRARequest(name=name, path=path),
                            timeout=CALL_TIMEOUT_S)
    router.note_loras(worker.id, list(reply.loaded))
    return list(reply.loaded)


def _refusal(worker, exc: Exception) -> GatewayError:
    if isinstance(exc, grpc.aio.AioRpcError):
        if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                          grpc.StatusCode.FAILED_PRECONDITION):
            return GatewayError(f"{worker.role} worker {worker.id}: {exc.details()}",
                                status=400, code="invalid_lora_adapter")
        return GatewayError(f"{worker.role} worker {worker.id} did not answer its LoRA call: "
                            f"{exc.code().name} {exc.details()}", status=502,
                            code="worker_error")
    return GatewayError(f"{worker.role} worker {worker.id}: {exc}", status=502,
                        code="worker_error")


async def load(router, name: str, path: str) -> None:
    """Load the adapter on every worker, or on none (GatewayError says why)."""
    workers = router.workers("prefill") + router.workers("decode")
    if not workers:
        raise GatewayError("no worker is registered; try again later", status=503,
                           code="no_worker", retry_after=5.0)
    results = await asyncio.gather(*(_call(router, w, name, path) for w in workers),
                                   return_exceptions=True)
    failed = [(w, r) for w, r in zip(workers, results) if isinstance(r, BaseException)]
    if failed:
        took = [w for w, r in zip(workers, results) if not isinstance(r, BaseException)]
        await asyncio.gather(*(_call(router, w, name, "") for w in took),
                             return_exceptions=True)                    # undone
        raise _refusal(*failed[0])


async def unload(router, name: str) -> None:
    """Unload the adapter from every worker that holds it (404 when none does)."""
    holders = [w for role in ("prefill", "decode") for w in router.workers(role)
               if name in w.loras.split(",")]
    if not holders:
        raise GatewayError(f"The LoRA adapter `{name}` is not loaded.", status=404,
                           param="lora_name", code="model_not_found")
    results = await asyncio.gather(*(_call(router, w, name, "") for w in holders),
                                   return_exceptions=True)
    failed = [(w, r) for w, r in zip(holders, results) if isinstance(r, BaseException)]
    if failed:
        raise _refusal(*failed[0])
