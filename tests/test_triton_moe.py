"""The fused MoE kernels (pdkernels/triton_moe.py) against the per-expert torch reference: decode-
and prefill-sized blocks, experts that get no token, ids of experts on other ranks (-1, expert
parallelism), T = 0; moe_align's padded layout exactly; the plan at a real MoE shape. Device from
PDSERVE_TEST_DEVICE (default cpu: the Triton interpreter, tiny shapes, fp32 and fp16; on cuda
bf16 too, the no-sync promise and a CUDA graph capture)."""

from __future__ import annotations

import os

import pytest
import torch

from pdkernels.triton_moe import (H200_SMS, fused_moe, fused_moe_ref, max_blocks, moe_align,
                                  plan)

DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")
if DEVICE.startswith("cuda") and not torch.cuda.is_available():
    pytest.skip(f"PDSERVE_TEST_DEVICE={DEVICE} but CUDA is unavailable", allow_module_level=True)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.startswith("cuda") else [])
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}   # atol == rtol
H, INTER = 32, 48            # INTER not a power of two: column and K tiles run off its end


def make_case(t: int, experts: int, topk: int, dtype, *, used: int | None = None,
              off_rank: float = 0.0, ids_dtype=torch.int64, seed: int = 0):
    """Random x and weights (outputs of size ~1), and a router's choice: per token `topk`
    distinct experts of the first `used` (the others get no token), each slot then replaced by
    -1 with probability `off_rank`, and positive weights."""
    g = torch.Generator().manual_seed(seed)
    used = experts if used is None else used
    x = torch.randn(t, H, generator=g)
    w13 = torch.randn(experts, 2 * INTER, H, generator=g) / H ** 0.5
    w2 = torch.randn(experts, H, INTER, generator=g) / INTER ** 0.5
    ids = torch.stack([torch.randperm(used, generator=g)[:topk] for _ in range(t)]) if t \
        else torch.zeros(0, topk, dtype=torch.long)
    ids[torch.rand(ids.shape, generator=g) < off_rank] = -1
    weights = torch.rand(t, topk, generator=g) + 0.1
    to = dict(device=DEVICE, dtype=dtype)
    return (x.to(**to), w13.to(**to), w2.to(**to), weights.to(DEVICE),
            ids.to(DEVICE, ids_dtype))


def _close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype],
                               rtol=TOL[dtype])


# ----------------------------------------------------------------------------- routing layout
def test_moe_align_pads_each_expert_to_whole_blocks():
    ids = torch.tensor([[2, 0], [2, -1], [4, 2]], device=DEVICE)        # pairs 0..5
    sorted_ids, block_expert, num_padded = moe_align(ids, 5, 4)
    s = 6                                                             # the sentinel, T * k
    assert sorted_ids.dtype == block_expert.dtype == torch.int32
    assert max_blocks(6, 5, 4) == 6 and sorted_ids.shape == (24,)
    assert sorted_ids[:12].tolist() == [1, s, s, s, 0, 2, 5, s, 4, s, s, s]
    assert (sorted_ids[12:] == s).all()
    assert block_expert.tolist() == [0, 2, 4, 5, 5, 5] and num_padded.tolist() == [12]


