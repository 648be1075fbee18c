"""Process scaffolding shared by the prefill and decode services: build the engine from flags,
run the gRPC server with the health service, register in Redis, shut down cleanly.

Imports torch (through the engine): the gateway never imports this module.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.async_engine import EngineDead, Overloaded
from cluster.auth import SERVER_KEEPALIVE, ClusterAuth
from cluster.health import LIVENESS_SERVICE
from cluster.paths import resolve_model
from cluster.prefix_directory import DirectoryPublisher
from cluster.registry import RedisSettings, WorkerInfo, WorkerRegistration
from serving.drain import Drain

log = logging.getLogger(__name__)

MAX_MESSAGE = 256 << 20
SERVER_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE),
                  ("grpc.max_receive_message_length", MAX_MESSAGE),
                  ("grpc.so_reuseport", 0), *SERVER_KEEPALIVE]


CPU_PREFILL_STEP_TOKENS = 256    # a CPU prefill worker's step budget (see below)


def resolve_device_defaults(args, role: str = "") -> dict:
    """Worker flags whose default depends on the device (and role) ("auto" / 0), resolved.

    A CPU prefill worker's step takes 256 tokens, where other engines take 512: its kernels
    are compute-bound from about a hundred rows on (the AMX kernel works in blocks of 128), so a
    larger step computes no faster and only makes the prompts in it wait for each other: two
    256-token prompts in one step both come out at its end, one a step comes out half a step
    earlier, with its KV on its way while the next computes (docs/performance.md, "One prompt
    a step")."""
    cuda = args.device.startswith("cuda")
    budget, cap = args.max_num_batched_tokens, getattr(args, "long_prefill_tokens", 0)
    if not budget and cuda:
        budget = 2048
    elif not budget and role == "prefill":
        # its chunk cap while prompts wait: half that step, not a quarter (64 rows would no
        # longer keep the kernels busy)
        budget, cap = CPU_PREFILL_STEP_TOKENS, cap or CPU_PREFILL_STEP_TOKENS // 2
    elif not budget:
        budget = 512
    return dict(dtype=args.dtype if args.dtype != "auto" else ("bfloat16" if cuda else "float32"),
                max_num_batched_tokens=budget, max_num_seqs=args.max_num_seqs or
                (256 if cuda else 64), long_prefill_tokens=cap)


def build_engine(args, role: str):
    """An Engine from the worker flags (see pdserve.cli)."""
    import torch

    from engine.config import EngineConfig, ModelConfig, blocks_for_gib
    from engine.engine import Engine

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.tensor_parallel_size > 1 and args.kv_transport == "nixl":
        raise ValueError("--kv-transport nixl cannot yet move the KV of a tensor-parallel "
                         "worker (its pool is spread over the ranks); use --kv-transport grpc "
                         "or torch with --tensor-parallel-size > 1")
    model_dir = resolve_model(args.model)
    model_cfg = ModelConfig.from_dir(model_dir)
    cfg = EngineConfig(role=role, compute_dtype=args.compute_dtype, device=args.device,
                       block_size=args.block_size, num_blocks=args.num_blocks,
                       max_model_len=args.max_model_len,
                       enable_prefix_caching=args.prefix_cache, hash_seed=args.hash_seed,
                       attention_backend=args.attention_backend,
                       linear_method=args.linear_method, cpu_attention=args.cpu_attention,
                       enforce_eager=args.enforce_eager,
                       gpu_memory_utilization=args.gpu_memory_utilization,
                       max_request_kv_share=getattr(args, "max_request_kv_share", 1.0),
                       quantization=args.quantization,
                       tensor_parallel_size=args.tensor_parallel_size,
                       expert_parallel=args.expert_parallel, moe_backend=args.moe_backend,
                       kv_offload_gib=args.kv_offload_gib, kv_offload_dir=args.kv_offload_dir,
                       kv_offload_disk_gib=args.kv_offload_disk_gib,
                       kv_offload_min_seen=args.kv_offload_min_seen,
                       enable_lora=args.enable_lora, max_loras=args.max_loras,
                       max_lora_rank=args.max_lora_rank,
                       **resolve_device_defaults(args, role), **_spec_config(args))
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    gib = args.kv_cache_gib or (0.0 if cfg.device.startswith("cuda") else 1.0)
    if cfg.num_blocks == 0 and gib > 0:
        import dataclasses
        cfg = dataclasses.replace(cfg, num_blocks=blocks_for_gib(model_cfg, cfg, gib))
    t0 = time.perf_counter()
    engine = Engine(model_dir, cfg, model_cfg)
    for name, path in args.lora_modules:          # AdapterError: the worker does not start
        engine.add_lora(name, path)
    cfg = engine.cfg
    if cfg.compute_dtype != cfg.dtype:
        log.warning("%s weights computed in %s: this device has no fast %s matmul "
                    "(--compute-dtype %s forces it)", cfg.dtype, cfg.compute_dtype, cfg.dtype,
                    cfg.dtype)
    runner = engine.runner
    log.info("%s engine ready in %.1fs: %s on %s, weights %s, compute %s, attention %s%s, "
             "KV pool %d blocks x %d tokens = %d tokens, budget %d tokens / %d sequences a "
             "step, %d threads%s", role, time.perf_counter() - t0, model_dir.name, cfg.device,
             cfg.dtype, cfg.compute_dtype, runner.backend.name,
             ", CUDA graphs" if runner.graphs is not None else "", cfg.num_blocks,
             cfg.block_size, cfg.num_blocks * cfg.block_size, cfg.max_num_batched_tokens,
             cfg.max_num_seqs, torch.get_num_threads(),
             f" per rank, tensor parallel {cfg.tensor_parallel_size}"
             if cfg.tensor_parallel_size > 1 else "")
    from engine.pinned import pinned_bytes
    if pinned_bytes():
        log.info("page-locked host memory: %.2f GiB (exactly the KV offload tier's)",
                 pinned_bytes() / 2**30)
    if model_cfg.moe is not None:
        log.info("%s", moe_shape(model_cfg, cfg, engine.model))
        for m in engine.model.modules():      # the start's profiling and warm-up passes
            if hasattr(m, "counts"):
                m.counts.zero_()
    return engine, model_dir


def moe_shape(model_cfg, cfg, model) -> str:
    """The start line's MoE part: experts, top-k, the MoE layers, how ranks split them, the
    backend."""
    from engine.layers.moe import Experts

    moe = model_cfg.moe
    experts = next(m for m in model.modules() if isinstance(m, Experts))
    if cfg.tensor_parallel_size == 1:
        split = "one rank"
    elif experts.ep:
        split = (f"expert parallel {cfg.tensor_parallel_size}: {experts.local} experts on "
                 "rank 0")
    else:
        split = f"tensor parallel {cfg.tensor_parallel_size}: each expert's columns split"
    shared = (f", shared experts {moe.shared_intermediate_size} wide"
              if moe.shared_intermediate_size else "")
    return (f"MoE: {moe.num_experts} experts, top-{moe.top_k} ({moe.scoring} router), "
            f"{len(moe.layers)} of {model_cfg.num_layers} layers, expert width "
            f"{moe.intermediate_size}{shared}; {split}; backend {experts.method.name}")


@dataclass(frozen=True)
class WorkerIdentity:
    id: str
    address: str          # host:port other processes dial
    served_model: str


class Grammars:
    """Structured outputs on a worker: a request's grammar is compiled (xgrammar, cached by
    spec) on a thread of its own, never the engine's, and the request gets its grammar state
    before it reaches the engine. The compiler loads with the first structured request."""

    def __init__(self, engine, timeout_s: float = 30.0) -> None:
        self.engine = engine
        self.timeout_s = timeout_s       # a compile slower than this fails its request
        self._compiler = None
        self._lock = asyncio.Lock()

    async def _get(self):
        async with self._lock:
            if self._compiler is None:
                from engine.structured import GrammarCompiler

                e = self.engine
                self._compiler = await asyncio.to_thread(
                    GrammarCompiler, e.model_dir, e.model_cfg.vocab_size,
                    e.model_cfg.eos_token_ids)
            return self._compiler

    async def attach(self, req) -> None:
        """Set req.structured_state when its params ask for a structure, advanced through the
        output tokens a resumed request starts with; ValueError (the grammar engine's reason)
        when the spec cannot be compiled, or the grammar refuses those tokens."""
        spec = req.params.structured
        if spec is None:
            return
        compiler = await self._get()
        try:
            grammar = await asyncio.wait_for(asyncio.to_thread(compiler.compile, spec),
                                             self.timeout_s)
        except asyncio.TimeoutError:
            raise ValueError(f"the {spec.kind} output constraint did not compile within "
                             f"{self.timeout_s:g} s; simplify it") from None
        matcher = grammar.matcher()
        for i, token in enumerate(req.output_token_ids):
            if not matcher.accept(token) or matcher.terminated:
                raise ValueError(f"resume token {i} ({token}) does not continue the output's "
                                 f"{spec.kind} constraint")
        req.structured_state = matcher


# The exceptions a worker turns into a refusal of a request (see `refuse`).
ADMISSION_ERRORS = (ValueError, Overloaded, EngineDead)


async def refuse(context, exc: Exception) -> None:
    """End an RPC for a request the engine refused: bad request INVALID_ARGUMENT, queue full
    RESOURCE_EXHAUSTED (with a retry-after trailer), engine dead UNAVAILABLE."""
    if isinstance(exc, Overloaded):
        context.set_trailing_metadata((("retry-after", "1"),))
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, EngineDead):
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def _heartbeat(aengine):
    """What each heartbeat refreshes besides the load: the autoscaling signals and the LoRA
    adapters the worker serves (the gateway routes adapter requests by them)."""
    signals = Signals(aengine)
    return lambda: dict(signals(), loras=",".join(aengine.engine.list_loras()))


