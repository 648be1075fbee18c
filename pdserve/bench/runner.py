"""`pdserve bench`: drive a server with one workload at one or more load points.

A load point is a concurrency (closed loop: that many requests in flight, the next sent as soon
as one finishes) or a request rate (open loop: Poisson arrivals, whatever the server does). Each
point gets its own prompts (seed + 1000 * point index), so a server's prefix cache never serves a
later point from an earlier one; the same seed gives the same prompts on every server.

long-burst: the short chats run as above while long prompts arrive alongside at --long-rate
(Poisson) until the short chats are done; the two kinds are summarized separately, which is the
point: what a long prefill does to the TPOT of streams already running.

multi-turn: --num-conversations conversations of --turns turns, --concurrency of them at once.
A conversation's first prompt is random (--input-len tokens); each later one is the previous
prompt, the answer the server streamed, and a new random message of --question-len tokens, sent
--think-time seconds after the answer ended. Turns 1 and 2+ are summarized apart: what a KV
cache (and its offload tiers) saves is in the TTFT of turns 2+, whose prefix was computed
before.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable

from cluster.paths import default_model_dir
from pdserve.bench import report as report_mod
from pdserve.bench.client import request_body, send
from pdserve.bench.stats import SLO, RequestResult, summarize
from pdserve.bench.workloads import (Prompt, PromptMaker, code_edit_prompts, poisson_arrivals,
                                     random_prompts, shared_prefix_prompts)
from pdserve.flags import DefaultsFormatter

if TYPE_CHECKING:
    import httpx

WORKLOADS = ("random", "shared-prefix", "long-burst", "code-edit", "multi-turn")
LONG_POOL = 32        # long prompts prepared when --num-long is 0
POINT_SEED_STEP = 1000
LONG_SEED = 7_777     # offset of the long prompts' and long arrivals' seeds


@dataclass(frozen=True)
class BenchConfig:
    """Everything one `pdserve bench` invocation does; validated on construction."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    tokenizer: str | None = None
    prompt_format: str = "text"
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)
    timeout_s: float = 600.0
    workload: str = "random"
    num_prompts: int = 64
    input_len: int = 256
    output_len: int = 64
    concurrency: tuple[int, ...] = ()
    request_rate: tuple[float, ...] = ()
    warmup: int = 1
    seed: int = 0
    num_groups: int = 4
    users_per_group: int = 8
    prefix_len: int = 512
    question_len: int = 64
    long_len: int = 2000
    long_rate: float = 0.2
    num_long: int = 0
    num_conversations: int = 16
    turns: int = 4
    think_time_s: float = 1.0
    slo: SLO = SLO()
    label: str | None = None
    out: str | None = None
    plot: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(self.workload in WORKLOADS, f"--workload must be one of {', '.join(WORKLOADS)}")
        need(self.prompt_format in ("text", "ids"), "--prompt-format must be text or ids")
        need(not (self.concurrency and self.request_rate),
             "give --concurrency or --request-rate, not both")
        need(bool(self.concurrency or self.request_rate), "no load point: set --concurrency")
        need(all(c >= 1 for c in self.concurrency), "--concurrency values must be >= 1")
        need(all(r > 0 for r in self.request_rate), "--request-rate values must be > 0")
        need(self.num_prompts >= 1 and self.input_len >= 1 and self.output_len >= 1,
             "--num-prompts, --input-len and --output-len must be >= 1")
        need(self.num_groups >= 1 and self.users_per_group >= 1 and self.prefix_len >= 1
             and self.question_len >= 1, "shared-prefix sizes must be >= 1")
        need(self.long_len >= 1 and self.long_rate > 0 and self.num_long >= 0,
             "--long-len and --long-rate must be > 0, --num-long >= 0")
        need(self.warmup >= 0 and self.timeout_s > 0, "--warmup >= 0 and --timeout > 0")
        need(self.num_conversations >= 1 and self.turns >= 1 and self.think_time_s >= 0,
             "--num-conversations and --turns must be >= 1, --think-time >= 0")
        need(self.workload != "multi-turn" or not self.request_rate,
             "the multi-turn workload runs at a --concurrency of conversations, not a rate")

    @property
    def points(self) -> list[tuple[str, float]]:
        """(name, value) of each load point: ("concurrency", 16) or ("request_rate", 4.0)."""
        if self.concurrency:
            return [("concurrency", c) for c in self.concurrency]
        return [("request_rate", r) for r in self.request_rate]

    @classmethod
    def from_args(cls, args) -> "BenchConfig":
        concurrency = _parse_list(args.concurrency, int, "--concurrency")
        rate = _parse_list(args.request_rate, float, "--request-rate")
        if not concurrency and not rate:
            concurrency = (16,)
        extra = json.loads(args.extra_body) if args.extra_body else {}
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
        return cls(
            base_url=args.base_url, model=args.model, tokenizer=args.tokenizer,
            prompt_format=args.prompt_format, temperature=args.temperature, extra_body=extra,
            timeout_s=args.timeout, workload=args.workload, num_prompts=args.num_prompts,
            input_len=args.input_len, output_len=args.output_len, concurrency=concurrency,
            request_rate=rate, warmup=args.warmup, seed=args.seed, num_groups=args.num_groups,
            users_per_group=args.users_per_group, prefix_len=args.prefix_len,
            question_len=args.question_len, long_len=args.long_len, long_rate=args.long_rate,
            num_long=args.num_long, num_conversations=args.num_conversations,
            turns=args.turns, think_time_s=args.think_time, slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms),
            label=args.label, out=args.out, plot=args.plot, progress=not args.no_progress)


