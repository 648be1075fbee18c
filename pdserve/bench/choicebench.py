"""`pdserve choicebench`: one request of n choices against n separate requests of the same
prompt, on any pdserve gateway.

For each of --rounds fresh random prompts (--input-len tokens, never seen before, so no prefix
cache helps either side) it sends, one after the other: one completion with n = --n, and --n
concurrent completions with n = 1 (different seeds); both sample --output-len tokens per choice
at temperature 1 with ignore_eos. It reports each side's output tokens per second (all choices'
tokens over the wall time) and, when --prefill-metrics is given (a prefill worker's /metrics
URL), the prompt tokens that worker computed and the KV transfers it made for each side.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from typing import TYPE_CHECKING

from cluster.paths import default_model_dir
from pdserve.bench.workloads import PromptMaker
from pdserve.flags import DefaultsFormatter

if TYPE_CHECKING:
    import httpx


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


async def _prefill_counts(client: httpx.AsyncClient, url: str | None) -> tuple[float, float]:
    if not url:
        return 0.0, 0.0
    text = (await client.get(url, timeout=30)).text
    return (_metric(text, "pdserve_prompt_tokens_computed_total"),
            _metric(text, "pdserve_kv_transfers_total"))


async def _complete(client, url, model, ids, n, seed, output_len) -> int:
    body = {"model": model, "prompt": ids, "max_tokens": output_len, "temperature": 1.0,
            "seed": seed, "ignore_eos": True, "n": n}
    r = await client.post(url, json=body)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


async def run(args) -> dict:
    import httpx

    base = args.base_url.rstrip("/").removesuffix("/v1")
    maker = PromptMaker(args.tokenizer or default_model_dir(), args.seed)
    maker.rng = random.Random(args.seed)
    out = {"n": args.n, "rounds": args.rounds, "input_len": args.input_len,
           "output_len": args.output_len}
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), trust_env=False) as client:
        model = args.model or (await client.get(base + "/v1/models")).json()["data"][0]["id"]
        url = base + "/v1/completions"
        await _complete(client, url, model, maker.random_ids(16), 1, 0, 4)      # warm-up
        sides = {"one request, n choices": 0.0, "n separate requests": 0.0}
        tokens = dict.fromkeys(sides, 0)
        computed = dict.fromkeys(sides, 0.0)
        transfers = dict.fromkeys(sides, 0.0)
        for r in range(args.rounds):
            for side in sides:
                ids = maker.random_ids(args.input_len)
                c0, t0_ = await _prefill_counts(client, args.prefill_metrics)
                t0 = time.perf_counter()
                if side.startswith("one"):
                    got = [await _complete(client, url, model, ids, args.n, r, args.output_len)]
                else:
                    got = await asyncio.gather(*(
                        _complete(client, url, model, ids, 1, r * 1000 + i, args.output_len)
                        for i in range(args.n)))
                sides[side] += time.perf_counter() - t0
                tokens[side] += sum(got)
                c1, t1_ = await _prefill_counts(client, args.prefill_metrics)
                computed[side] += c1 - c0
                transfers[side] += t1_ - t0_
    for side, seconds in sides.items():
        out[side] = {"seconds": seconds, "output_tokens": tokens[side],
                     "output_tok_s": tokens[side] / seconds if seconds else 0.0}
        line = (f"{side:24s} {tokens[side]:6d} output tokens in {seconds:7.2f} s = "
                f"{out[side]['output_tok_s']:7.1f} tok/s")
        if args.prefill_metrics:
            out[side].update(prompt_tokens_computed=computed[side], kv_transfers=transfers[side])
            line += (f"; prefill worker computed {computed[side]:.0f} prompt tokens, "
                     f"{transfers[side]:.0f} KV transfers")
        print(line)
    a, b = out["one request, n choices"], out["n separate requests"]
    if b["output_tok_s"]:
        print(f"n = {args.n}: {a['output_tok_s'] / b['output_tok_s']:.2f}x the output tokens/s "
              f"of {args.n} separate requests")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


def register(sub) -> None:
    p = sub.add_parser(
        "choicebench", help="one request of n choices against n separate requests",
        formatter_class=DefaultsFormatter,
        description="For fresh random prompts: one completion with n choices, then n "
                    "concurrent completions of the same prompt; output tokens/s of each and, "
                    "with --prefill-metrics, the prompt tokens and KV transfers of each on the "
                    "prefill worker.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the gateway")
    p.add_argument("--model", default=None, help="served model name (default: /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help=f"model folder for the prompts' tokens (default: {default_model_dir()})")
    p.add_argument("--n", type=int, default=4, help="choices")
    p.add_argument("--rounds", type=int, default=4, help="prompts, each measured both ways")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="tokens per choice")
    p.add_argument("--prefill-metrics", default=None, metavar="URL",
                   help="a prefill worker's /metrics, e.g. http://127.0.0.1:50161/metrics")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--out", default=None, help="JSON file for the figures")
    p.set_defaults(target="pdserve.bench.choicebench:main")


def main(args) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    asyncio.run(run(args))
    return 0