async def lora_call(aengine, request, context):
    """The LoRA RPC of either worker: load (`path` set) or unload an adapter; -> LoRAReply."""
    from engine.lora.adapter import AdapterError
    from proto import pdserve_pb2 as pb

    engine = aengine.engine
    try:
        if request.path:       # reading the tensors: off the event loop and the engine thread
            await asyncio.to_thread(engine.add_lora, request.name, request.path)
        else:
            engine.remove_lora(request.name)
    except AdapterError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    except ValueError as exc:                     # no --enable-lora
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
    return pb.LoRAReply(loaded=engine.list_loras())


def output_error_code(aengine):
    """The status of an RPC whose request ended with an error output: UNAVAILABLE when the
    engine died (the request may run elsewhere), INTERNAL otherwise."""
    return grpc.StatusCode.UNAVAILABLE if aengine.dead is not None else grpc.StatusCode.INTERNAL


def worker_stats(aengine):
    """The Stats RPC's answer for a worker's engine."""
    from proto import pdserve_pb2 as pb

    running, waiting, free = aengine.load()
    return pb.WorkerStats(running=running, waiting=waiting, free_blocks=free,
                          total_blocks=aengine.engine.pool.num_blocks)


async def serve(args, role: str, add_services: Callable) -> None:
    """Run one worker until SIGINT/SIGTERM.

    add_services(server, async_engine, identity, metrics, auth) registers the role's servicers
    (auth: the deployment token, which their KV transports carry or check) and returns an object
    with an async `close()` and, if it has streams to end at the drain's deadline,
    `end_streams(why)` (or None). The token and the Redis settings are read here, once, from the
    flags (else the environment). One function because its order is the contract:
    serving before registering, leaving the registry before the server and the engine stop.
    """
    import torch

    from engine.async_engine import AsyncEngine
    from engine.core_share import CoreShare

    auth = ClusterAuth.from_sources(getattr(args, "cluster_token_file", None))
    redis_settings = RedisSettings.from_sources(getattr(args, "redis_password_file", None),
                                                getattr(args, "redis_ca_cert", None))
    engine, model_dir = build_engine(args, role)
    drain = Drain()
    server = grpc.aio.server(options=SERVER_OPTIONS,
                             interceptors=[*auth.server_interceptors(), drain])
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    if port == 0:
        raise SystemExit(f"cannot bind {args.host}:{args.port}")
    host = args.advertise_host or args.host
    ident = WorkerIdentity(args.worker_id or f"{role}-{host}-{port}", f"{host}:{port}",
                           args.served_model_name or model_dir.name)
    metrics = _worker_metrics(role, ident, engine, lambda: aengine.load())
    duties: list = []             # what keeps this worker in the registry, once started

    def on_death(reason: str) -> None:
        """The engine thread died: stop serving and leave the registry; requests get errors."""
        log.critical("%s worker %s cannot serve any more (%s): reporting NOT_SERVING and "
                     "leaving the registry", role, ident.id, reason)

        async def leave():
            await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
            await health_servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
            for duty in duties:
                await duty.stop()
        loop.create_task(leave())

    loop = asyncio.get_running_loop()
    cores = None
    if getattr(args, "share_cores", "off") == "on":
        cores = CoreShare.for_worker(torch.get_num_threads(), engine.cfg.device,
                                     engine.cfg.tensor_parallel_size)
    aengine = AsyncEngine(engine, on_step=metrics.on_step,
                          max_waiting=getattr(args, "max_waiting_requests", 0),
                          on_death=on_death, cores=cores)
    aengine.start()
    metrics_port = args.metrics_port if args.metrics_port is not None else port + 100
    if metrics_port > 0:
        metrics.serve(args.host, metrics_port)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # liveness: the process serves its RPCs (a long step does not stop it); "" (readiness)
    # is SERVING once registered, NOT_SERVING from the drain on
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    await health_servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    closer = add_services(server, aengine, ident, metrics, auth)
    await server.start()

    if aengine.dead is None:
        duties += _registry_duties(args.redis_url, role, ident, aengine, auth, redis_settings)
        for duty in duties:
            duty.start()
        await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s worker %s serving on %s (%s), metrics on http://%s:%d/metrics", role, ident.id,
             ident.address, "deployment token required" if auth.enabled else
             "no deployment token: open to anyone who reaches it", args.host, metrics_port)

    again = await _until_signal(loop)
    timeout = getattr(args, "drain_timeout", 0.0)
    log.info("%s worker %s draining: out of the registry, new requests refused, the %d running "
             "given %g s to end (a second signal ends the wait)", role, ident.id,
             drain.in_flight, timeout)
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    for duty in duties:
        await duty.stop()
    drain.start()
    left = await drain.wait(timeout, again)
    if left:
        log.warning("%s worker %s: %d requests still running after the drain; ending them "
                    "(the gateway moves a decode stream to another decode worker)", role,
                    ident.id, left)
        if hasattr(closer, "end_streams"):
            closer.end_streams(f"the decode worker drained (--drain-timeout {timeout:g} s); "
                               "the stream goes on on another decode worker")
            await drain.wait(5.0, again)
    log.info("%s worker %s stopping", role, ident.id)
    await server.stop(grace=1.0)
    if closer is not None:
        await closer.close()
    aengine.stop()


