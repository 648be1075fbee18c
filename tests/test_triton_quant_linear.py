"""The quantized Triton linear (pdkernels/triton_quant_linear.py) against dequantize-then-matmul:
the decode GEMV (M 1), split-K decodes (M <= 16), prefill tiles with and without a split; 8-bit
and packed 4-bit weights (offsets for asymmetric groups), per-channel and group scales, N and K
off the tiles, bias on and off. The plan is checked on the shapes of real models, the packing
exactly. Device from PDSERVE_TEST_DEVICE (default cpu: the interpreter, tiny shapes)."""

from __future__ import annotations

import os

import pytest
import torch

from pdkernels.triton_quant_linear import (H200_SMS, pack_int4, packable, plan, prepare,
                                         quant_linear, quant_linear_ref, unpack_int4)

DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")
if DEVICE.startswith("cuda") and not torch.cuda.is_available():
    pytest.skip(f"PDSERVE_TEST_DEVICE={DEVICE} but CUDA is unavailable", allow_module_level=True)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.startswith("cuda") else [])
TOL = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}   # ~one rounding step


def _weights(n: int, k: int, bits: int, groups: int, asymmetric: bool, g: torch.Generator):
    """q int8 [N, K] (values minus zero points: 4 bits span 16 values per group) and scales
    [N, groups] sized so y is O(1)."""
    if bits == 8:
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    else:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int16)
        zero = torch.randint(0, 16, (n, groups), generator=g) if asymmetric \
            else torch.full((n, groups), 8)
        q = (q - zero.repeat_interleave(k // groups, dim=1)).to(torch.int8)
    qmax = 127 if bits == 8 else 15
    scale = torch.rand(n, groups, generator=g) / (qmax * k ** 0.5) + 1e-4
    return q, scale


# ----------------------------------------------------------------------------- packing
def test_pack_int4_layout_and_round_trip():
    q = torch.tensor([[1, -2, 7, -8, 3], [0, -1, -8, 7, -5]], dtype=torch.int8)   # K odd
    packed, offset = pack_int4(q)
    assert offset is None and packed.dtype == torch.int8 and packed.shape == (2, 3)
    assert packed.view(torch.uint8).tolist() == [[0xE1, 0x87, 0x03], [0xF0, 0x78, 0x0B]]
    assert torch.equal(unpack_int4(packed, 5), q)
    g = torch.Generator().manual_seed(0)
    for groups in (1, 4):                   # values minus zero points of asymmetric groups
        q, _ = _weights(6, 128, 4, groups, True, g)
        packed, offset = pack_int4(q, groups)
        assert packed.shape == (6, 64) and offset.shape == (6, groups)
        assert torch.equal(unpack_int4(packed, 128, offset), q)
    with pytest.raises(ValueError, match="not 4-bit"):
        pack_int4(torch.tensor([[-8, 8]], dtype=torch.int8))


def test_prepare_packs_4_bit_weights_where_the_groups_allow():
    g = torch.Generator().manual_seed(1)
    q, scale = _weights(8, 128, 4, 2, True, g)
    packed, s, offset, bits = prepare(q, scale, 4)
    assert bits == 4 and packed.shape == (8, 64) and offset.shape == (8, 2) and s is not None
    assert packed.numel() * 2 == q.numel()                  # half the bytes of int8 storage
    q16, s16, off16, bits16 = prepare(q, torch.rand(8, 8), 4)   # groups of 16: int8 as it is
    assert bits16 == 8 and torch.equal(q16, q) and off16 is None
    assert prepare(q, scale, 8)[3] == 8
    assert packable(96, 1) and packable(128, 4) and not packable(128, 8)


# ----------------------------------------------------------------------------- the plan
@pytest.mark.parametrize("m", [1, 4, 16])
def test_decode_plan_fills_an_h200(m):
    """Several programs per SM at decode for the projections of SmolLM2-135M and an 8B model;
    the K splits cover K exactly, none empty."""
    for n in (576, 960, 1536, 3072, 4096, 6144, 14336, 28672):
        for k in (576, 1536, 4096, 14336):
            for group in (0, 64):
                p = plan(m, n, k, group)
                assert p.gemv == (m == 1) and p.block_m == (1 if m == 1 else 16)
                assert p.programs(m, n) >= 2 * H200_SMS, (m, n, k, group, p)
                assert p.k_split % p.block_k == 0 and (not group or group % p.block_k == 0)
                assert (p.split - 1) * p.k_split < k <= p.split * p.k_split, p
    assert plan(1, 4096, 4096).split > 1 and plan(1, 4096, 4096).programs(1, 4096) >= 512


def test_prefill_plan_splits_only_below_one_wave():
    p = plan(2048, 4096, 4096, 128)
    assert (p.block_m, p.split, p.gemv) == (64, 1, False)
    assert plan(2048, 576, 1536).split == 1
    assert plan(64, 576, 576).split > 1                     # 9 tiles alone on 132 SMs


# ----------------------------------------------------------------------------- the kernel
# (M, N, K, bits, groups, asymmetric, bias, num_sms): the path each takes is asserted.
CASES = [
    (1, 70, 96, 8, 1, False, False, None),       # GEMV, split K, per channel, N off the tile
    (1, 40, 128, 4, 2, True, True, None),        # GEMV, 4-bit groups of 64 with offsets
    (3, 33, 97, 4, 1, False, True, None),        # split K, 4-bit per channel, K odd
    (5, 64, 128, 8, 4, False, True, None),       # split K, 8-bit groups of 32
    (2, 24, 96, 8, 2, False, True, None),        # split K, groups of 48 (K tile 16)
    (20, 33, 130, 8, 1, False, True, 1),         # prefill tiles, no split, K off the tile
    (17, 48, 256, 4, 2, True, False, 1),         # prefill tiles, 4-bit groups of 128
    (18, 24, 64, 4, 2, True, True, None),        # prefill tiles split over K
]


def _path(m: int, n: int, k: int, groups: int, num_sms) -> str:
    p = plan(m, n, k, 0 if groups == 1 else k // groups, num_sms or H200_SMS)
    return ("gemv" if p.gemv else "small" if p.block_m == 16 else "large") + \
        ("+split" if p.split > 1 else "")


def test_cases_cover_every_path():
    paths = {_path(m, n, k, groups, sms) for m, n, k, _, groups, _, _, sms in CASES}
    assert paths == {"gemv+split", "small+split", "large", "large+split"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,bits,groups,asym,with_bias,num_sms", CASES)
def test_quant_linear_matches_dequantize_then_matmul(dtype, m, n, k, bits, groups, asym,
                                                     with_bias, num_sms):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    q, scale = _weights(n, k, bits, groups, asym, g)
    if groups == 1 and m % 2:
        scale = scale[:, 0].contiguous()                    # per channel given as [N]
    offset = None
    if bits == 4:
        q, offset = pack_int4(q, groups)
        assert (offset is not None) == asym
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    bias = torch.randn(n, generator=g).to(DEVICE, dtype) if with_bias else None
    args = (q.to(DEVICE), scale.to(DEVICE), bias, None if offset is None else offset.to(DEVICE),
            bits)
    got = quant_linear(x, *args, num_sms=num_sms)
    assert got.shape == (m, n) and got.dtype == dtype
    want = quant_linear_ref(x, *args)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    from engine.layers.quant_formats import grouped_reference      # the engine's own reference
    w = unpack_int4(q, k, offset) if bits == 4 else q
    same = grouped_reference(x.float().cpu(), w, scale.reshape(n, -1),
                             None if bias is None else bias.float().cpu())
    torch.testing.assert_close(got.float().cpu(), same, atol=2 * TOL[dtype], rtol=2 * TOL[dtype])


def test_split_k_is_deterministic_and_batches_keep_their_leading_dims():
    g = torch.Generator().manual_seed(5)
    q, scale = _weights(40, 192, 4, 3, True, g)
    packed, offset = pack_int4(q, 3)
    args = (packed.to(DEVICE), scale.to(DEVICE), None, offset.to(DEVICE), 4)
    x = torch.randn(2, 1, 192, generator=g).to(DEVICE)
    assert plan(2, 40, 192, 64).split > 1
    first = quant_linear(x, *args)
    assert first.shape == (2, 1, 40)
    assert torch.equal(first, quant_linear(x, *args))
    empty = quant_linear(x[:0], *args)
    assert empty.shape == (0, 1, 40)


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="layers pack for the kernel on CUDA")
def test_4_bit_layers_hold_packed_weights_on_cuda():
    """QuantizedMethod on CUDA: a 4-bit scheme's weights packed at process_weights_after_loading
    (half the bytes), computed by the kernel as the engine's reference computes them."""
    from engine.layers.linear import Linear, QuantizedMethod
    from engine.layers.quant_formats import QuantScheme, grouped_reference
    g = torch.Generator().manual_seed(6)
    q, scale = _weights(96, 256, 4, 2, True, g)
    layer = Linear(256, 96, method=QuantizedMethod(QuantScheme("gptq", 4, 128), False))
    layer = layer.to(DEVICE)
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(scale)
    layer.process_weights_after_loading()
    assert layer.qbits == 4 and layer.qweight.shape == (96, 128) and layer.qoffset is not None
    x = torch.randn(3, 256, generator=g).to(DEVICE, torch.bfloat16)
    want = grouped_reference(x.float().cpu(), q, scale)
    torch.testing.assert_close(layer(x).float().cpu(), want, atol=2e-2, rtol=2e-2)


def test_tuned_tiles_are_measured_checked_and_then_planned(tmp_path, monkeypatch):
    """`tune` tries each tile and split for a decode batch, checks each output against the
    rule's and keeps the fastest by the timer it is given; an entry in the tuned table then
    decides that shape's plan (other shapes keep the rule), with the same output."""
    import json

    import pdkernels.triton_quant_linear as tq

    g = torch.Generator().manual_seed(8)
    q, scale = _weights(64, 256, 8, 1, False, g)
    q, scale, offset, bits = prepare(q, scale, 8)
    q, scale = q.to(DEVICE), scale.to(DEVICE)
    x = torch.randn(4, 256, generator=g).to(DEVICE)
    calls = []

    def time_of(fn):                   # the rule first, then the candidates: the 4th is fastest
        fn()
        calls.append(len(calls))
        return 0.5 if len(calls) == 5 else 1.0

    key, entry, best, rule = tq.tune(x, q, scale, offset, bits, time_of)
    assert key == "4,64,256,0,8" and best == 0.5 and rule == 1.0
    tried = [(bn, bk, s) for bn, bk in tq.TILES for s in tq.SPLITS
             if tq._split_plan(16, bn, bk, 256, s, False).split == s]
    assert len(calls) == 1 + len(tried) and entry == list(tried[3])
    table = tmp_path / "tuned.json"
    table.write_text(json.dumps({tq.device_name(torch.device(DEVICE)): {key: entry}}))
    monkeypatch.setattr(tq, "TUNED_FILE", table)
    tq.tuned_tiles.cache_clear()
    try:
        tuned = tq.tuned_tiles(tq.device_name(torch.device(DEVICE)))
        p = plan(3, 64, 256, 0, H200_SMS, tuned, 8)      # 3 rows: the bucket of 4
        assert [p.block_n, p.block_k, p.split] == entry and p.block_m == 16
        assert plan(4, 64, 512, 0, H200_SMS, tuned, 8) == plan(4, 64, 512)
        torch.testing.assert_close(quant_linear(x, q, scale, None, offset, bits).cpu(),
                                   quant_linear_ref(x, q, scale, None, offset, bits).cpu(),
                                   atol=TOL[torch.float32], rtol=TOL[torch.float32])
    finally:
        tq.tuned_tiles.cache_clear()