def _parse_list(text: str | None, kind: type, flag: str) -> tuple:
    if not text:
        return ()
    try:
        return tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{flag} takes a number or a comma list of numbers, got {text!r}")


def point_name(name: str, value: float) -> str:
    return f"c={value}" if name == "concurrency" else f"rate={value:g}"


# ---------------------------------------------------------------------------- load drivers
Fire = Callable[[Prompt], Awaitable[RequestResult]]


async def closed_loop(prompts: list[Prompt], concurrency: int, fire: Fire) -> list[RequestResult]:
    """`concurrency` workers share the prompt list; each sends its next prompt when one ends."""
    pending = iter(prompts)
    results: list[RequestResult] = []

    async def worker() -> None:
        for prompt in pending:
            results.append(await fire(prompt))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    return results


async def open_loop(prompts: list[Prompt], arrivals: list[float],
                    fire: Fire) -> list[RequestResult]:
    """Sends prompt i at arrivals[i] seconds from now, whatever is still in flight."""
    start = time.perf_counter()
    tasks = []
    for prompt, at in zip(prompts, arrivals):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(fire(prompt)))
    return list(await asyncio.gather(*tasks))


async def with_long_arrivals(short: Awaitable[list[RequestResult]], longs: list[Prompt],
                             rate: float, seed: int, fire: Fire) -> list[RequestResult]:
    """Runs `short` while sending `longs` one by one at Poisson arrivals of `rate`/s; stops
    sending when `short` is done or `longs` is used up. Waits for every request it sent."""
    short_task = asyncio.ensure_future(short)
    rng = random.Random(seed)
    sent = []
    for prompt in longs:
        done, _ = await asyncio.wait({short_task}, timeout=rng.expovariate(rate))
        if done:
            break
        sent.append(asyncio.ensure_future(fire(prompt)))
    return await short_task + list(await asyncio.gather(*sent))


async def conversations(firsts: list[Prompt], concurrency: int, turns: int, think_s: float,
                        question_len: int, maker: PromptMaker, fire: Fire) -> list[RequestResult]:
    """`concurrency` conversations at once, each `turns` turns (see the module docstring); a
    failed turn ends its conversation."""
    pending = iter(firsts)
    results: list[RequestResult] = []

    async def talk(first: Prompt) -> None:
        prompt = first
        for turn in range(turns):
            res = await fire(prompt)
            results.append(res)
            if not res.ok or turn == turns - 1:
                return
            text, ids = maker.extend(prompt.text + res.text, question_len)
            prompt = Prompt("turn2+", prompt.text + res.text + text, tuple(ids),
                            first.output_len)
            await asyncio.sleep(think_s)

    async def worker() -> None:
        for first in pending:
            await talk(first)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(firsts)))))
    return results