def _worker_metrics(role: str, ident: WorkerIdentity, engine, load: Callable):
    """The worker's Prometheus metrics; `load`: the engine's (running, waiting, free blocks)."""
    import torch

    from cluster.metrics import WorkerMetrics

    kvm = engine.kv_manager
    prefix = (lambda: (kvm.query_tokens, kvm.hit_tokens, kvm.pool.num_cached,
                       kvm.pool.evictions)) if kvm.hasher is not None else None
    return WorkerMetrics(role, ident.id, engine.pool.num_blocks, load, prefix,
                         spec=engine.proposer.name if engine.proposer is not None else None,
                         transfer_refs=engine.connector.references,
                         offload=engine.offload.stats if engine.offload is not None else None,
                         threads=torch.get_num_threads if engine.cfg.device.startswith("cpu")
                         else None,
                         experts=expert_counts(engine.model)
                         if engine.model_cfg.moe is not None else None)


def expert_counts(model) -> Callable[[], dict[int, list[int]]]:
    """{layer: tokens per expert} of the MoE layers (rank 0 routes every token, so under
    tensor or expert parallelism its counts are the whole worker's)."""
    import torch

    layers = {i: layer.mlp for i, layer in enumerate(model.model.layers)
              if hasattr(layer.mlp, "counts")}

    def read() -> dict[int, list[int]]:      # one copy off the device per scrape
        counts = torch.stack([mlp.counts for mlp in layers.values()]).tolist()
        return dict(zip(layers, counts))
    return read


