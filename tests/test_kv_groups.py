"""KV groups (engine.kv_groups): the plan of which layers share a block table, and the KV cache
manager's tables per group: a sliding group releases the blocks that fell out of the window of
every query still to come, the prefix cache takes a sliding group's blocks only where its
window needs them, a KV transfer lists the same entries on both ends, forks copy per group; an
engine serving a sliding family holds a window's worth of blocks, not the context's."""

from __future__ import annotations

import pytest

from engine.block_hash import BlockHasher
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager, group_hash
from engine.kv_groups import MAX_GROUPS, NULL_BLOCK, plan
from engine.request import Request, SamplingParams

BS, W = 4, 8


def test_plan_groups_layers_by_attention_kind():
    gemma3 = plan([0 if (i + 1) % 6 == 0 else 512 for i in range(26)], 8192)
    assert gemma3.slots == 4 and gemma3.windows == (0,) + (512,) * 6
    assert gemma3.layers[0] == (5, 11, 17, 23) and gemma3.layers[-1] == (24, 25)
    gpt_oss = plan([128, 0] * 12, 4096)
    assert gpt_oss.windows == (0, 128) and gpt_oss.slots == 12
    place = gpt_oss.placement()
    assert place[0] == (1, 0) and place[1] == (0, 0) and place[23] == (0, 11)
    # a window that covers the longest sequence keeps everything: one full group
    assert plan([4096, 0, 4096], 4096).windows == (0,)
    assert plan([64] * 5, 1000).windows == (64,) and plan([64] * 5, 1000).slots == 5
    # too fragmented: one group of every layer, which keeps the whole context
    frag = plan([0] + [64] * (MAX_GROUPS + 3), 1000)
    assert frag.windows == (0,) and frag.slots == MAX_GROUPS + 4


def manager(num_blocks=64, hasher=True):
    groups = plan([0, W], 1000)               # a full group and a sliding one, a layer each
    return KVCacheManager(BlockPool(num_blocks), BS,
                          BlockHasher(BS, 0) if hasher else None, groups)


def run_prompt(kv: KVCacheManager, req: Request, chunk: int) -> None:
    """Compute the request's tokens chunk by chunk, as the scheduler allocates them."""
    while req.num_computed_tokens < req.num_tokens:
        start = req.num_computed_tokens
        n = min(chunk, req.num_tokens - start)
        assert kv.allocate_slots(req.request_id, start + n, start=start) is not None
        req.num_computed_tokens += n
        kv.cache_computed_blocks(req)


def test_a_sliding_group_holds_only_its_window():
    kv = manager(hasher=False)
    req = Request("a", list(range(5)), SamplingParams(max_tokens=200))
    run_prompt(kv, req, chunk=5)
    for step in range(120):                      # decode: one token a step
        start = req.num_tokens
        req.output_token_ids.append(step)
        assert kv.allocate_slots("a", start + 1, start=start) is not None
        req.num_computed_tokens = start + 1
        full, sliding = kv.group_tables("a")
        assert len(full) == len(sliding) == kv.blocks_needed(start + 1)
        first = (start - W + 1) // BS if start >= W else 0
        assert sliding[:first] == [NULL_BLOCK] * first      # released: no longer held
        assert len(sliding) - first <= (W - 1) // BS + 2
    assert kv.held_blocks("a") == len(full) + len(sliding) - first
    assert kv.pool.num_free == kv.pool.num_blocks - kv.held_blocks("a")
    kv.free("a")
    assert kv.pool.num_free == kv.pool.num_blocks