# ---------------------------------------------------------------------------- one run
def build_prompts(cfg: BenchConfig, maker: PromptMaker) -> tuple[list[Prompt], list[Prompt]]:
    """(the main prompts, the long prompts of long-burst) from the maker's current seed."""
    if cfg.workload == "shared-prefix":
        return shared_prefix_prompts(maker, cfg.num_groups, cfg.users_per_group, cfg.prefix_len,
                                     cfg.question_len, cfg.output_len), []
    if cfg.workload == "random":
        return random_prompts(maker, cfg.num_prompts, cfg.input_len, cfg.output_len), []
    if cfg.workload == "code-edit":
        return code_edit_prompts(maker, cfg.num_prompts, cfg.output_len), []
    if cfg.workload == "multi-turn":
        return random_prompts(maker, cfg.num_conversations, cfg.input_len, cfg.output_len,
                              kind="turn1"), []
    short = random_prompts(maker, cfg.num_prompts, cfg.input_len, cfg.output_len, kind="short")
    longs = random_prompts(maker, cfg.num_long or LONG_POOL, cfg.long_len, cfg.output_len,
                           kind="long")
    return short, longs


async def run_point(cfg: BenchConfig, client: httpx.AsyncClient, model: str, maker: PromptMaker,
                    index: int) -> dict:
    """Runs load point `index` of cfg.points; returns its JSON-ready result."""
    from tqdm import tqdm

    name, value = cfg.points[index]
    seed = cfg.seed + POINT_SEED_STEP * index
    maker.rng = random.Random(seed)
    prompts, longs = build_prompts(cfg, maker)
    url = cfg.base_url + "/v1/completions"
    total = len(prompts) * (cfg.turns if cfg.workload == "multi-turn" else 1)
    bar = tqdm(total=total, desc=f"{cfg.label or 'bench'} {point_name(name, value)}",
               unit="req", disable=not cfg.progress, dynamic_ncols=True)
    longs_done = 0
    t0 = time.perf_counter()

    async def fire(prompt: Prompt) -> RequestResult:
        nonlocal longs_done
        body = request_body(prompt, model, cfg.prompt_format, cfg.temperature, cfg.extra_body)
        res = await send(client, url, body, prompt, t0, cfg.timeout_s)
        if prompt.kind == "long":
            longs_done += 1
            bar.set_postfix(long_done=longs_done)
        else:
            bar.update(1)
        return res

    if cfg.workload == "multi-turn":
        main = conversations(prompts, int(value), cfg.turns, cfg.think_time_s,
                             cfg.question_len, maker, fire)
    elif name == "concurrency":
        main = closed_loop(prompts, int(value), fire)
    else:
        main = open_loop(prompts, poisson_arrivals(len(prompts), value, seed), fire)
    if longs:
        main = with_long_arrivals(main, longs, cfg.long_rate, seed + LONG_SEED, fire)
    results = await main
    bar.close()
    duration = max((r.end_s for r in results), default=0.0)
    kinds = list(dict.fromkeys(r.kind for r in results))
    return {"point": point_name(name, value), name: value,
            "duration_s": duration,
            "summary": {k: summarize([r for r in results if r.kind == k], duration, cfg.slo)
                        for k in kinds},
            "requests": [r.to_json() for r in sorted(results, key=lambda r: r.start_s)]}


async def served_model(client: httpx.AsyncClient, base_url: str) -> str:
    import httpx

    try:
        resp = await client.get(base_url + "/v1/models", timeout=30)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise SystemExit(f"cannot read the model name from {base_url}/v1/models ({exc}); "
                         "is the server up? pass --model to skip this") from exc


