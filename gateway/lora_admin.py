"""LoRA adapters on the workers: loading and unloading them everywhere (POST
/v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM spells them, and gRPC's
Generation/LoRA), and loading one on demand where a request needs it.

A request with an adapter runs on a prefill and a decode worker that both serve it, so an
adapter is loaded on every registered worker of both roles (each worker's LoRA RPC; the path is
read on the worker's host). A load that any worker refuses (a bad adapter, a worker without
--enable-lora) is undone on those that took it, and the refusal is the answer; the router
learns each worker's adapters from the calls at once (its registry view follows with the
heartbeats).

The gateway remembers the path of each adapter it loaded (and those of its own --lora-modules).
A worker that joins later, or restarted, lacks them: a request for such an adapter finding no
worker of a role that serves it has it loaded on that role's least loaded worker first
(`ensure`: one load per worker and adapter at a time, at most MAX_LOADS at once), and is
refused with the worker's reason if that fails.
"""

from __future__ import annotations

import asyncio

import grpc

from gateway.errors import GatewayError
from proto import pdserve_pb2, pdserve_pb2_grpc

CALL_TIMEOUT_S = 120.0     # reading an adapter's tensors on a worker
MAX_LOADS = 2              # on-demand loads in flight at once

_STUBS = {"prefill": pdserve_pb2_grpc.PrefillWorkerStub,
          "decode": pdserve_pb2_grpc.DecodeWorkerStub}
ROLES = ("prefill", "decode")


def _refusal(worker, exc: BaseException) -> GatewayError:
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


class LoRAAdmin:
    """`known`: adapter name -> path on the workers' hosts (the gateway's --lora-modules)."""

    def __init__(self, router, known: dict[str, str] | None = None) -> None:
        self.router = router
        self.known = dict(known or {})
        self._loads = asyncio.Semaphore(MAX_LOADS)
        self._pending: dict[tuple[str, str], asyncio.Future] = {}

    def names(self) -> set[str]:
        """Adapters a request may name: those workers serve, and those the gateway can load."""
        return self.router.lora_names() | set(self.known)

    async def _call(self, worker, name: str, path: str) -> list[str]:
        stub = _STUBS[worker.role](self.router.channel(worker.address))
        reply = await stub.LoRA(pdserve_pb2.LoRARequest(name=name, path=path),
                                timeout=CALL_TIMEOUT_S)
        self.router.note_loras(worker.id, list(reply.loaded))
        return list(reply.loaded)

    def _workers(self) -> list:
        return [w for role in ROLES for w in self.router.workers(role)]

    async def load(self, name: str, path: str) -> None:
        """Load the adapter on every worker, or on none (GatewayError says why)."""
        workers = self._workers()
        if not workers:
            raise GatewayError("no worker is registered; try again later", status=503,
                               code="no_worker", retry_after=5.0)
        results = await asyncio.gather(*(self._call(w, name, path) for w in workers),
                                       return_exceptions=True)
        failed = [(w, r) for w, r in zip(workers, results) if isinstance(r, BaseException)]
        if failed:
            took = [w for w, r in zip(workers, results) if not isinstance(r, BaseException)]
            await asyncio.gather(*(self._call(w, name, "") for w in took),
                                 return_exceptions=True)                    # undone
            raise _refusal(*failed[0])
        self.known[name] = path

    async def unload(self, name: str) -> None:
        """Unload the adapter from every worker that holds it (404 when none does), and
        forget its path."""
        holders = [w for w in self._workers() if name in w.loras.split(",")]
        if not holders and name not in self.known:
            raise GatewayError(f"The LoRA adapter `{name}` is not loaded.", status=404,
                               param="lora_name", code="model_not_found")
        self.known.pop(name, None)
        results = await asyncio.gather(*(self._call(w, name, "") for w in holders),
                                       return_exceptions=True)
        failed = [(w, r) for w, r in zip(holders, results) if isinstance(r, BaseException)]
        if failed:
            raise _refusal(*failed[0])

    async def ensure(self, name: str) -> None:
        """Before routing a request for adapter `name`: each role has a worker serving it, a
        load on demand where none does and the path is known (GatewayError otherwise)."""
        for role in ROLES:
            workers = self.router.workers(role)
            if not workers or any(name in w.loras.split(",") for w in workers):
                continue                   # (no worker at all: routing says so)
            path = self.known.get(name)
            if path is None:
                continue                   # routing refuses it with lora_not_loaded
            worker = min(workers, key=lambda w: self.router.in_flight(w.id))
            key = (worker.id, name)
            pending = self._pending.get(key)
            if pending is None:
                pending = asyncio.ensure_future(self._load_one(worker, name, path))
                self._pending[key] = pending
                pending.add_done_callback(lambda _, k=key: self._pending.pop(k, None))
            try:
                await asyncio.shield(pending)
            except BaseException as exc:
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise _refusal(worker, exc) from None

    async def _load_one(self, worker, name: str, path: str) -> None:
        async with self._loads:
            await self._call(worker, name, path)
