"""`pdserve bench` and the HF static-batching baseline: the statistics and workload builders on
hand-made inputs, then the bench against the baseline running as a real server process on the
real default model (tiny load: 16 prompt tokens, 8 output tokens)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from itertools import combinations

import httpx
import pytest

from pdserve import cli
from pdserve.bench.runner import BenchConfig, closed_loop, run_benchmark
from pdserve.bench.stats import SLO, RequestResult, describe_ms, percentile, summarize
from pdserve.bench.workloads import (Prompt, PromptMaker, poisson_arrivals, random_prompts,
                                     shared_prefix_prompts)
from tests.stack import ROOT, free_port, wait_until


# ---------------------------------------------------------------------------- statistics
def test_percentile_interpolates_between_closest_ranks():
    values = [50.0, 15.0, 40.0, 20.0, 35.0]          # sorted: 15 20 35 40 50
    assert percentile(values, 0) == 15.0
    assert percentile(values, 50) == 35.0
    assert percentile(values, 90) == pytest.approx(46.0)   # rank 3.6: 40 + 0.6 * 10
    assert percentile(values, 99) == pytest.approx(49.6)   # rank 3.96
    assert percentile(values, 100) == 50.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(values, 101)
    assert describe_ms([0.010, 0.020, 0.030]) == pytest.approx(
        {"mean": 20.0, "p50": 20.0, "p90": 28.0, "p99": 29.8})


def _result(ttft: float, e2e: float, tokens: int, ok: bool = True) -> RequestResult:
    return RequestResult("random", 10, tokens, start_s=1.0, end_s=1.0 + e2e, ok=ok,
                         error="" if ok else "HTTP 500: boom", ttft_s=ttft,
                         itl_s=[(e2e - ttft) / max(tokens - 1, 1)] * (tokens - 1),
                         output_tokens=tokens if ok else 0, prompt_tokens=10)


def test_summary_throughput_tpot_and_goodput():
    results = [_result(0.1, 1.1, 11), _result(0.5, 2.5, 11), _result(0.2, 0.2, 1, ok=False)]
    assert results[0].tpot_s == pytest.approx(0.1) and results[1].tpot_s == pytest.approx(0.2)
    s = summarize(results, duration_s=4.0, slo=SLO(ttft_ms=300, tpot_ms=150))
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["output_tokens"] == 22 and s["input_tokens"] == 20
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(5.5)
    assert s["total_token_throughput"] == pytest.approx(10.5)
    assert s["goodput"] == pytest.approx(0.25)                # only the first meets both SLOs
    assert s["tpot_ms"]["p50"] == pytest.approx(150.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(300.0)
    assert s["e2e_ms"]["p99"] == pytest.approx(1100 + 1400 * 0.99)   # E2E 1100 and 2500 ms
    assert s["errors"] == ["HTTP 500: boom"]
    assert summarize(results, 4.0, SLO())["goodput"] is None


# ---------------------------------------------------------------------------- workloads
def test_poisson_arrivals_are_seeded_and_have_the_asked_rate():
    a = poisson_arrivals(2000, 4.0, seed=3)
    assert a == poisson_arrivals(2000, 4.0, seed=3)
    assert a != poisson_arrivals(2000, 4.0, seed=4)
    assert all(x < y for x, y in zip(a, a[1:])) and a[0] > 0
    assert a[-1] / len(a) == pytest.approx(0.25, rel=0.1)     # mean gap 1 / rate
    assert poisson_arrivals(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]


@pytest.fixture(scope="module")
def maker(model_dir) -> PromptMaker:
    return PromptMaker(model_dir, seed=0)


def test_random_prompts_encode_to_exact_lengths_without_special_tokens(maker, model_dir):
    special = set(maker.tok.get_added_tokens_decoder())
    for n in (1, 16, 257):
        for p in random_prompts(maker, 5, n, 8):
            assert maker.encode(p.text) == list(p.token_ids) and p.input_len == n
            assert not special & set(p.token_ids)
    first, second = PromptMaker(model_dir, seed=9), PromptMaker(model_dir, seed=9)
    assert random_prompts(first, 3, 32, 8) == random_prompts(second, 3, 32, 8)


def test_shared_prefix_prompts_share_exactly_the_prefix(maker):
    prompts = shared_prefix_prompts(maker, num_groups=3, users_per_group=4, prefix_len=40,
                                    question_len=12, output_len=8)
    assert len(prompts) == 12
    groups: dict[tuple, list[Prompt]] = {}
    for p in prompts:
        assert maker.encode(p.text) == list(p.token_ids) and p.input_len == 52
        groups.setdefault(p.token_ids[:40], []).append(p)
    assert sorted(len(g) for g in groups.values()) == [4, 4, 4]
    for a, b in combinations(prompts, 2):
        common = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), 52)
        same_group = a.token_ids[:40] == b.token_ids[:40]
        assert common == 40 if same_group else common < 40


def test_closed_loop_keeps_exactly_concurrency_in_flight():
    prompts = [Prompt("random", str(i), (i,), 1) for i in range(10)]
    in_flight, peak, seen = 0, 0, []

    async def fire(p: Prompt) -> RequestResult:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)               # the request's work: the others start meanwhile
        in_flight -= 1
        seen.append(p.text)
        return RequestResult(p.kind, 1, 1, ok=True)

    results = asyncio.run(closed_loop(prompts, 3, fire))
    assert len(results) == 10 and sorted(seen, key=int) == [str(i) for i in range(10)]
    assert peak == 3


def test_bench_config_from_the_command_line():
    args = cli.build_parser().parse_args(["bench", "--concurrency", "1,4,16"])
    assert BenchConfig.from_args(args).points == [("concurrency", 1), ("concurrency", 4),
                                                  ("concurrency", 16)]
    args = cli.build_parser().parse_args(["bench", "--request-rate", "2,inf"])
    assert BenchConfig.from_args(args).points == [("request_rate", 2.0),
                                                  ("request_rate", float("inf"))]
    assert BenchConfig.from_args(cli.build_parser().parse_args(["bench"])).concurrency == (16,)
    args = cli.build_parser().parse_args(["bench", "--concurrency", "2", "--request-rate", "1"])
    with pytest.raises(ValueError, match="not both"):
        BenchConfig.from_args(args)
    args = cli.build_parser().parse_args(["bench", "compare", "a.json", "b.json"])
    assert args.target == "pdserve.bench.report:compare_main" and args.files == ["a.json",
                                                                                 "b.json"]


def test_bench_is_torch_free():
    code = ("import sys, pdserve.bench.runner, pdserve.bench.plot; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ---------------------------------------------------------------------------- against the baseline
@pytest.fixture(scope="module")
def baseline(model_dir, tmp_path_factory):
    """`pdserve baseline hf` as a real process on a free port; yields its base URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("baseline") / "baseline.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                   os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "baseline", "hf", "--model",
                             str(model_dir), "--port", str(port), "--batch-size", "4",
                             "--batch-wait-ms", "20", "--threads", "1"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, 120, "baseline", [(proc, log)])
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def test_baseline_batches_match_unbatched_greedy(baseline):
    """Left padding must not change greedy output: the same prompts alone and batched."""
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time, in a village,"]
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    alone = [httpx.post(baseline + "/v1/completions", json={**body, "prompt": p}, timeout=60)
             .json()["choices"][0]["text"] for p in prompts]

    async def together() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as c:
            rs = await asyncio.gather(*(c.post(baseline + "/v1/completions",
                                               json={**body, "prompt": p}) for p in prompts))
        return [r.json()["choices"][0]["text"] for r in rs]

    assert asyncio.run(together()) == alone
    r = httpx.post(baseline + "/v1/completions", json={**body, "prompt": "x" * 40000}, timeout=60)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_bench_cli_against_baseline(baseline, tmp_path, capsys):
    out = tmp_path / "hf.json"
    rc = cli.main(["bench", "--base-url", baseline, "--num-prompts", "8", "--input-len", "16",
                   "--output-len", "8", "--concurrency", "4", "--no-progress", "--label", "hf",
                   "--slo-ttft-ms", "60000", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (run,) = report["runs"]
    assert run["concurrency"] == 4 and list(run["summary"]) == ["random"]
    assert len(run["requests"]) == 8
    for r in run["requests"]:
        assert r["ok"], r["error"]
        assert (r["output_tokens"], r["prompt_tokens"], r["finish_reason"]) == (8, 16, "length")
        assert 0 < r["ttft_ms"] <= r["e2e_ms"] and r["tpot_ms"] > 0
        assert len(r["itl_ms"]) <= 7 and all(g >= 0 for g in r["itl_ms"])
    s = run["summary"]["random"]
    assert (s["completed"], s["failed"], s["output_tokens"], s["input_tokens"]) == (8, 0, 64, 128)
    assert s["output_throughput"] == pytest.approx(64 / run["duration_s"])
    assert 0 < s["goodput"] <= s["request_throughput"]
    assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["p99"]
    printed = capsys.readouterr().out
    assert "output tok/s" in printed and "TPOT p99 (ms)" in printed

    assert cli.main(["bench", "compare", str(out), str(out)]) == 0
    assert "x1.00" in capsys.readouterr().out


def test_bench_long_burst_and_token_ids_against_baseline(baseline):
    cfg = BenchConfig(base_url=baseline, workload="long-burst", prompt_format="ids",
                      num_prompts=4, input_len=16, output_len=4, concurrency=(2,), warmup=0,
                      long_len=64, long_rate=50.0, num_long=2, progress=False, seed=5)
    started = time.monotonic()
    report = asyncio.run(run_benchmark(cfg))
    (run,) = report["runs"]
    assert set(run["summary"]) <= {"short", "long"} and run["summary"]["short"]["completed"] == 4
    longs = [r for r in run["requests"] if r["kind"] == "long"]
    assert 1 <= len(longs) <= 2 and all(r["ok"] and r["prompt_tokens"] == 64 for r in longs)
    assert all(r["output_tokens"] == 4 for r in run["requests"])
    assert time.monotonic() - started < 60


def test_bench_shared_prefix_open_loop_against_baseline(baseline):
    cfg = BenchConfig(base_url=baseline, workload="shared-prefix", num_groups=2,
                      users_per_group=3, prefix_len=24, question_len=4, output_len=3,
                      request_rate=(50.0, float("inf")), warmup=0, progress=False)
    report = asyncio.run(run_benchmark(cfg))
    assert [run["point"] for run in report["runs"]] == ["rate=50", "rate=inf"]
    for run in report["runs"]:
        s = run["summary"]["shared-prefix"]
        assert (s["completed"], s["input_tokens"], s["output_tokens"]) == (6, 6 * 28, 6 * 3)
    starts = [r["start_ms"] for r in report["runs"][1]["requests"]]
    assert max(starts) < 1000                      # an infinite rate sends everything at once


def test_stepbench_splits_a_decode_step_into_linears_and_the_rest(model_dir, tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "step.json"
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "stepbench", "--model",
                           str(model_dir), "--batch", "3", "--context", "40", "--steps", "2",
                           "--temperature", "1.0", "--top-p", "0.9", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    assert got["batch"] == 3 and got["backend"] == "torch"
    assert got["sampling"] == "temperature 1.0, top-p 0.9"
    assert 0 < got["linear_ms"] < got["step_ms"]
    assert abs(got["outside_ms"] - (got["step_ms"] - got["linear_ms"])) < 1e-6
    assert "outside them" in proc.stdout


def test_stepbench_times_decode_steps_with_lora_adapters(model_dir, tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "step.json"
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "stepbench", "--model",
                           str(model_dir), "--batch", "3", "--context", "24", "--steps", "2",
                           "--loras", "2", "--lora-rank", "8", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    assert got["loras"] == 2 and got["lora_rank"] == 8 and got["step_ms"] > 0
    assert "2 LoRA adapters of rank 8" in proc.stdout


def test_stepbench_compare_times_every_cpu_path_the_host_runs(model_dir, tmp_path):
    import json
    import subprocess
    import sys

    from pdserve.bench.stepbench import auto_path, cpu_paths

    out = tmp_path / "compare.json"
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "stepbench", "--model",
                           str(model_dir), "--compare", "2", "--context", "20", "--steps", "1",
                           "--rounds", "1", "--out", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    paths = cpu_paths()
    assert ("torch", "sdpa") in paths and tuple(got["auto"]) == auto_path() in paths
    assert [(r["batch"], r["linear"], r["attention"]) for r in got["rows"]] == [
        (2, lin, attn) for lin, attn in paths]
    assert all(r["step_ms"] > 0 for r in got["rows"])
    assert all(r["vs_auto"] == 1.0 for r in got["rows"] if r["auto"])
    assert sum(r["auto"] for r in got["rows"]) == 1
    assert "x auto" in proc.stdout and "<- auto" in proc.stdout


def test_bench_multi_turn_conversations_grow_turn_by_turn(baseline):
    cfg = BenchConfig(base_url=baseline, workload="multi-turn", num_conversations=3, turns=3,
                      input_len=12, question_len=5, output_len=4, concurrency=(2,), warmup=0,
                      think_time_s=0.05, progress=False, seed=3)
    report = asyncio.run(run_benchmark(cfg))
    (run,) = report["runs"]
    s = run["summary"]
    assert (s["turn1"]["completed"], s["turn2+"]["completed"]) == (3, 6)
    turns = [r for r in run["requests"] if r["kind"] == "turn2+"]
    assert all(r["ok"] for r in run["requests"])
    # each later turn holds the conversation so far: longer than the first prompt by at least
    # the answer and a new message
    assert all(r["prompt_tokens"] >= 12 + 4 + 5 - 2 for r in turns)
    assert max(r["prompt_tokens"] for r in turns) >= 12 + 2 * (4 + 5) - 4
    with pytest.raises(ValueError, match="not a rate"):
        BenchConfig(workload="multi-turn", request_rate=(1.0,))


def test_stepbench_times_an_moe_model_on_each_experts_backend(tmp_path):
    import json
    import subprocess
    import sys

    from tests.moe_models import make_moe

    make_moe(tmp_path / "moe", "qwen3_moe")
    for backend in ("reference", "grouped"):
        out = tmp_path / f"{backend}.json"
        proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "stepbench", "--model",
                               str(tmp_path / "moe"), "--batch", "4", "--context", "20",
                               "--steps", "2", "--moe-backend", backend, "--out", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert f"MoE: 6 experts, top-2, 3 MoE layers; experts' backend {backend}" in proc.stdout
        got = json.loads(out.read_text())
        assert got["moe_backend"] == backend and got["step_ms"] > 0


def test_stepbench_moe_shape_and_its_dense_equal_do_the_same_arithmetic_per_token():
    from engine.config import ModelConfig
    from pdserve.bench.stepbench import SHAPES

    moe = ModelConfig.from_hf(dict(SHAPES["qwen3-30b-a3b"], num_hidden_layers=2))
    dense = ModelConfig.from_hf(dict(SHAPES["qwen3-30b-a3b-dense"], num_hidden_layers=2))
    assert moe.moe.num_experts == 128 and moe.moe.top_k == 8 and dense.moe is None
    assert moe.moe.top_k * moe.moe.intermediate_size == dense.intermediate_size
    assert (moe.hidden_size, moe.num_heads, moe.num_kv_heads, moe.head_dim) == \
        (dense.hidden_size, dense.num_heads, dense.num_kv_heads, dense.head_dim)
