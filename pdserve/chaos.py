"""`pdserve chaos`: a bounded soak of the whole stack while its parts are killed.

    redis (password) + 2 prefill + 2 decode workers + gateway, one deployment token
    steady streaming load: greedy and seeded sampled completions whose answers are known
    every --kill-interval seconds (jittered) one fault, the kinds of --faults in turn:
      kill   a worker kill -9'd, or Redis stopped; restarted after --restart-delay seconds on
             the same port
      hang   a worker stopped (SIGSTOP: alive, sockets open, silent) for --hang-seconds, then
             resumed (SIGCONT)
    (at most one worker per role down at once); --recompute makes the decode workers compute a
    prompt themselves when its KV is late (--kv-load-failure recompute): a hung prefill worker,
    or one slow under the load, then costs a takeover rather than a retry

The known answers are taken on the same stack before the first kill: greedy and seeded
sampling are functions of the prompt, the seed and the position only, so every later answer
must equal them token for token, whichever workers served it and however often its stream
moved. At the end the load stops, every process is brought back, and the report says:
requests sent, completed token-exact, completed but different (must be 0), failed with a clear
error (per reason), hung (no answer within --hang-timeout; must be 0), streams migrated and
retried, workers found hung and prompts taken over (the gateway's counters), the stall of the
requests a fault hit (the longest wait for their next token: p50 and max), and blocks leaked on
every worker (must be 0). Exit status 1 when any must-be-0 count is not.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from cluster import health
from cluster.paths import default_model_dir, resolve_model
from pdserve.flags import DefaultsFormatter

log = logging.getLogger(__name__)

PROMPTS = ("The capital of France is", "List three colors:", "def fibonacci(n):",
           "Once upon a time, in a small village,", "The three laws of motion are",
           "Translate to French: good morning", "A haiku about the sea:",
           "Q: What is 12 times 12?\nA:")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Part:
    """One process of the stack: how to start it, how to tell it is healthy."""

    name: str
    cmd: list[str]
    address: str
    healthy: object                          # () -> bool
    log: Path
    proc: subprocess.Popen | None = None
    kills: int = 0
    hangs: int = 0
    stopped: bool = False                    # SIGSTOPped now

    def start(self, env: dict) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.log, "a"),
                                     stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.kills += 1

    def hang(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGSTOP)
            self.stopped = True
        self.hangs += 1

    def resume(self) -> None:
        if self.stopped and self.alive():
            self.proc.send_signal(signal.SIGCONT)
        self.stopped = False

    def stop(self) -> None:
        self.resume()
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@dataclass
class Report:
    sent: int = 0
    exact: int = 0
    different: int = 0
    failed: Counter = field(default_factory=Counter)
    hung: int = 0
    kills: dict = field(default_factory=dict)
    hangs: dict = field(default_factory=dict)
    migrated: int = 0
    retried: int = 0
    found_hung: int = 0                            # the gateway's pdserve_workers_hung_total
    taken_over: int = 0                            # its pdserve_prompts_taken_over_total
    stalls: list = field(default_factory=list)     # longest wait of each request a fault hit
    leaked: dict = field(default_factory=dict)     # worker -> blocks still referenced
    busy: dict = field(default_factory=dict)       # worker -> requests still running/waiting
    seconds: float = 0.0

    def ok(self) -> bool:
        return (not self.different and not self.hung and not any(self.leaked.values())
                and not any(self.busy.values()))

    def as_dict(self) -> dict:
        return dict(sent=self.sent, completed_token_exact=self.exact,
                    completed_different=self.different, failed=dict(self.failed),
                    hung=self.hung, migrated=self.migrated, retried=self.retried,
                    workers_found_hung=self.found_hung, prompts_taken_over=self.taken_over,
                    stall_seconds=self._stall(), kills=self.kills, hangs=self.hangs,
                    blocks_leaked=self.leaked, requests_left=self.busy,
                    seconds=round(self.seconds, 1), ok=self.ok())

    def _stall(self) -> dict:
        """p50 and max of the longest wait for a token of the requests a fault hit."""
        s = sorted(self.stalls)
        if not s:
            return {"requests": 0, "p50": None, "max": None}
        return {"requests": len(s), "p50": round(s[len(s) // 2], 2), "max": round(s[-1], 2)}

    def table(self) -> str:
        rows = [("requests sent", self.sent), ("completed token-exact", self.exact),
                ("completed but different (must be 0)", self.different),
                ("failed with a clear error", sum(self.failed.values()))]
        rows += [(f"  {reason}", n) for reason, n in sorted(self.failed.items())]
        stall = self._stall()
        rows += [("hung (must be 0)", self.hung), ("streams migrated", self.migrated),
                 ("requests retried before their first token", self.retried),
                 ("workers found hung by the gateway", self.found_hung),
                 ("prompts taken over by a decode worker", self.taken_over),
                 ("requests a fault hit", stall["requests"]),
                 ("  their longest wait for a token, p50 (s)", stall["p50"]),
                 ("  their longest wait for a token, max (s)", stall["max"])]
        rows += [(f"kills: {name}", n) for name, n in sorted(self.kills.items())]
        rows += [(f"hangs: {name}", n) for name, n in sorted(self.hangs.items())]
        rows += [(f"blocks leaked on {w} (must be 0)", n) for w, n in sorted(self.leaked.items())]
        rows += [(f"requests left on {w} (must be 0)", n) for w, n in sorted(self.busy.items())]
        width = max(len(r[0]) for r in rows)
        lines = [f"pdserve chaos: {self.seconds:.0f} s"]
        lines += [f"  {k:<{width}}  {v}" for k, v in rows]
        lines.append("  verdict: " + ("OK" if self.ok() else "FAILED"))
        return "\n".join(lines)


class Chaos:
    def __init__(self, args) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.model = resolve_model(args.model)
        self.workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pdserve-chaos-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_urlsafe(32)
        self.redis_password = secrets.token_urlsafe(24)
        env = {k: v for k, v in os.environ.items()
               if k not in ("PDSERVE_API_KEY", "PDSERVE_CLUSTER_TOKEN", "PDSERVE_REDIS_PASSWORD")}
        self.env = dict(env, PYTHONUNBUFFERED="1", PDSERVE_CLUSTER_TOKEN=self.token,
                        PDSERVE_REDIS_PASSWORD=self.redis_password)
        self.parts: dict[str, Part] = {}
        self.report = Report()
        self.lock = threading.Lock()
        self.stop_load = threading.Event()
        self.restarts: list[threading.Timer] = []
        self.fault_times: list[float] = []            # time.monotonic() of each fault
        self.requests: list[tuple[float, float, float]] = []   # (start, end, longest wait)
        self._build()

    # ------------------------------------------------------------------ the stack
    def _build(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("redis-server is not installed (apt-get install redis-server)")
        port = _free_port()
        config = self.workdir / "redis.conf"
        config.touch(mode=0o600)
        config.write_text(f"requirepass {self.redis_password}\n", encoding="utf-8")
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        self._add("redis", [exe, str(config), "--port", str(port), "--bind", "127.0.0.1",
                            "--save", "", "--appendonly", "no"], f"127.0.0.1:{port}",
                  lambda: self._redis_up())
        cli = [sys.executable, "-m", "pdserve.cli"]
        common = ["--model", str(self.model), "--log-level", "WARNING"]
        recompute = (["--kv-load-failure", "recompute", "--kv-transfer-timeout",
                      f"{self.args.recompute:g}"] if self.args.recompute else [])
        for role in ("prefill", "decode"):
            for i in range(2):
                wport = _free_port()
                address = f"127.0.0.1:{wport}"
                self._add(f"{role}-{i}", cli + [
                    role, *common, "--port", str(wport), "--metrics-port", "0",
                    "--worker-id", f"{role}-{i}", "--redis-url", self.redis_url,
                    "--threads", "1", "--kv-cache-gib", str(self.args.kv_cache_gib),
                    *(recompute if role == "decode" else [])],
                    address, lambda a=address: health.grpc_serving(a, 1.0))
        http = _free_port()
        self.base = f"http://127.0.0.1:{http}"
        self._add("gateway", cli + ["gateway", *common, "--http-port", str(http), "--grpc-port",
                                    str(_free_port()), "--redis-url", self.redis_url],
                  f"127.0.0.1:{http}", lambda: self._gateway_sees(2, 2))

    def _add(self, name, cmd, address, healthy) -> None:
        self.parts[name] = Part(name, cmd, address, healthy, self.workdir / f"{name}.log")

    def _redis_up(self) -> bool:
        import redis

        try:
            with redis.Redis.from_url(self.redis_url, password=self.redis_password,
                                      socket_timeout=1) as r:
                return bool(r.ping())
        except redis.RedisError:
            return False

    def _gateway_sees(self, prefills: int, decodes: int) -> bool:
        workers = (health.http_json(self.base + "/health") or {}).get("workers", {})
        return workers.get("prefill", 0) >= prefills and workers.get("decode", 0) >= decodes

    def _wait(self, part: Part, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not part.healthy():
            if not part.alive():
                raise SystemExit(f"{part.name} exited with {part.proc.returncode}; see "
                                 f"{part.log}")
            if time.monotonic() > deadline:
                raise SystemExit(f"{part.name} not healthy after {timeout_s:.0f} s; see "
                                 f"{part.log}")
            time.sleep(0.3)

    def start(self) -> None:
        print(f"pdserve chaos: starting redis, 2 prefill and 2 decode workers and the gateway "
              f"(logs in {self.workdir})", flush=True)
        self.parts["redis"].start(self.env)
        self._wait(self.parts["redis"], 20)
        workers = [p for n, p in self.parts.items() if n not in ("redis", "gateway")]
        for p in workers:
            p.start(self.env)
        for p in workers:
            self._wait(p)
        self.parts["gateway"].start(self.env)
        self._wait(self.parts["gateway"])

    def stop(self) -> None:
        for p in reversed(list(self.parts.values())):
            p.stop()

    # ------------------------------------------------------------------ load
    def specs(self) -> list[dict]:
        out = []
        for i, prompt in enumerate(PROMPTS):
            out.append(dict(prompt=prompt, max_tokens=self.args.max_tokens, temperature=0.0))
            out.append(dict(prompt=prompt, max_tokens=self.args.max_tokens, temperature=0.8,
                            top_p=0.95, seed=1000 + i))
        return out

    def ask(self, spec: dict) -> tuple[str, str | None]:
        """(text, None) on success, else ("", reason); "hung" when no answer came in time.
        Each request's start, end and longest wait for a token go to `requests`."""
        start = time.monotonic()
        waits = [0.0]
        try:
            return self._ask(spec, waits)
        finally:
            end = time.monotonic()
            with self.lock:
                self.requests.append((start, end, max(waits)))

    def _ask(self, spec: dict, waits: list[float]) -> tuple[str, str | None]:
        import httpx

        body = dict(spec, stream=True, ignore_eos=True)
        text = []
        last = time.monotonic()
        try:
            with httpx.stream("POST", self.base + "/v1/completions", json=body,
                              timeout=httpx.Timeout(self.args.hang_timeout)) as r:
                if r.status_code != 200:
                    r.read()
                    try:
                        err = r.json()["error"]
                        return "", f"{r.status_code} {err.get('code') or err.get('type')}"
                    except (ValueError, KeyError, TypeError):
                        return "", f"{r.status_code} (not an OpenAI error body)"
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        return "", f"stream error: {event['error'].get('code')}"
                    now = time.monotonic()
                    waits.append(now - last)
                    last = now
                    text.append(event["choices"][0].get("text", ""))
        except httpx.TimeoutException:
            return "", "hung"
        except httpx.HTTPError as exc:
            return "", f"connection: {type(exc).__name__}"
        return "".join(text), None

    def references(self, specs: list[dict]) -> list[str]:
        out = []
        for spec in specs:
            text, err = self.ask(spec)
            if err is not None:
                raise SystemExit(f"the reference run failed before any fault: {err}")
            out.append(text)
        return out

    def _client(self, specs: list[dict], refs: list[str], budget: list[int]) -> None:
        while not self.stop_load.is_set():
            with self.lock:
                if budget[0] == 0:
                    return
                budget[0] -= 1
                self.report.sent += 1
            i = self.rng.randrange(len(specs))
            text, err = self.ask(specs[i])
            with self.lock:
                if err == "hung":
                    self.report.hung += 1
                    log.error("a request hung: %s", specs[i])
                elif err is not None:
                    self.report.failed[err] += 1
                elif text == refs[i]:
                    self.report.exact += 1
                else:
                    self.report.different += 1
                    log.error("answer differs from the known one for %s:\n  got  %r\n  want %r",
                              specs[i], text, refs[i])

    # ------------------------------------------------------------------ faults
    def _victims(self) -> list[str]:
        """Healthy parts whose loss leaves a worker of each role (a process still loading the
        model after its restart counts as down)."""
        down = {n for n, p in self.parts.items() if n != "gateway" and not p.healthy()}
        out = []
        for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
            role = name.split("-")[0]
            if name not in down and not any(d.startswith(role) for d in down):
                out.append(name)
        if self.args.redis_chaos and "redis" not in down:
            out.append("redis")
        return out

    def _faults(self, until: float) -> None:
        while not self.stop_load.wait(self.args.kill_interval * self.rng.uniform(0.5, 1.5)):
            if time.monotonic() >= until:
                return
            kind = self.args.faults[len(self.fault_times) % len(self.args.faults)]
            # Redis is only ever killed: a hang is a worker's
            victims = [v for v in self._victims() if kind == "kill" or v != "redis"]
            if not victims:
                continue
            name = self.rng.choice(victims)
            part = self.parts[name]
            self.fault_times.append(time.monotonic())
            if kind == "hang":
                print(f"  {time.strftime('%H:%M:%S')} SIGSTOP {name} for "
                      f"{self.args.hang_seconds:g} s", flush=True)
                part.hang()
                timer = threading.Timer(self.args.hang_seconds, self._resume, (part,))
            else:
                print(f"  {time.strftime('%H:%M:%S')} kill -9 {name}", flush=True)
                part.kill()
                timer = threading.Timer(self.args.restart_delay, self._restart, (part,))
            self.restarts.append(timer)
            timer.start()

    def _resume(self, part: Part) -> None:
        print(f"  {time.strftime('%H:%M:%S')} SIGCONT {part.name}", flush=True)
        part.resume()

    def _restart(self, part: Part) -> None:
        print(f"  {time.strftime('%H:%M:%S')} restart {part.name}", flush=True)
        part.start(self.env)

    # ------------------------------------------------------------------ the end
    def settle(self) -> None:
        """Every part running and healthy again, the gateway seeing all four workers."""
        for part in self.parts.values():
            part.resume()
            if not part.alive():
                part.start(self.env)
        for part in self.parts.values():
            self._wait(part)
        deadline = time.monotonic() + 60
        while not self._gateway_sees(2, 2) and time.monotonic() < deadline:
            time.sleep(0.5)

    def leaks(self) -> None:
        """Blocks still referenced and requests still running on each worker, after a settle."""
        import grpc

        from cluster.auth import ClusterAuth
        from proto import pdserve_pb2 as pb
        from proto import pdserve_pb2_grpc as pb_grpc

        metadata = ClusterAuth(self.token).metadata()
        deadline = time.monotonic() + 30
        while True:
            leaked, busy = {}, {}
            for name, part in self.parts.items():
                if name in ("redis", "gateway"):
                    continue
                stub_cls = (pb_grpc.PrefillWorkerStub if name.startswith("prefill")
                            else pb_grpc.DecodeWorkerStub)
                with grpc.insecure_channel(part.address) as ch:
                    st = stub_cls(ch).Stats(pb.StatsRequest(), timeout=10, metadata=metadata)
                leaked[name] = st.total_blocks - st.free_blocks
                busy[name] = st.running + st.waiting
            if not any(leaked.values()) and not any(busy.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        self.report.leaked, self.report.busy = leaked, busy

    def counters(self) -> None:
        body = ""
        try:
            import httpx
            body = httpx.get(self.base + "/metrics", timeout=10).text
        except Exception:                    # noqa: BLE001 - the report says 0 then
            pass

        def total(name: str) -> int:
            return int(sum(float(line.split()[-1]) for line in body.splitlines()
                           if line.startswith(name + " ") or line.startswith(name + "{")))
        self.report.migrated = total("pdserve_stream_migrations_total")
        self.report.retried = total("pdserve_request_retries_total")
        self.report.found_hung = total("pdserve_workers_hung_total")
        self.report.taken_over = total("pdserve_prompts_taken_over_total")

    def stalls(self) -> None:
        """The longest wait for a token of each request in flight when a fault came."""
        self.report.stalls = [wait for start, end, wait in self.requests
                              if any(start <= t <= end for t in self.fault_times)]

    def run(self) -> Report:
        t0 = time.monotonic()
        self.start()
        specs = self.specs()
        refs = self.references(specs)
        print(f"pdserve chaos: {len(specs)} known answers taken; load and faults for "
              f"{self.args.duration:.0f} s", flush=True)
        budget = [self.args.max_requests or -1]
        clients = [threading.Thread(target=self._client, args=(specs, refs, budget))
                   for _ in range(self.args.concurrency)]
        for c in clients:
            c.start()
        until = time.monotonic() + self.args.duration
        faults = threading.Thread(target=self._faults, args=(until,))
        faults.start()
        while time.monotonic() < until and any(c.is_alive() for c in clients):
            time.sleep(0.5)
        self.stop_load.set()
        faults.join()
        for c in clients:
            c.join(self.args.hang_timeout + 30)
        for timer in self.restarts:                    # pending restarts have run
            timer.join()
        self.settle()
        self.leaks()
        self.counters()
        self.stalls()
        self.report.kills = {n: p.kills for n, p in self.parts.items() if p.kills}
        self.report.hangs = {n: p.hangs for n, p in self.parts.items() if p.hangs}
        self.report.seconds = time.monotonic() - t0
        return self.report


def register(sub) -> None:
    p = sub.add_parser(
        "chaos", help="a bounded soak of the whole stack while its workers and Redis are killed",
        formatter_class=DefaultsFormatter,
        description="Start Redis, 2 prefill and 2 decode workers and the gateway; run a steady "
                    "streaming load of greedy and seeded completions with known answers while "
                    "workers are killed (-9) and restarted, stopped (SIGSTOP) and resumed, and "
                    "Redis is stopped and restarted; then report requests completed "
                    "token-exact, failed (per reason), hung, migrated, the stall of the "
                    "requests a fault hit, and KV blocks leaked on every worker. Exit 1 if any "
                    "answer differs, any request hung or any block leaked.")
    p.add_argument("--model", default=None,
                   help=f"model folder (default: {default_model_dir()})")
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load and faults")
    p.add_argument("--max-requests", type=int, default=0, help="stop after this many (0: none)")
    p.add_argument("--concurrency", type=int, default=3, help="clients streaming at once")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per answer")
    p.add_argument("--kill-interval", type=float, default=20.0,
                   help="mean seconds between faults (each one jittered 0.5x-1.5x)")
    p.add_argument("--restart-delay", type=float, default=3.0,
                   help="seconds a killed process stays down")
    p.add_argument("--faults", type=_fault_kinds, default="kill,hang",
                   help="the kinds of fault, comma-separated, taken in turn: kill (kill -9, "
                        "then a restart), hang (SIGSTOP, then SIGCONT)")
    p.add_argument("--hang-seconds", type=float, default=15.0,
                   help="how long a hung worker stays stopped")
    p.add_argument("--recompute", type=float, default=0.0, metavar="SECONDS",
                   help="decode workers compute a prompt themselves when its KV has not arrived "
                        "within SECONDS (--kv-load-failure recompute; 0: they fail it, the "
                        "default)")
    p.add_argument("--no-redis-chaos", dest="redis_chaos", action="store_false",
                   help="never stop Redis")
    p.add_argument("--hang-timeout", type=float, default=90.0,
                   help="a request with no progress for this long counts as hung")
    p.add_argument("--kv-cache-gib", type=float, default=0.1, help="each worker's KV pool")
    p.add_argument("--seed", type=int, default=0, help="seed of the load and the faults")
    p.add_argument("--workdir", default=None, help="folder for the processes' logs "
                                                   "(default: a fresh temporary one)")
    p.add_argument("--out", default=None, help="JSON file for the report")
    p.set_defaults(target="pdserve.chaos:main")


def _fault_kinds(text: str) -> tuple[str, ...]:
    import argparse

    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    if not kinds or any(k not in ("kill", "hang") for k in kinds):
        raise argparse.ArgumentTypeError(f"faults are kill and/or hang, got {text!r}")
    return kinds


def main(args) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)     # not a line per request
    chaos = Chaos(args)
    try:
        report = chaos.run()
    finally:
        chaos.stop()
    print(report.table(), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    return 0 if report.ok() else 1
