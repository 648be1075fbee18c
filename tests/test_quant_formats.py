"""The pre-quantized formats' readers (engine.layers.quant_formats) against the published
layouts: words with known contents (as the tools that write them pack them), and round trips
of random weights packed here the way each format's writer packs them."""

from __future__ import annotations

import pytest
import torch

from engine.layers.quant_formats import (from_awq, from_compressed_tensors, from_gptq,
                                         from_int_quantized, grouped_reference, unpack_int32)
from pdserve.quantize import pack_int32


def _word(v: int) -> int:
    return v - (1 << 32) if v >= 1 << 31 else v


def test_known_words():
    """Packing here (pdserve.quantize, the tests' writer) and reading both give the words the
    formats' own writers produce."""
    assert pack_int32(torch.arange(8)[None], 4, 1).tolist() == [[_word(0x76543210)]]
    assert pack_int32(torch.arange(8)[None], 4, 1, (0, 4, 1, 5, 2, 6, 3, 7)).tolist() == \
        [[_word(0x75316420)]]
    assert unpack_int32(torch.tensor([[_word(0x76543210)]], dtype=torch.int32), 4, 1).tolist() \
        == [list(range(8))]
    # AWQ: columns 0..7 holding 0..7 are the word 0x75316420
    awq = torch.tensor([[_word(0x75316420)]], dtype=torch.int32)
    assert unpack_int32(awq, 4, 1, (0, 4, 1, 5, 2, 6, 3, 7)).tolist() == [list(range(8))]
    # compressed-tensors int4 [-8, -1, 0, 1, 2, 3, 7, -3] (stored + 8) is 0x5FBA9870
    ct = torch.tensor([[_word(0x5FBA9870)]], dtype=torch.int32)
    q, s = from_compressed_tensors(ct, torch.tensor([[0.5]]), torch.tensor([1, 8]), 4)
    assert q.tolist() == [[-8, -1, 0, 1, 2, 3, 7, -3]] and s.tolist() == [[0.5]]
    # GPTQ v1: symmetric zeros (8) are stored as 7s
    qw = torch.tensor([[_word(0x76543210)]], dtype=torch.int32)          # K = 8, N = 1
    q, _ = from_gptq(qw, torch.tensor([[0x77777777]], dtype=torch.int32),
                     torch.tensor([[1.0] * 8]), 4, 8)
    assert q[0].tolist() == [v - 8 for v in range(8)]


def _weights(n=24, k=256, group=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    z = torch.randint(0, 16, (n, k // group), generator=g)
    s = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    w = (q - z.repeat_interleave(group, 1)) * s.repeat_interleave(group, 1)
    return q, z, s, w


def test_gptq_v1_round_trip_with_zero_zeros():
    q, z, s, w = _weights()
    z[0, 0] = 0                                  # the borrow case of v1's z - 1 words
    w = (q - z.repeat_interleave(128, 1)) * s.repeat_interleave(128, 1)
    qweight = pack_int32(q.t(), 4, 0)                                  # [K / 8, N]
    stored = pack_int32(z.t(), 4, 1).to(torch.int64) - 0x11111111    # v1: whole words minus 1s
    qzeros = torch.where(stored < -(1 << 31), stored + (1 << 32), stored).to(torch.int32)
    got_q, got_s = from_gptq(qweight, qzeros, s.t().half(), 4, 128,
                             g_idx=torch.arange(256) // 128)
    x = torch.randn(3, 256)
    torch.testing.assert_close(grouped_reference(x, got_q, got_s.float()), x @ w.t(),
                               rtol=1e-3, atol=1e-3)


def test_gptq_act_order_is_refused():
    q, z, s, _ = _weights()
    with pytest.raises(ValueError, match="act-order"):
        from_gptq(pack_int32(q.t(), 4, 0), pack_int32(z.t(), 4, 1), s.t(), 4, 128,
                  g_idx=torch.randperm(256) // 128)


def test_awq_round_trip():
    q, z, s, w = _weights(seed=1)
    fields = (0, 4, 1, 5, 2, 6, 3, 7)
    got_q, got_s = from_awq(pack_int32(q.t(), 4, 1, fields), pack_int32(z.t(), 4, 1, fields),
                            s.t(), 128)
    torch.testing.assert_close(got_q.float() * got_s.repeat_interleave(128, 1), w.float())


def test_compressed_tensors_round_trips():
    g = torch.Generator().manual_seed(2)
    signed = torch.randint(-8, 8, (24, 256), generator=g)
    s = torch.rand(24, 2, generator=g)
    q, got_s = from_compressed_tensors(pack_int32(signed + 8, 4, 1), s, torch.tensor([24, 256]), 4)
    assert torch.equal(q.long(), signed) and torch.equal(got_s, s)
    z = torch.randint(-8, 8, (24, 2), generator=g)                # asymmetric: zero points
    q, _ = from_compressed_tensors(pack_int32(signed + 8, 4, 1), s, torch.tensor([24, 256]), 4,
                                   weight_zero_point=pack_int32((z + 8).t(), 4, 1).t().contiguous())
    assert torch.equal(q.long(), signed - z.repeat_interleave(128, 1))
    # files written before the zero points were packed: int8 [N, groups], signed, as they are
    q, _ = from_compressed_tensors(pack_int32(signed + 8, 4, 1), s, torch.tensor([24, 256]), 4,
                                   weight_zero_point=z.to(torch.int8))
    assert torch.equal(q.long(), signed - z.repeat_interleave(128, 1))
    with pytest.raises(ValueError, match="weight_zero_point"):
        from_compressed_tensors(pack_int32(signed + 8, 4, 1), s, torch.tensor([24, 256]), 4,
                                weight_zero_point=z.to(torch.int32))
    w8 = torch.randint(-127, 128, (24, 256), generator=g, dtype=torch.int8)
    q, s1 = from_int_quantized(w8, torch.rand(24, 1))
    assert q.dtype == torch.int8 and s1.shape == (24, 1)


def test_gptq_8_bit_round_trip():
    """Four values a word; v1 zeros minus 1 word by word (0x01010101)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 256, (16, 256), generator=g)
    z = torch.randint(1, 256, (16, 2), generator=g)
    s = torch.rand(16, 2, generator=g) * 0.01
    stored = pack_int32(z.t(), 8, 1).to(torch.int64) - 0x01010101
    qzeros = torch.where(stored < -(1 << 31), stored + (1 << 32), stored).to(torch.int32)
    got_q, got_s = from_gptq(pack_int32(q.t(), 8, 0), qzeros, s.t(), 8, 128)
    assert torch.equal(got_q.long(), q - z.repeat_interleave(128, 1))
    assert torch.equal(got_s, s)
