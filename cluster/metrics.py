"""Prometheus metrics of the workers and the gateway (torch-free).

Each process owns one CollectorRegistry (no global registry): workers expose theirs on
`--metrics-port` (HTTP GET /metrics), the gateway on its REST port at GET /metrics.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
                   2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 2048, 4096)


class _ReadCounters:
    """Counters whose values are read from the engine when scraped (it keeps the totals)."""

    def __init__(self, labels: dict[str, str], read: Callable[[], dict[str, tuple[str, float]]]):
        self.labels = labels
        self.read = read

    def collect(self):
        for name, (doc, value) in self.read().items():
            family = CounterMetricFamily(name, doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), value)
            yield family


# the KV offload tiers' counters (engine.kv_offload.TierStats), read when scraped
_OFFLOAD_COUNTERS = (
    ("hits", "pdserve_kv_offload_hits_blocks", "Blocks found in the tier and read for a "
     "prompt"),
    ("misses", "pdserve_kv_offload_misses_blocks", "Lookups that missed the tier (a prompt "
               "waiting for room is looked up each step)"),
    ("stored_blocks", "pdserve_kv_offload_stored_blocks", "Blocks stored in the tier"),
    ("stored_bytes", "pdserve_kv_offload_stored_bytes", "Bytes stored in the tier"),
    ("store_seconds", "pdserve_kv_offload_store_seconds", "Time spent storing (bytes / this: "
                      "store bandwidth)"),
    ("restored_blocks", "pdserve_kv_offload_restored_blocks", "Blocks restored into the pool"),
    ("restored_bytes", "pdserve_kv_offload_restored_bytes", "Bytes restored into the pool"),
    ("restore_seconds", "pdserve_kv_offload_restore_seconds", "Time spent restoring, checksums "
                        "included (bytes / this: restore bandwidth)"),
    ("skipped_blocks", "pdserve_kv_offload_skipped_blocks", "Hits not restored: computing them "
                       "was cheaper"),
    ("evicted_blocks", "pdserve_kv_offload_evicted_blocks", "Blocks dropped or moved down a tier "
                       "to make room"),
    ("rejected_blocks", "pdserve_kv_offload_rejected_blocks", "Evicted blocks the admission gate "
                        "kept out (seen fewer than --kv-offload-min-seen times)"),
    ("checksum_failures", "pdserve_kv_offload_checksum_failures", "Restored blocks whose checksum "
                          "differed (they and the blocks after them were computed)"),
    ("errors", "pdserve_kv_offload_errors", "I/O errors of the tier (its blocks are computed)"),
    ("ignored_files", "pdserve_kv_offload_ignored_files", "Disk files of another model, dtype, "
                      "layout or hash seed, or damaged: not loaded"),
)
_OFFLOAD_GAUGES = (
    ("blocks", "pdserve_kv_offload_blocks", "Blocks held in the tier"),
    ("capacity_blocks", "pdserve_kv_offload_capacity_blocks", "Blocks the tier can hold"),
)


class _OffloadCollector:
    def __init__(self, labels: dict[str, str], read: Callable[[], dict[str, dict]]) -> None:
        self.labels, self.read = labels, read

    def collect(self):
        tiers = self.read()
        names = [*self.labels, "tier"]
        for table, family_type in ((_OFFLOAD_COUNTERS, CounterMetricFamily),
                                   (_OFFLOAD_GAUGES, GaugeMetricFamily)):
            for key, name, doc in table:
                family = family_type(name, doc, labels=names)
                for tier, stats in tiers.items():
                    family.add_metric([*self.labels.values(), tier], stats[key])
                yield family


class _ExpertCollector:
    """Tokens routed to each expert of each MoE layer (engine.layers.moe counts them), read
    when scraped: what an expert load balancer needs."""

    def __init__(self, labels: dict[str, str], read: Callable[[], dict[int, list[int]]]) -> None:
        self.labels, self.read = labels, read

    def collect(self):
        family = CounterMetricFamily(
            "pdserve_moe_expert_tokens", "Token rows each expert of each MoE layer computed "
            "(top-k: k per token; on GPUs with decode graphs padding rows included)",
            labels=[*self.labels, "layer", "expert"])
        for layer, counts in self.read().items():
            for expert, n in enumerate(counts):
                family.add_metric([*self.labels.values(), str(layer), str(expert)], n)
        yield family


class WorkerMetrics:
    """Engine metrics of one worker. `load` returns (running, waiting, free_blocks);
    `prefix` returns (query tokens, hit tokens, cached blocks, evictions) of the prefix cache."""

    def __init__(self, role: str, worker_id: str, total_blocks: int,
                 load: Callable[[], tuple[int, int, int]],
                 prefix: Callable[[], tuple[int, int, int, int]] | None = None,
                 spec: str | None = None,
                 transfer_refs: Callable[[], dict[str, int]] | None = None,
                 offload: Callable[[], dict[str, dict]] | None = None,
                 threads: Callable[[], int] | None = None,
                 experts: Callable[[], dict[int, list[int]]] | None = None) -> None:
        """transfer_refs: the KV connector's references (engine.kv_connector.references);
        offload: the KV offload tiers' counters by tier (engine.kv_offload.KVOffload.stats);
        threads: a CPU worker's thread count for the step that just ran (called on the engine
        thread: torch.get_num_threads, which engine.core_share may change between steps);
        experts: an MoE model's routing counts, {layer: [tokens per expert]}."""
        self.registry = CollectorRegistry()
        labels = {"role": role, "worker": worker_id}
        self._labels = labels
        r = self.registry
        if offload is not None:
            r.register(_OffloadCollector(labels, offload))
        if experts is not None:
            r.register(_ExpertCollector(labels, experts))
        if prefix is not None:
            r.register(_ReadCounters(labels, lambda: {
                "pdserve_prefix_cache_queries_tokens": (
                    "Prompt tokens looked up in the prefix cache", prefix()[0]),
                "pdserve_prefix_cache_hits_tokens": (
                    "Prompt tokens found in the prefix cache", prefix()[1]),
                "pdserve_prefix_cache_evictions": (
                    "Cached blocks evicted to make room", prefix()[3]),
            }))

        def gauge(name, doc, fn):
            g = Gauge(name, doc, list(labels), registry=r)
            g.labels(**labels).set_function(fn)

        gauge("pdserve_requests_running", "Requests in the running batch", lambda: load()[0])
        gauge("pdserve_requests_waiting", "Requests queued (incl. waiting for blocks)",
              lambda: load()[1])
        gauge("pdserve_kv_blocks_total", "KV blocks in the pool", lambda: total_blocks)
        gauge("pdserve_kv_blocks_free", "Free KV blocks", lambda: load()[2])
        gauge("pdserve_kv_usage_ratio", "Fraction of KV blocks in use",
              lambda: 1.0 - load()[2] / total_blocks)
        if transfer_refs is not None:
            held = Gauge("pdserve_kv_blocks_in_transfer", "Block references the KV connector "
                         "holds: saving (sent or being sent), quarantined (kept aside from a "
                         "one-sided sender)", [*labels, "hold"], registry=r)
            for kind in ("saving", "quarantined"):
                held.labels(**labels, hold=kind).set_function(
                    lambda kind=kind: transfer_refs()[kind])
        if prefix is not None:
            gauge("pdserve_prefix_cache_blocks", "Blocks findable by hash (in use or evictable)",
                  lambda: prefix()[2])
        self.steps = Counter("pdserve_engine_steps", "Engine steps", list(labels),
                             registry=r).labels(**labels)
        self.prompt_tokens = Counter("pdserve_prompt_tokens_computed", "Prompt tokens computed",
                                     list(labels), registry=r).labels(**labels)
        self.generated = Counter("pdserve_generated_tokens", "Tokens sampled", list(labels),
                                 registry=r).labels(**labels)
        self.preemptions = Counter("pdserve_preemptions", "Requests preempted", list(labels),
                                   registry=r).labels(**labels)
        self.batch_seqs = Histogram("pdserve_step_batch_sequences", "Sequences per step",
                                    list(labels), buckets=BATCH_BUCKETS,
                                    registry=r).labels(**labels)
        self.batch_tokens = Histogram("pdserve_step_batch_tokens", "Tokens per step",
                                      list(labels), buckets=BATCH_BUCKETS,
                                      registry=r).labels(**labels)
        self.step_time = Histogram("pdserve_step_duration_seconds", "Engine step wall time",
                                   list(labels), buckets=LATENCY_BUCKETS,
                                   registry=r).labels(**labels)
        self._threads = threads
        if threads is not None:
            self.step_threads = Counter("pdserve_engine_steps_by_threads",
                                        "Engine steps by the CPU threads they ran on",
                                        [*labels, "threads"], registry=r)
        self.spec = None
        if spec is not None:     # speculative decoding, labelled by proposer
            self.spec = _SpecMetrics(r, dict(labels, proposer=spec))

    def transfers(self, transport: str) -> "TransferMetrics":
        return TransferMetrics(self.registry, self._labels, transport)

    def on_step(self, s) -> None:
        """Called from the engine thread after every step with its engine.engine.StepStats
        (prometheus_client is thread-safe)."""
        self.steps.inc()
        self.prompt_tokens.inc(s.num_prompt_tokens)
        self.generated.inc(s.num_generated)
        self.preemptions.inc(s.num_preempted)
        self.batch_seqs.observe(s.num_seqs)
        self.batch_tokens.observe(s.num_tokens)
        self.step_time.observe(s.duration_s)
        if self._threads is not None:
            self.step_threads.labels(**self._labels, threads=str(self._threads())).inc()
        if self.spec is not None:
            self.spec.on_step(s)

    def serve(self, host: str, port: int) -> None:
        """Expose GET /metrics on host:port from a daemon thread."""
        start_http_server(port, addr=host, registry=self.registry)