async def _until_signal(loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    """Wait for SIGINT or SIGTERM; -> an event the next one sets."""
    first, again = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (again if first.is_set() else first).set()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    await first.wait()
    return again


def _registry_duties(redis_url: str, role: str, ident: WorkerIdentity, aengine, auth: ClusterAuth,
                     redis_settings: RedisSettings) -> list:
    """What keeps the worker in Redis: its signed registration and, with a prefix cache, its
    prefix directory publisher."""
    engine, lay = aengine.engine, aengine.engine.layout
    info = WorkerInfo(id=ident.id, role=role, address=ident.address, model=ident.served_model,
                      block_size=lay.block_size, hash_seed=engine.cfg.hash_seed, dtype=lay.dtype,
                      num_layers=engine.model_cfg.num_layers, num_kv_heads=lay.num_kv_heads,
                      head_dim=lay.head_dim, total_blocks=engine.pool.num_blocks,
                      tensor_parallel_size=lay.tensor_parallel_size, started_at=time.time())
    reg = WorkerRegistration(redis_url, info, load=aengine.load, auth=auth,
                             redis_settings=redis_settings, signals=_heartbeat(aengine))
    if engine.kv_manager.hasher is None:
        return [reg]
    tiers = engine.offload.tiers if engine.offload is not None else []
    return [reg, *(DirectoryPublisher(redis_url, ident.id, events, reg.ttl_s,
                                      redis_settings=redis_settings, tier=tier)
                   for tier, events in (("", engine.pool.events),
                                        *((t.name, t.events) for t in tiers)))]


class Signals:
    """The autoscaling signals of a heartbeat: the work queued here (AsyncEngine.backlog) and
    the prompt and generated tokens per second of busy engine time since the last beat (the
    last rate measured is kept while the engine idles)."""

    def __init__(self, aengine) -> None:
        self.aengine = aengine
        self._last = (0, 0, 0.0)
        self._rates = (0.0, 0.0)

    def __call__(self) -> dict:
        st = self.aengine.engine.stats
        now = (st.prompt_tokens, st.generated_tokens, st.busy_s)
        busy = now[2] - self._last[2]
        if busy > 0:
            prompt_rate = (now[0] - self._last[0]) / busy
            decode_rate = (now[1] - self._last[1]) / busy
            self._rates = (prompt_rate or self._rates[0], decode_rate or self._rates[1])
        self._last = now
        prompt, decode = self.aengine.backlog()
        return dict(queued_prompt_tokens=prompt, remaining_decode_tokens=decode,
                    prompt_tokens_per_s=round(self._rates[0], 3),
                    decode_tokens_per_s=round(self._rates[1], 3))


async def _set_health(servicer, status) -> None:
    await servicer.set("", status)


def resolve_speculative(args) -> str:
    """--speculative, with "auto" resolved: n-gram proposals on a CPU worker of one process,
    off on GPUs and tensor-parallel workers. On a CPU a decode step at a small batch costs
    about a read of the weights whatever its tokens, so verified proposals come nearly free
    (measured at 16 concurrent on 2 cores: 1.0-1.4x the output tokens a second, the same
    tokens; docs/performance.md, "N-gram speculation by default"); on GPUs, where decode
    steps replay CUDA graphs, and across tensor-parallel ranks it is not measured yet."""
    spec = getattr(args, "speculative", "off")
    if spec != "auto":
        return spec
    one_process = getattr(args, "tensor_parallel_size", 1) <= 1
    return "ngram" if args.device.startswith("cpu") and one_process else "off"


def _spec_config(args) -> dict:
    """Speculative decoding settings (decode workers have the flags)."""
    spec = resolve_speculative(args)
    if spec == "off":
        return {}
    return dict(speculative=spec,
                num_speculative_tokens=args.num_speculative_tokens,
                spec_ngram_min=args.spec_ngram_min, spec_ngram_max=args.spec_ngram_max,
                spec_disable_batch_size=args.spec_disable_batch_size,
                spec_max_step_growth=args.spec_max_step_growth)