def test_a_cached_prefix_needs_the_blocks_its_sliding_windows_read():
    kv = manager()
    prompt = list(range(100, 141))                           # 41 tokens: 10 full blocks
    a = Request("a", prompt, SamplingParams())
    run_prompt(kv, a, chunk=6)
    kv.free("a")
    b = Request("b", prompt, SamplingParams())
    hit = kv.cached_prefix(b, b.num_tokens - 1)
    assert len(hit) == 10
    first = (40 - W + 1) // BS                                # the window of position 40
    assert hit.blocks[1][:first] == [NULL_BLOCK] * first and hit.released == [0, first]
    # the sliding group's block 8 (in that window) is evicted: 10 blocks no longer serve,
    # 9 need blocks 7..8 (8 missing), 8 need 6..7: there
    hashes = kv.block_hashes(b)
    kv.pool._evict(kv.pool.lookup(group_hash(hashes[8], 1), prompt[32:36]))
    assert len(kv.cached_prefix(b, b.num_tokens - 1)) == 8
    kv.pool._evict(kv.pool.lookup(group_hash(hashes[6], 1), prompt[24:28]))
    hit = kv.cached_prefix(b, b.num_tokens - 1)
    assert len(hit) == 6 and hit.released == [0, (24 - W + 1) // BS]
    # the hit serves: b computes the rest, its windows read blocks that are there
    assert kv.allocate_slots("b", b.num_tokens, prefix=hit, start=24) is not None
    full, sliding = kv.group_tables("b")
    assert full[:6] == kv.cached_prefix(b, 24).blocks[0][:6]
    assert NULL_BLOCK not in sliding[(24 - W + 1) // BS + 1:]
    kv.free("b")
    assert kv.pool.num_free == kv.pool.num_blocks
    # a decode worker's reservation: the hit's blocks before the last position's window are
    # not taken (the prompt's KV arrives; only that window is read)
    hit = kv.cached_prefix(b, b.num_tokens)
    assert kv.allocate_slots("b", b.num_tokens, prefix=hit, start=40) is not None
    first = (40 - W + 1) // BS
    assert kv.group_tables("b")[1][:first] == [NULL_BLOCK] * first
    assert kv.held_blocks("b") == 11 + 11 - first
    kv.free("b")
    assert kv.pool.num_free == kv.pool.num_blocks


def test_a_transfer_lists_the_same_entries_on_both_ends():
    prefill, decode = manager(hasher=False), manager(hasher=False)
    prompt = list(range(41))
    req = Request("r", prompt, SamplingParams())
    handed: list[int] = []
    streamed = 0
    while req.num_computed_tokens < req.num_tokens:       # chunks, handed out as they finish
        start = req.num_computed_tokens
        n = min(7, req.num_tokens - start)
        prefill.allocate_slots("r", start + n, start=start)
        req.num_computed_tokens += n
        upto = req.num_computed_tokens // BS if req.num_computed_tokens < 41 else 11
        handed += prefill.transfer_entries("r", streamed, upto, 41)
        streamed = upto
    assert decode.allocate_slots("r", 41, start=40) is not None      # a reservation
    want = decode.transfer_entries("r", 0, 11, 41)
    assert len(handed) == len(want) == decode.transfer_count(0, 11, 41)
    # the decode worker holds the full group's 11 blocks and the window of position 40
    window = 11 - (40 - W + 1) // BS
    assert decode.held_blocks("r") == 11 + window == len(want)
    assert decode.transfer_count(0, 3, 41) == 3                # a cached prefix: full only


def test_forks_share_and_copy_per_group():
    kv = manager(hasher=False)
    req = Request("p", list(range(22)), SamplingParams())
    run_prompt(kv, req, chunk=22)
    before = kv.pool.num_free
    pairs = kv.fork("p", "c", 5)
    assert len(pairs) == 2                                     # a copy per group
    assert [src for src, _ in pairs] == [t[5] for t in kv.group_tables("p")]
    full, sliding = kv.group_tables("c")
    assert full[:5] == kv.group_tables("p")[0][:5] and sliding[5] == pairs[1][1]
    assert kv.pool.num_free == before - 2
    kv.copies_done(kv.take_copies())
    kv.free("p"), kv.free("c")
    assert kv.pool.num_free == kv.pool.num_blocks


@pytest.mark.parametrize("family,speculative", [("gemma2", "off"), ("mistral", "off"),
                                                ("gemma2", "ngram")])
def test_an_engine_holds_a_window_per_sliding_group(tmp_path, family, speculative):
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from tests.test_attention_families import WINDOW, make_model

    hf = make_model(tmp_path, family)
    eng = Engine(tmp_path, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=8,
                                        speculative=speculative, num_speculative_tokens=4))
    groups = eng.kv_manager.groups
    assert groups.sliding and eng.layout.groups == groups.windows
    prompt = [5, 9, 17, 3, 3, 100, 41, 8, 8, 2, 7, 7, 1, 90] + [5, 9, 17, 3] * 3
    eng.add_request(Request("r", prompt, SamplingParams(temperature=0, max_tokens=40,
                                                        ignore_eos=True)))
    got, peak = [], 0
    while eng.has_work():
        for o in eng.step():
            got.extend(o.new_token_ids)
        peak = max(peak, eng.kv_manager.held_blocks("r"))
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert got == ref
    n = len(prompt) + 40
    full = sum(1 for w in groups.windows if not w) * -(-n // 4)
    step = 8 // 4 + 1                    # a step's tokens (a chunk, or 1 + 4 proposals)
    sliding = sum(1 for w in groups.windows if w) * ((WINDOW - 1) // 4 + 2 + step)
    assert peak <= full + sliding < groups.num_groups * -(-n // 4)
    assert eng.pool.num_free == eng.pool.num_blocks


def test_the_offload_tiers_refuse_sliding_groups_by_name(tmp_path):
    from engine.config import EngineConfig
    from engine.engine import Engine
    from tests.test_attention_families import make_model

    make_model(tmp_path, "gemma2")
    with pytest.raises(ValueError, match="offload tiers .* sliding-window KV groups"):
        Engine(tmp_path, EngineConfig(num_blocks=64, block_size=4, kv_offload_gib=0.01))


def test_structured_choices_on_a_sliding_family(tmp_path, model_dir):
    """Grammar-constrained, sampled choices (n=2: forks copy a block per KV group) of a tiny
    Gemma 2 with the default model's vocabulary, generated well past its window."""
    import re

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.structured import GrammarCompiler, StructuredSpec
    from tests.stack import copy_tokenizer
    from tests.test_attention_families import make_model

    make_model(tmp_path, "gemma2", vocab_size=49152, sliding_window=4)
    copy_tokenizer(model_dir, tmp_path)
    eng = Engine(tmp_path, EngineConfig(num_blocks=128, block_size=4,
                                        max_num_batched_tokens=16))
    assert eng.kv_manager.groups.sliding
    compiler = GrammarCompiler(tmp_path, eng.model_cfg.vocab_size, eng.model_cfg.eos_token_ids)
    pattern = r"(ab|cd)[0-9]{6}-[a-z]{8}"
    spec = StructuredSpec("regex", pattern)
    req = Request("s", list(range(100, 130)), SamplingParams(max_tokens=40, temperature=1.0,
                                                             seed=3, n=2, structured=spec))
    req.structured_state = compiler.compile(spec).matcher()
    eng.add_request(req)
    got: dict[int, list[int]] = {0: [], 1: []}
    while eng.has_work():
        for o in eng.step():
            assert not o.error, o.error
            got[o.choice].extend(o.new_token_ids)
    from gateway.tokenizer import Tokenizer

    tok = Tokenizer(tmp_path)
    eos = set(eng.model_cfg.eos_token_ids)
    for c in (0, 1):
        text = tok.decode([t for t in got[c] if t not in eos])
        assert re.fullmatch(pattern, text), text
    assert eng.pool.num_free == eng.pool.num_blocks
