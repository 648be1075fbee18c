"""Expert parallelism on CPU: real rank processes over gloo, tokens sent to their experts'
ranks by all-to-all, against one rank: the same logits and greedy tokens at EP=2 and EP=3 (six
experts: three ranks hold two each, two hold three), plain tensor parallelism of the MoE layers
beside it (each expert's intermediate split), and each rank holding only its experts."""

from __future__ import annotations

import pytest
import torch

from engine.layers.moe import Experts, expert_range
from engine.weights import weight_bytes
from pdserve.gpucheck import engine_generate, engine_logits
from tests.conftest import make_engine
from tests.moe_models import make_moe

IDS = list(range(3, 40))
PROMPTS = [[5, 9, 17, 3, 3, 100, 41], [7] * 13, [1, 2, 3]]
# six query heads and intermediate sizes that split 2 and 3 ways
SHAPE = dict(num_attention_heads=6, num_key_value_heads=6, head_dim=16, intermediate_size=96)
_REF: dict = {}


def _run(path, tp: int, ep: bool):
    eng = make_engine(path, tensor_parallel_size=tp, expert_parallel=ep, num_blocks=64,
                      block_size=4, max_num_batched_tokens=16)
    try:
        logits = engine_logits(eng, IDS)
        tokens = engine_generate(eng, PROMPTS, 12)
        assert eng.pool.num_free == eng.pool.num_blocks
        experts = [m for m in eng.model.modules() if isinstance(m, Experts)]
        return logits, tokens, experts, sum(weight_bytes(e) for e in experts)
    finally:
        eng.close()


def _reference(tmp_path_factory, family: str, **shape):
    key = (family, tuple(sorted(shape.items())))
    if key not in _REF:
        path = tmp_path_factory.mktemp(family)
        make_moe(path, family, **shape)
        _REF[key] = (path, _run(path, 1, False))
    return _REF[key]


@pytest.mark.parametrize("family,tp,ep,shape", [
    ("qwen2_moe", 2, True, SHAPE),      # shared expert with its gate, a dense layer
    ("qwen2_moe", 3, True, SHAPE),      # two experts a rank
    ("qwen2_moe", 2, False, SHAPE),     # tensor parallel experts
    ("glm4_moe", 3, True, SHAPE),       # grouped sigmoid router, shared experts, partial rotary
    ("minimax_m2", 2, False, dict(SHAPE, num_key_value_heads=1)),   # q/k norms across heads,
    #                                                                 the KV head replicated
    ("gpt_oss", 2, False, SHAPE),       # expert biases (down's added once), sinks by head
    ("gpt_oss", 2, True, SHAPE),        # whole experts with their biases
])
def test_matches_one_rank(tmp_path_factory, family, tp, ep, shape):
    path, (ref_logits, ref_tokens, ref_experts, ref_bytes) = _reference(tmp_path_factory,
                                                                        family, **shape)
    logits, tokens, experts, nbytes = _run(path, tp, ep)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert tokens == ref_tokens
    e = experts[0].num_experts
    if ep:                             # rank 0 holds its experts whole, nothing else's
        first, n = expert_range(e, tp, 0)
        assert [(x.first, x.local, x.inter) for x in experts] == \
            [(first, n, ref_experts[0].inter)] * len(experts)
    else:
        assert all(x.local == e and x.inter * tp == ref_experts[0].inter for x in experts)
    # rank 0's bytes of expert weights (as packed for its kernels): its share of the experts,
    # or of every expert's columns (then the packing's 16-row panels pad a narrower slice more)
    share = nbytes / ref_bytes
    assert abs(share - experts[0].local / e) < 0.02 if ep else share < 1 / tp + 0.1, share


def test_uneven_expert_split(tmp_path):
    """Seven experts over three ranks (2, 2, 3): the same tokens as one rank."""
    make_moe(tmp_path, "mixtral", num_local_experts=7, **SHAPE)
    ref_logits, ref_tokens, _, _ = _run(tmp_path, 1, False)
    logits, tokens, experts, _ = _run(tmp_path, 3, True)
    assert [expert_range(7, 3, r)[1] for r in range(3)] == [2, 2, 3]
    assert experts[0].local == 2
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert tokens == ref_tokens