def test_moe_align_keeps_every_routed_pair_once():
    g = torch.Generator().manual_seed(3)
    t, k, e, block_m = 37, 3, 9, 16
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[torch.rand(t, k, generator=g) < 0.2] = -1
    ids[ids == 4] = -1                                                # an expert with none
    ids[0, 0], ids[1, 1] = e, -7                                      # out of range: dropped
    sorted_ids, block_expert, num_padded = moe_align(ids.to(DEVICE, torch.int32), e, block_m)
    sorted_ids, block_expert = sorted_ids.cpu(), block_expert.cpu()
    flat = ids.reshape(-1)
    n = int(num_padded)
    assert n % block_m == 0 and (block_expert[n // block_m:] == e).all()
    assert (sorted_ids[n:] == t * k).all()
    real = sorted_ids[:n][sorted_ids[:n] < t * k].long()
    assert sorted(real.tolist()) == ((flat >= 0) & (flat < e)).nonzero().flatten().tolist()
    owner = block_expert[:n // block_m].repeat_interleave(block_m)
    placed = sorted_ids[:n] < t * k
    assert torch.equal(flat[sorted_ids[:n][placed].long()], owner[placed].long())
    assert 4 not in block_expert.tolist()
    assert block_expert[:n // block_m].tolist() == sorted(block_expert[:n // block_m].tolist())


# ----------------------------------------------------------------------------- planning
def test_plan_at_qwen3_30b_a3b():
    """2048 -> 768, 128 experts, top-8: one token per block at decode with column tiles cut
    to fill the SMs; tensor-core tiles once experts see dozens of tokens."""
    decode = plan(1, 2048, 768, 128, 8)
    assert decode.block_m == 16 and decode.gate_up.block_n < 64 and decode.down.block_n < 64
    assert 8 * (2048 // decode.down.block_n) >= 4 * H200_SMS
    assert plan(16, 2048, 768, 128, 8).gate_up.block_n == 64                # 128 busy blocks
    assert plan(256, 2048, 768, 128, 8).block_m == 32
    prefill = plan(2048, 2048, 768, 128, 8)
    assert prefill.block_m == 64 and prefill.gate_up.block_n == prefill.down.block_n == 64
    assert plan(1, 2048, 768, 128, 8, num_sms=8).gate_up.block_n == 64      # few SMs


# ----------------------------------------------------------------------------- the kernels
# (T, experts, top-k, experts used, share of slots off this rank, ids dtype, block_m)
CASES = [
    (1, 5, 2, 5, 0.0, torch.int64, 16),         # decode: one token
    (3, 5, 2, 3, 0.0, torch.int32, 16),         # experts 3 and 4 get no token
    (17, 5, 2, 5, 0.3, torch.int32, 16),        # -1 ids (expert parallelism)
    (24, 5, 2, 4, 0.0, torch.int64, 32),        # ~10 pairs per expert: 32-row blocks
    (40, 2, 2, 2, 0.1, torch.int64, 64),        # prefill tiles, a partly filled last block
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,experts,topk,used,off_rank,ids_dtype,block_m", CASES)
def test_fused_moe_matches_reference(dtype, t, experts, topk, used, off_rank, ids_dtype,
                                     block_m):
    assert plan(t, H, INTER, experts, topk).block_m == block_m
    x, w13, w2, weights, ids = make_case(t, experts, topk, dtype, used=used, off_rank=off_rank,
                                         ids_dtype=ids_dtype, seed=t)
    got = fused_moe(x, w13, w2, weights, ids)
    assert got.shape == (t, H) and got.dtype == dtype and got.is_contiguous()
    _close(got, fused_moe_ref(x, w13, w2, weights, ids), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 24])
def test_biases_and_the_clamped_swiglu(dtype, t):
    """gpt-oss's experts: gate/up and down biases, (up + 1) * gate * sigmoid(alpha * gate) with
    both clamped (a limit the random projections cross), ids of other ranks; the same through
    the engine's reference experts (engine.layers.moe) in fp32."""
    x, w13, w2, weights, ids = make_case(t, 5, 2, dtype, off_rank=0.2, seed=30 + t)
    g = torch.Generator().manual_seed(t)
    b13 = (torch.randn(5, 2 * INTER, generator=g) * 0.5).to(w13)
    b2 = (torch.randn(5, H, generator=g) * 0.5).to(w13)
    extra = dict(b13=b13, b2=b2, activation="swiglu_limit", alpha=1.702, limit=0.6)
    got = fused_moe(x, w13, w2, weights, ids, **extra)
    want = fused_moe_ref(x, w13, w2, weights, ids, **extra)
    _close(got, want, dtype)
    assert not torch.allclose(got.float(), fused_moe_ref(x, w13, w2, weights, ids).float(),
                              atol=1e-2)
    if dtype == torch.float32:
        from engine.config import MoEConfig
        from engine.layers.moe import Experts, MoEMethod
        from engine.parallel import SINGLE

        moe = MoEConfig(num_experts=5, top_k=2, intermediate_size=INTER, layers=(0,),
                        expert_bias=True, activation="swiglu_limit", swiglu_limit=0.6)
        ex = Experts(5, H, INTER, SINGLE, False, moe)
        for param, value in ((ex.gate_up_proj, w13), (ex.down_proj, w2),
                             (ex.gate_up_proj_bias, b13), (ex.down_proj_bias, b2)):
            param.data.copy_(value.cpu())
        _close(MoEMethod().apply(ex, x.cpu(), weights.cpu(), ids.cpu()), want.cpu(), dtype)


def test_off_rank_tokens_get_zeros_and_views_of_x_work():
    """A token whose every slot is on another rank gets exact zeros; x may be a view with a
    row stride (its last dim contiguous); another SM count (other column tiles) agrees."""
    dtype = torch.float32
    x, w13, w2, weights, ids = make_case(6, 5, 2, dtype, seed=11)
    ids[2] = -1
    wide = torch.randn(6, H + 8, device=DEVICE)
    wide[:, :H] = x
    got = fused_moe(wide[:, :H], w13, w2, weights, ids)
    assert (got[2] == 0).all()
    _close(got, fused_moe_ref(x, w13, w2, weights, ids), dtype)
    assert plan(6, H, INTER, 5, 2, num_sms=1) != plan(6, H, INTER, 5, 2)
    _close(fused_moe(x, w13, w2, weights, ids, num_sms=1), got, dtype)


def test_no_tokens():
    x, w13, w2, weights, ids = make_case(0, 5, 2, torch.float32)
    got = fused_moe(x, w13, w2, weights, ids)
    assert got.shape == (0, H) and fused_moe_ref(x, w13, w2, weights, ids).shape == (0, H)


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="host syncs and graphs need a GPU")
def test_fused_moe_never_syncs_and_captures_in_cuda_graph():
    dtype = torch.bfloat16
    x, w13, w2, weights, ids = make_case(9, 6, 2, dtype, off_rank=0.2, seed=4)
    want = fused_moe_ref(x, w13, w2, weights, ids)
    fused_moe(x, w13, w2, weights, ids)                      # compiles every kernel first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe(x, w13, w2, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    _close(out, want, dtype)