async def warm_up(cfg: BenchConfig, client: httpx.AsyncClient, model: str,
                  maker: PromptMaker) -> None:
    maker.rng = random.Random(cfg.seed - 1)
    for prompt in random_prompts(maker, cfg.warmup, min(cfg.input_len, 64), 4, kind="warmup"):
        body = request_body(prompt, model, cfg.prompt_format, cfg.temperature, cfg.extra_body)
        res = await send(client, cfg.base_url + "/v1/completions", body, prompt,
                         time.perf_counter(), cfg.timeout_s)
        if not res.ok:
            raise SystemExit(f"warm-up request failed: {res.error}")


async def run_benchmark(cfg: BenchConfig) -> dict:
    """Runs every load point of cfg; returns the report (see report.py for its shape)."""
    import httpx

    base_url = cfg.base_url.rstrip("/").removesuffix("/v1")
    cfg = replace(cfg, base_url=base_url)
    maker = PromptMaker(cfg.tokenizer or default_model_dir(), cfg.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits,
                                 trust_env=False) as client:
        model = cfg.model or await served_model(client, base_url)
        await warm_up(cfg, client, model, maker)
        runs = [await run_point(cfg, client, model, maker, i) for i in range(len(cfg.points))]
    config = asdict(cfg)
    config["model"] = model
    return {"label": cfg.label or Path(cfg.out or "bench").stem,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "config": config, "runs": runs}


def _add_target(target) -> None:
    """The server and what every request sends."""
    target.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server root; requests go to BASE_URL/v1/completions")
    target.add_argument("--model", default=None,
                        help="model name to send (default: the first id of GET /v1/models)")
    target.add_argument("--tokenizer", default=None,
                        help="model folder with tokenizer.json, to build exact-length prompts "
                             f"(default: {default_model_dir()})")
    target.add_argument("--prompt-format", choices=["text", "ids"], default="text",
                        help="send prompts as text (works everywhere) or as token-id lists")
    target.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    target.add_argument("--extra-body", default=None,
                        help="JSON object merged into every request body, e.g. '{\"top_k\": 1}'")
    target.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


def _add_load(load) -> None:
    """Which prompts, how many and how they arrive."""
    load.add_argument("--workload", choices=WORKLOADS, default="random",
                      help="random: --num-prompts prompts of --input-len tokens; shared-prefix: "
                           "--num-groups x --users-per-group prompts, each group sharing "
                           "--prefix-len tokens; long-burst: random short chats plus long prompts "
                           "arriving at --long-rate, reported separately; code-edit: "
                           "--num-prompts chat requests to return an edited code snippet whole "
                           "(answers repeat the prompt); multi-turn: --num-conversations "
                           "conversations of --turns turns, each turn the conversation so far "
                           "and --question-len new tokens, reported as turn1 and turn2+")
    load.add_argument("--num-prompts", type=int, default=64,
                      help="requests per run (random and long-burst's short chats)")
    load.add_argument("--input-len", type=int, default=256, help="prompt tokens (random)")
    load.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    load.add_argument("--concurrency", default=None, metavar="N[,N...]",
                      help="closed loop: requests in flight; a comma list (1,4,16,64) sweeps "
                           "(default 16 unless --request-rate)")
    load.add_argument("--request-rate", default=None, metavar="RATE[,RATE...]",
                      help="open loop: Poisson arrivals in requests/s ('inf': all at once); "
                           "a comma list sweeps")
    load.add_argument("--warmup", type=int, default=1,
                      help="unmeasured requests sent one by one before the first run")
    load.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")


def _add_workloads(bench) -> None:
    """The shared-prefix, long-burst and multi-turn workloads' own flags."""
    sp = bench.add_argument_group("shared-prefix workload")
    sp.add_argument("--num-groups", type=int, default=4, help="distinct shared prefixes")
    sp.add_argument("--users-per-group", type=int, default=8, help="requests per prefix")
    sp.add_argument("--prefix-len", type=int, default=512, help="shared prefix tokens")
    sp.add_argument("--question-len", type=int, default=64,
                    help="tokens after the prefix, distinct per request (multi-turn: each "
                         "turn's new message)")
    lb = bench.add_argument_group("long-burst workload")
    lb.add_argument("--long-len", type=int, default=2000, help="tokens of a long prompt")
    lb.add_argument("--long-rate", type=float, default=0.2,
                    help="Poisson arrivals of long prompts in requests/s")
    lb.add_argument("--num-long", type=int, default=0,
                    help="at most this many long prompts (0: 32); arrivals stop when the "
                         "short chats finish")
    mt = bench.add_argument_group("multi-turn workload")
    mt.add_argument("--num-conversations", type=int, default=16,
                    help="conversations (--concurrency of them at once)")
    mt.add_argument("--turns", type=int, default=4, help="turns of each conversation")
    mt.add_argument("--think-time", type=float, default=1.0, metavar="SECONDS",
                    help="pause between an answer and the conversation's next turn")


