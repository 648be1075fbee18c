"""Speculative decoding: proposers, the rejection sampler's distribution, and greedy output that
is identical to plain decoding (n-gram, a perfect draft, a draft that is always wrong) inside
mixed continuous batches, on tiny random-weight models; every block goes back to both pools."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.engine import Engine
from engine.request import Request, SamplingParams
from engine.spec import NgramProposer, Proposal, SpecController
from engine.spec.verify import rejection_sample, verify
from tests.conftest import make_engine
from tests.cpu_paths import linear_params
from tests.test_batching import run

# repetitive prompts (n-gram matches) next to ones without repeats
PROMPTS = [[5, 9, 17, 3, 5, 9, 17, 3, 5, 9], [7] * 13, [1, 2, 3, 1, 2, 3, 1, 2],
           list(range(20, 60)), [99, 98], [11, 12, 13, 40, 41, 11, 12, 13]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def wrong_draft(tmp_path_factory, tiny_model_dir):
    """The tiny model with a zero output layer: its logits are all equal, so it always proposes
    token 0."""
    d = tmp_path_factory.mktemp("wrong-draft")
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            (d / f.name).write_bytes(f.read_bytes())
    weights = load_file(tiny_model_dir / "model.safetensors")
    weights["lm_head.weight"] = torch.zeros_like(weights["model.embed_tokens.weight"])
    cfg = json.loads((d / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    return d


# what these tests need beyond the small engine: room for six sequences and their proposals
engine = functools.partial(make_engine, num_blocks=128, max_num_batched_tokens=32,
                           max_num_seqs=8)


def requests(params=GREEDY) -> list[Request]:
    return [Request(str(i), p, params) for i, p in enumerate(PROMPTS)]


# ---------------------------------------------------------------------- proposers
def test_ngram_proposes_what_followed_the_first_match_and_says_how_long_it_is():
    prop = NgramProposer(min_n=2, max_n=3)
    req = Request("r", [1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3], GREEDY)
    # "2 3" ended at positions 2 and 6 before the suffix; the first is followed by 4 9 2 3 5
    first = prop.propose([req], [3])[0]
    assert first.tokens == [4, 9, 2] and first.kind == 2
    assert prop.propose([req], [5])[0].tokens == [4, 9, 2, 3, 5]
    req.output_token_ids += [8, 1, 2]             # "1 2" ended at 1 only; "8 1 2" nowhere
    assert prop.propose([req], [2])[0].tokens == [3, 4]
    req.output_token_ids += [42]
    none = prop.propose([req], [2])[0]            # nothing ends in "2 42" before
    assert none.tokens == [] and none.kind == 0
    assert prop.propose([req], [0])[0].tokens == []
    prop.release("r")
    assert not prop._index
    # the match length counts back past max_n: 7 tokens repeat before the suffix
    run = [11, 12, 13, 14, 15, 16, 17]
    req = Request("s", [5] + run + [99, 100] + [6] + run, GREEDY)
    assert prop.propose([req], [2])[0] == Proposal([99, 100], kind=7)


def test_controller_backs_off_as_the_batch_grows():
    """Cost a + b*T with a fixed part 40x a token's: one sequence with modest acceptance
    speculates; a batch of 64 of them does not; a perfect one still does at 8."""
    ctl = SpecController(max_tokens=4)
    for t in range(1, 65):
        ctl.observe_step(t, 0, 0.040 + 0.001 * t)
    assert ctl.cost_model() == pytest.approx((0.040, 0.001, 0.0), rel=1e-6)
    for i in range(64):
        ctl.record(str(i), 4, 1)                  # ~1 in 3 accepted
    assert sum(ctl.plan(["0"], [4])) > 0
    assert sum(ctl.plan([str(i) for i in range(64)], [4] * 64)) == 0
    for _ in range(10):
        ctl.record("p", 4, 4)
    assert ctl.plan(["p"] + [str(i) for i in range(7)], [4] * 8)[0] == 4
    assert SpecController(4, disable_batch_size=2).plan(["a", "b", "c"], [4] * 3) == [0, 0, 0]


def test_controller_keeps_acceptance_per_kind_of_proposal():
    """Long-match proposals are always accepted, 2-token matches never: the controller grants
    the first kind whatever sequence offers it and stops granting the second."""
    ctl = SpecController(max_tokens=8, probe_after=1000)
    for t in range(1, 33):
        ctl.observe_step(t, 0, 0.050 + 0.004 * t)
    for i in range(20):
        ctl.record(f"a{i}", 8, 8, kind=12)
        ctl.record(f"a{i}", 8, 0, kind=2)
    assert ctl.alpha("new", 12) > 0.95 and ctl.alpha("new", 2) < 0.1
    assert ctl.alpha("new") == pytest.approx(0.6)     # no kind: the sequence's own (prior)
    assert ctl.plan(["x", "y"], [8, 8], kinds=[12, 2]) == [8, 0]


def test_controller_bounds_how_much_a_step_grows():
    """16 sequences whose proposals are all accepted, a step costing 50 ms + 2 ms a token: by
    throughput alone (a bound of 0) every one verifies 15, a 562 ms step, 6.9x the 82 ms step
    without proposals; with the growth bounded to a half the grants stop at 1.5x (20 tokens),
    so no sequence waits on a longer step than that. A sequence alone is not bounded."""
    def controller(growth):
        ctl = SpecController(max_tokens=16, probe_after=1000, max_step_growth=growth)
        for t in range(1, 33):
            ctl.observe_step(t, 0, 0.050 + 0.002 * t)
        for i in range(16):
            ctl.record(str(i), 16, 16)
        return ctl
    ids = [str(i) for i in range(16)]
    assert controller(0.0).plan(ids, [16] * 16) == [15] * 16
    ks = controller(0.5).plan(ids, [16] * 16)
    assert sum(ks) == 20 and 0.050 + 0.002 * (16 + sum(ks)) <= 1.5 * (0.050 + 0.002 * 16)
    # prompt tokens in the step count in its time without proposals
    assert sum(controller(0.5).plan(ids, [16] * 16, other_tokens=100)) == 70
    # one sequence alone delays nobody: unbounded; beside a prompt chunk it is bounded
    assert controller(0.1).plan(["0"], [16]) == [16]
    assert controller(0.1).plan(["0"], [16], other_tokens=8) == [3]     # 68 ms -> 74 ms


def test_controller_counts_what_leaving_the_batched_decode_costs():
    """Steps with S speculating sequences cost 10 ms more each than their tokens say: with a
    61 ms step, a sequence accepting 1 proposal in 7 (worth 9 ms) then does not speculate
    (a first proposal costs 11 ms); one accepting nearly all does."""
    ctl = SpecController(max_tokens=4, probe_after=1000, decay=1.0)
    for t in range(1, 33):
        for s in (0, 1, 2):
            ctl.observe_step(t + 3 * s, s, 0.060 + 0.001 * (t + 3 * s) + 0.010 * s)
    a, b, e = ctl.cost_model()
    assert (a, b, e) == pytest.approx((0.060, 0.001, 0.010), rel=1e-6)
    for _ in range(10):
        ctl.record("low", 5, 1)                   # 1 accepted, 1 rejected
        for _ in range(5):
            ctl.record("low", 5, 0)               # rejected at once
        ctl.record("high", 4, 4)
    assert ctl.alpha("low") == pytest.approx(10.3 / 70.5)
    assert ctl.alpha("high") > 0.95
    assert ctl.plan(["low"], [4]) == [0]
    assert ctl.plan(["high"], [4])[0] >= 2


# ---------------------------------------------------------------------- the rejection sampler
@pytest.mark.parametrize("draft_kind", ["point", "distribution"])
def test_rejection_sampling_gives_the_target_distribution(draft_kind):
    """On a 6-token vocabulary, the first emitted token over 20,000 seeds follows the target p
    (each frequency within 0.015 of p: over 4 standard deviations), whatever the draft q."""
    p = torch.tensor([[0.05, 0.40, 0.10, 0.25, 0.15, 0.05], [1 / 6] * 6])
    q = torch.tensor([[0.50, 0.05, 0.05, 0.30, 0.05, 0.05]])
    counts = torch.zeros(6)
    gen = torch.Generator().manual_seed(0)
    n = 20_000
    accepted = 0
    for seed in range(n):
        if draft_kind == "point":             # an n-gram proposal: always token 0
            draft, probs = [0], None
        else:
            draft, probs = [int(torch.multinomial(q[0], 1, generator=gen))], q
        out = rejection_sample(p, draft, probs, seed, 0)
        counts[out[0]] += 1
        accepted += len(out) == 2
    freq = counts / n
    assert torch.allclose(freq, p[0], atol=0.015), (freq, p[0])
    want = 0.05 if draft_kind == "point" else float(torch.minimum(p[0], q[0]).sum())
    assert abs(accepted / n - want) < 0.015


def test_greedy_verification_keeps_the_matching_prefix_plus_the_target_token():
    logits = torch.full((4, 10), -5.0)
    for row, tok in enumerate([3, 4, 7, 1]):
        logits[row, tok] = 5.0
    assert verify(logits, GREEDY, 0, [3, 4, 5])[0] == [3, 4, 7]
    assert verify(logits, GREEDY, 0, [3, 4, 7])[0] == [3, 4, 7, 1]          # + the bonus token
    assert verify(logits, GREEDY, 0, [9, 4, 7])[0] == [3]


# ---------------------------------------------------------------------- the engine
def _pools_free(eng: Engine) -> None:
    assert eng.pool.num_free == eng.pool.num_blocks
    if hasattr(eng.proposer, "kv_manager"):
        assert eng.proposer.kv_manager.pool.num_free == eng.proposer.kv_manager.pool.num_blocks
        assert not eng.proposer.computed


@pytest.mark.parametrize("spec", ["ngram", "draft:same", "draft:wrong"])
def test_greedy_with_speculation_equals_plain_decoding(tiny_model_dir, wrong_draft, spec):
    """All prompts in one batch (speculating and non-speculating sequences side by side, with
    prompt chunks in the same steps), and each alone."""
    draft = {"draft:same": f"draft:{tiny_model_dir}", "draft:wrong": f"draft:{wrong_draft}"}
    spec = draft.get(spec, spec)
    plain = run(engine(tiny_model_dir), requests())
    eng = engine(tiny_model_dir, speculative=spec)
    assert run(eng, requests()) == plain
    _pools_free(eng)
    st = eng.stats
    assert st.spec_proposed > 0
    if "wrong" in spec:          # proposes 0 every time: accepted only where the target says 0
        zeros = sum(toks.count(0) for toks in plain.values())
        assert st.spec_accepted <= zeros
    elif "draft" in spec:        # the target as its own draft: everything is accepted
        assert st.spec_accepted == st.spec_proposed
    else:
        assert st.spec_accepted > 0
    assert st.steps < sum(len(t) for t in plain.values()) or "wrong" in spec
    for r in requests()[:2]:
        eng = engine(tiny_model_dir, speculative=spec)
        assert run(eng, [r]) == {r.request_id: plain[r.request_id]}
        _pools_free(eng)


@pytest.mark.parametrize("linear", linear_params())
def test_ngram_speculation_equals_plain_decoding_on_every_linear_path(tiny_model_dir, linear):
    """Verification scores several tokens of a sequence in one step: on every --linear-method
    its greedy tokens are plain decoding's (oneDNN's rows included)."""
    plain = run(engine(tiny_model_dir, linear_method=linear), requests())
    eng = engine(tiny_model_dir, speculative="ngram", linear_method=linear)
    assert run(eng, requests()) == plain
    assert eng.stats.spec_accepted > 0
    _pools_free(eng)


def test_speculation_stops_at_eos_and_max_tokens(tiny_model_dir):
    """A proposal run that crosses the stop token or max_tokens is cut there."""
    plain = run(engine(tiny_model_dir), requests())
    stop_tok = plain["1"][5]
    eos_params = SamplingParams(temperature=0, max_tokens=24)
    for max_tokens in (1, 2, 7):
        p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        eng = engine(tiny_model_dir, speculative=f"draft:{tiny_model_dir}")
        got = run(eng, [Request("1", PROMPTS[1], p)])
        assert got["1"] == plain["1"][:max_tokens]
        _pools_free(eng)
    eng = engine(tiny_model_dir, speculative=f"draft:{tiny_model_dir}")
    eng.scheduler.eos = frozenset({stop_tok})
    got = run(eng, [Request("1", PROMPTS[1], eos_params)])
    assert got["1"] == plain["1"][:plain["1"].index(stop_tok) + 1]
    _pools_free(eng)


@pytest.mark.parametrize("spec", ["ngram", "draft:same"])
def test_sampling_with_speculation_runs_to_length_with_logprobs(tiny_model_dir, spec):
    """Seeded sampling is reproducible for the same proposals (engine.spec.verify); how many
    are verified depends on measured step times, so only lengths and logprobs are compared."""
    spec = f"draft:{tiny_model_dir}" if spec == "draft:same" else spec
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=20, ignore_eos=True,
                            logprobs=True)
    eng = engine(tiny_model_dir, speculative=spec)
    reqs = requests(params)
    got = run(eng, reqs)
    assert all(len(t) == 20 for t in got.values())
    assert all([lp.token_id for lp in r.output_logprobs] == got[r.request_id] for r in reqs)
    assert eng.stats.spec_proposed > 0 or spec == "ngram"    # random text rarely repeats
    _pools_free(eng)


def test_rejection_path_with_a_one_token_nucleus_equals_greedy(tiny_model_dir):
    """temperature > 0 with top_k=1 goes through rejection sampling, and must give exactly the
    greedy tokens (the n-gram proposals of the looping tiny model get verified)."""
    plain = run(engine(tiny_model_dir), requests())
    params = SamplingParams(temperature=0.7, top_k=1, seed=1, max_tokens=24, ignore_eos=True)
    eng = engine(tiny_model_dir, speculative="ngram")
    assert run(eng, requests(params)) == plain
    assert eng.stats.spec_accepted > 0
    _pools_free(eng)


def test_preemption_with_speculation_keeps_greedy_output(tiny_model_dir):
    plain = run(engine(tiny_model_dir), requests())
    eng = engine(tiny_model_dir, num_blocks=20, speculative=f"draft:{tiny_model_dir}")
    assert run(eng, requests()) == plain
    assert eng.stats.preemptions > 0
    _pools_free(eng)


def test_controller_probes_a_kind_once_per_probe_after_steps_however_many_offer_it():
    """A kind that is never worth verifying, offered by 32 sequences every step: one probe token
    every 16 steps in all (not one per 16 offers, i.e. two a step)."""
    ctl = SpecController(max_tokens=8, probe_after=16)
    for t in range(1, 33):
        ctl.observe_step(t, 0, 0.050 + 0.004 * t)
    for i in range(20):
        ctl.record(f"a{i}", 8, 0, kind=2)
    ids = [f"s{i}" for i in range(32)]
    granted = [sum(ctl.plan(ids, [8] * 32, kinds=[2] * 32)) for _ in range(48)]
    assert sum(granted) == 3 and max(granted) == 1


PROCESSED = dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3,
                 logit_bias=((0, 2.0), (7, -5.0)), min_tokens=6, stop_token_ids=(3,))


@pytest.mark.parametrize("spec", ["ngram", "draft:same", "draft:wrong"])
def test_processed_logits_with_speculation_equal_plain_decoding(tiny_model_dir, wrong_draft, spec):
    """Penalties, logit bias and min_tokens with speculation: each verification row is processed
    as if the proposals before it were accepted, so greedy output is plain decoding's, and
    rejection sampling through a one-token nucleus (top_k=1) is too."""
    draft = {"draft:same": f"draft:{tiny_model_dir}", "draft:wrong": f"draft:{wrong_draft}"}
    spec = draft.get(spec, spec)
    for params in (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **PROCESSED),
                   SamplingParams(temperature=0.7, top_k=1, seed=1, max_tokens=24,
                                  ignore_eos=True, **PROCESSED)):
        plain = run(engine(tiny_model_dir), requests(params))
        greedy = run(engine(tiny_model_dir), requests())
        assert plain != greedy, "the processing must change the output for the test to mean much"
        eng = engine(tiny_model_dir, speculative=spec)
        assert run(eng, requests(params)) == plain
        assert eng.stats.spec_proposed > 0
        _pools_free(eng)


def test_seeded_sampling_with_ngram_speculation_equals_plain_sampling(tiny_model_dir):
    """n-gram proposals are point masses, verified against the rows' own seeded draws: the
    output is token for token that of plain sampling, whatever was proposed (with penalties
    too)."""
    for params in (SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=24,
                                  ignore_eos=True),
                   SamplingParams(temperature=1.2, top_k=20, seed=6, max_tokens=24,
                                  ignore_eos=True, **PROCESSED)):
        plain = run(engine(tiny_model_dir), requests(params))
        eng = engine(tiny_model_dir, speculative="ngram")
        assert run(eng, requests(params)) == plain
        assert eng.stats.spec_proposed > 0
        _pools_free(eng)