class _SpecMetrics:
    """Speculative decoding: proposals verified and accepted, and what that made of a step."""

    def __init__(self, r: CollectorRegistry, labels: dict[str, str]) -> None:
        names = list(labels)

        def counter(name, doc):
            return Counter(name, doc, names, registry=r).labels(**labels)

        self.proposed = counter("pdserve_spec_proposed_tokens", "Speculative tokens verified")
        self.accepted = counter("pdserve_spec_accepted_tokens",
                                "Speculative tokens accepted by the target model")
        self.seq_steps = counter("pdserve_spec_sequence_steps",
                                 "(sequence, step) pairs that verified proposals")
        self.totals = [0, 0, 0]
        g = Gauge("pdserve_spec_acceptance_rate", "Accepted / verified speculative tokens",
                  names, registry=r)
        g.labels(**labels).set_function(lambda: self.totals[1] / max(self.totals[0], 1))
        g = Gauge("pdserve_spec_mean_accepted_length",
                  "Tokens a speculating sequence gains per step (accepted + the target's own)",
                  names, registry=r)
        g.labels(**labels).set_function(
            lambda: (self.totals[1] + self.totals[2]) / max(self.totals[2], 1))

    def on_step(self, s) -> None:
        self.proposed.inc(s.num_spec_proposed)
        self.accepted.inc(s.num_spec_accepted)
        self.seq_steps.inc(s.num_spec_seqs)
        self.totals[0] += s.num_spec_proposed
        self.totals[1] += s.num_spec_accepted
        self.totals[2] += s.num_spec_seqs


TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0, 120.0, 300.0)


class TransferMetrics:
    """KV transfer metrics of one worker, labelled by transport. Prefill workers count what they
    send, decode workers what they receive; `seconds` is, on prefill, from the first block handed
    to the transport to the receiver having all, and on decode, from reservation to complete."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str], transport: str):
        names = [*labels, "transport"]
        values = {**labels, "transport": transport}
        self.bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes moved", names,
                             registry=registry).labels(**values)
        self.blocks = Counter("pdserve_kv_transfer_blocks", "KV blocks moved", names,
                              registry=registry).labels(**values)
        self.requests = Counter("pdserve_kv_transfers", "Requests whose KV transfer completed",
                                names, registry=registry).labels(**values)
        self.seconds = Histogram("pdserve_kv_transfer_seconds", "KV transfer time per request",
                                 names, buckets=TRANSFER_BUCKETS,
                                 registry=registry).labels(**values)
        self._failures = Counter("pdserve_kv_transfer_failures",
                                 "KV transfers that failed, by kind", [*names, "kind"],
                                 registry=registry)
        self.checksum_failures = Counter(
            "pdserve_kv_checksum_failures",
            "Requests whose received KV did not match the sender's checksums", names,
            registry=registry).labels(**values)
        self._values = values

    def done(self, blocks: int, block_bytes: int, seconds: float) -> None:
        self.blocks.inc(blocks)
        self.bytes.inc(blocks * block_bytes)
        self.requests.inc()
        self.seconds.observe(seconds)

    def failed(self, kind: str) -> None:
        self._failures.labels(**self._values, kind=kind).inc()


class GatewayMetrics:
    """Request latencies as clients see them at the gateway."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("pdserve_time_to_first_token_seconds",
                              "Time from request arrival to the first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds",
                             "Time between successive tokens of a stream", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds",
                             "Time from request arrival to its last token", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.finished = Counter("pdserve_requests_finished", "Requests by finish reason",
                                ["reason"], registry=r)
        self.failed = Counter("pdserve_requests_failed", "Requests that ended in an error",
                              ["status"], registry=r)
        self.prompt_tokens = Counter("pdserve_request_prompt_tokens", "Prompt tokens received",
                                     registry=r)
        self.generated = Counter("pdserve_request_generated_tokens", "Tokens sent to clients",
                                 registry=r)
        self.in_flight = Gauge("pdserve_requests_in_flight", "Requests being served", registry=r)
        self.routed = Counter("pdserve_routing_decisions", "Where each prompt was computed",
                              ["prefill"], registry=r)
        self.route_reason = Counter("pdserve_routing_reasons",
                                    "Why each prefill worker was chosen: cached_prefix (it holds "
                                    "part of the prompt), load (no cached prefix anywhere), "
                                    "no_directory (redis unreachable: load only), round_robin",
                                    ["reason"], registry=r)
        self.routed_cached = Counter("pdserve_routing_cached_prompt_tokens",
                                     "Prompt tokens the directory listed as cached on the chosen "
                                     "prefill worker", registry=r)
        self.retries = Counter("pdserve_request_retries",
                               "Requests run again after a worker went away before their first "
                               "token", registry=r)
        self.migrations = Counter("pdserve_stream_migrations",
                                  "Streams moved to another decode worker after theirs failed "
                                  "mid-stream (each move counts)", registry=r)
        self.stalls = Counter("pdserve_stream_stalls",
                              "Decode streams that produced nothing for --stream-stall-timeout",
                              registry=r)
        self.hung = Counter("pdserve_workers_hung",
                            "Workers found hung: no answer to a Stats call within "
                            "--worker-probe-timeout while this gateway had calls on them",
                            ["role"], registry=r)
        self.local_computes = Counter("pdserve_prompts_taken_over",
                                      "Prompts a decode worker computed itself after giving up "
                                      "on their KV (--kv-load-failure recompute): the prefill "
                                      "worker's call was ended, the request went on", registry=r)
        self.overloaded = Counter("pdserve_requests_overloaded",
                                  "Requests answered 429 at once: --max-in-flight reached",
                                  registry=r)
        self.directory_blocks = Gauge("pdserve_prefix_directory_blocks",
                                      "Block hashes listed in the Redis prefix directory",
                                      ["worker"], registry=r)
        # autoscaling signals per pool (role), from the workers' heartbeats (set_pools)
        pool = ["pool"]
        self.pool_workers = Gauge("pdserve_pool_workers", "Workers registered", pool,
                                  registry=r)
        self.pool_running = Gauge("pdserve_pool_requests_running",
                                  "Requests in the workers' batches", pool, registry=r)
        self.pool_waiting = Gauge("pdserve_pool_requests_waiting",
                                  "Requests queued at the workers for a place in the batch",
                                  pool, registry=r)
        self.pool_kv = Gauge("pdserve_pool_kv_utilization",
                             "Share of the pool's KV blocks in use (cached free blocks count "
                             "as free)", pool, registry=r)
        self.pool_backlog_tokens = Gauge("pdserve_pool_backlog_tokens",
                                         "Work queued: prompt tokens to compute (prefill), "
                                         "tokens to generate at most (decode)", pool,
                                         registry=r)
        self.pool_backlog_s = Gauge("pdserve_pool_backlog_seconds",
                                    "The backlog over the pool's measured rate (prompt or "
                                    "generated tokens per busy second): how long the pool "
                                    "needs to clear it at today's size", pool, registry=r)
        self.slo_target = Gauge("pdserve_slo_target_seconds",
                                "The configured SLO (--slo-ttft, --slo-tpot; 0: off)", ["kind"],
                                registry=r)
        self.slo = Counter("pdserve_slo_requests",
                           "Requests measured against the SLO: met or missed", ["kind", "outcome"],
                           registry=r)
        self._slo_s = {"ttft": 0.0, "tpot": 0.0}

    def set_slo(self, ttft_s: float, tpot_s: float) -> None:
        self._slo_s = {"ttft": ttft_s, "tpot": tpot_s}
        for kind, target in self._slo_s.items():
            self.slo_target.labels(kind=kind).set(target)

    def observe_slo(self, kind: str, seconds: float) -> None:
        target = self._slo_s[kind]
        if target > 0:
            self.slo.labels(kind=kind, outcome="met" if seconds <= target else "missed").inc()

    def set_pools(self, workers: dict) -> None:
        """The pool gauges from the registered workers (role -> [cluster.registry.WorkerInfo]).
        Backlog: prefill pools count the prompt tokens queued, decode pools the tokens left to
        generate, each over the sum of the workers' measured rates."""
        for role, ws in workers.items():
            total = sum(w.total_blocks for w in ws)
            used = sum(w.total_blocks - w.free_blocks for w in ws)
            if role == "prefill":
                tokens = sum(w.queued_prompt_tokens for w in ws)
                rate = sum(w.prompt_tokens_per_s for w in ws)
            else:
                tokens = sum(w.remaining_decode_tokens for w in ws)
                rate = sum(w.decode_tokens_per_s for w in ws)
            self.pool_workers.labels(pool=role).set(len(ws))
            self.pool_running.labels(pool=role).set(sum(w.running for w in ws))
            self.pool_waiting.labels(pool=role).set(sum(w.waiting for w in ws))
            self.pool_kv.labels(pool=role).set(used / total if total else 0.0)
            self.pool_backlog_tokens.labels(pool=role).set(tokens)
            self.pool_backlog_s.labels(pool=role).set(tokens / rate if rate > 0 else 0.0)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