def _add_report(out) -> None:
    """SLOs and where the report goes."""
    out.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on TTFT")
    out.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO on TPOT")
    out.add_argument("--slo-e2e-ms", type=float, default=None, help="goodput SLO on E2E latency")
    out.add_argument("--label", default=None, help="name of this run in tables and plots")
    out.add_argument("--out", default=None,
                     help="JSON file: config, per-run summaries, per-request numbers")
    out.add_argument("--plot", default=None,
                     help="PNG of latency CDFs (and sweep curves); default: --out with .png")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def register(sub) -> None:
    """`pdserve bench` and `pdserve bench compare`."""
    bench = sub.add_parser(
        "bench", help="load-test any OpenAI-compatible server (pdserve, vLLM, the HF baseline)",
        formatter_class=DefaultsFormatter,
        description="Load generator for any OpenAI-compatible server: POST /v1/completions with\n"
                    "stream=true, stream_options.include_usage and ignore_eos. Prompts are random\n"
                    "token ids decoded to text whose re-encoding has exactly the requested length\n"
                    "(same seed, same prompts on every server). Reports TTFT, TPOT, ITL and E2E\n"
                    "percentiles, request/token throughput and goodput under SLOs; --out writes\n"
                    "JSON (summaries and per-request numbers) and a PNG beside it.",
        epilog="examples:\n"
               "  pdserve bench --base-url http://127.0.0.1:8000 --concurrency 1,4,16 "
               "--num-prompts 32 --out ours.json\n"
               "  pdserve bench --workload long-burst --concurrency 8 --long-len 2000 "
               "--long-rate 0.2 --slo-tpot-ms 200\n"
               "  pdserve bench --workload multi-turn --concurrency 8 --num-conversations 32 "
               "--turns 4 --input-len 512 --question-len 64\n"
               "  pdserve bench compare ours.json vllm.json")
    _add_target(bench.add_argument_group("target"))
    _add_load(bench.add_argument_group("load"))
    _add_workloads(bench)
    _add_report(bench.add_argument_group("report"))
    bench.set_defaults(target="pdserve.bench.runner:main")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="{compare}")
    compare = bench_sub.add_parser(
        "compare", help="side-by-side table of bench JSON files with ratios",
        description="Print the summaries of several `pdserve bench --out` files side by side. "
                    "Runs are matched by workload point (concurrency or rate, request kind); "
                    "ratio columns give FIRST / OTHER (throughput > 1 and latency < 1 mean the "
                    "first file is better).")
    compare.add_argument("files", nargs="+", help="JSON files; the first is the reference")
    compare.set_defaults(target="pdserve.bench.report:compare_main")


def main(args) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    try:
        cfg = BenchConfig.from_args(args)
    except ValueError as exc:
        raise SystemExit(f"pdserve bench: {exc}") from exc
    report = asyncio.run(run_benchmark(cfg))
    print(report_mod.format_report(report))
    if cfg.out:
        report_mod.write_json(report, Path(cfg.out))
        print(f"wrote {cfg.out}")
    plot_path = cfg.plot or (str(Path(cfg.out).with_suffix(".png")) if cfg.out else None)
    if plot_path:
        from pdserve.bench.plot import plot_report

        plot_report(report, Path(plot_path))
        print(f"wrote {plot_path}")
    completed = sum(s["completed"] for run in report["runs"] for s in run["summary"].values())
    return 0 if completed else 1
