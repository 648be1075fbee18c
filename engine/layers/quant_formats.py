"""Pre-quantized checkpoint formats, read into one form: integer weights q [N, K] (the stored
value minus its zero point: W = q * scale) and scales [N, K / group], with a torch reference of
the grouped matmul. Engine layers load this form (see the loader seam in engine.layers.linear);
each function names the published layout it reads.

Packing shared by the formats: an int32 holds 32 / bits values, the first in the lowest bits.
- GPTQ (AutoGPTQ / GPTQModel): qweight I32 [K * bits / 32, N] packed along K, qzeros I32
  [K / G, N * bits / 32] packed along N, scales [K / G, N], g_idx [K]. Version 1
  (checkpoint_format "gptq") stores each zero minus 1, word by word (a zero of 0 borrows from
  the next field): adding 0x11..1 to the whole word (mod 2^32) gives the zeros back exactly.
- AWQ (GEMM): qweight I32 [K, N / 8] packed along N in the order [0, 2, 4, 6, 1, 3, 5, 7]
  (column 8c + j sits in field [0, 4, 1, 5, 2, 6, 3, 7][j]), qzeros [K / G, N / 8] likewise,
  stored as they are, scales [K / G, N].
- compressed-tensors pack-quantized (W4A16): weight_packed I32 [N, K * bits / 32] packed along
  K, signed values stored plus 2^(bits - 1); weight_scale [N, K / G]; weight_shape [N, K];
  weight_zero_point (asymmetric) packed along N, [N * bits / 32, K / G]. int-quantized (W8A8):
  weight int8 [N, K], weight_scale [N, 1].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

AWQ_FIELD = (0, 4, 1, 5, 2, 6, 3, 7)      # field of column 8c + j in an AWQ word


def unpack_int32(packed: torch.Tensor, bits: int, dim: int,
                 fields: tuple[int, ...] | None = None) -> torch.Tensor:
    """The unsigned values of int32 words, 32 / bits per word, unpacked along `dim` (0 or 1 of a
    2-D tensor): value j of a word is field fields[j] (default j), field i at bits
    [bits * i, bits * (i + 1))."""
    per = 32 // bits
    order = torch.tensor(fields if fields is not None else range(per), dtype=torch.int64)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    values = (words.unsqueeze(-1) >> (order * bits)) & ((1 << bits) - 1)   # [R, C, per]
    r, c = packed.shape
    if dim == 1:
        return values.reshape(r, c * per)
    return values.permute(0, 2, 1).reshape(r * per, c)


def _signed(q: torch.Tensor, bits: int) -> torch.Tensor:
    return q.to(torch.int8 if bits <= 7 else torch.int16)


def _check_groups(g_idx: torch.Tensor | None, k: int, group: int) -> None:
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64),
                                             torch.arange(k) // group):
        raise ValueError("act-order checkpoints (desc_act: a g_idx that is not k // group_size) "
                         "are not supported yet")


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              bits: int, group: int, g_idx: torch.Tensor | None = None, version: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ tensors -> (q [N, K], scale [N, K / G])."""
    if bits not in (2, 4, 8):
        raise ValueError(f"GPTQ with {bits} bits is not supported (2, 4, 8)")
    q = unpack_int32(qweight, bits, 0)                               # [K, N]
    k = q.shape[0]
    group = k if group in (-1, 0) else group
    _check_groups(g_idx, k, group)
    words = qzeros.to(torch.int64)
    if version == 1:                     # stored z - 1, word by word
        words = (words + sum(1 << (bits * i) for i in range(32 // bits))) & 0xFFFFFFFF
    z = unpack_int32(words, bits, 1)                                 # [G, N]
    zk = z.repeat_interleave(group, dim=0)[:k]
    return _signed((q - zk).t().contiguous(), bits), scales.t().contiguous()


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ GEMM tensors (4 bits) -> (q [N, K], scale [N, K / G])."""
    q = unpack_int32(qweight, 4, 1, AWQ_FIELD)                       # [K, N]
    k = q.shape[0]
    group = k if group in (-1, 0) else group
    z = unpack_int32(qzeros, 4, 1, AWQ_FIELD)                        # [G, N]
    zk = z.repeat_interleave(group, dim=0)[:k]
    return _signed((q - zk).t().contiguous(), 4), scales.t().contiguous()


def from_compressed_tensors(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                            weight_shape: torch.Tensor, bits: int,
                            weight_zero_point: torch.Tensor | None = None,
                            g_idx: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors pack-quantized tensors -> (q [N, K], scale [N, K / G] or [N, 1])."""
    n, k = (int(v) for v in weight_shape.tolist())
    offset = 1 << (bits - 1)
    q = unpack_int32(weight_packed, bits, 1)[:, :k] - offset        # [N, K] signed
    groups = weight_scale.shape[1]
    group = -(-k // groups)
    _check_groups(g_idx, k, group)
    if weight_zero_point is not None:
        z = unpack_int32(weight_zero_point, bits, 0)[:n] - offset    # [N, G]
        q = q - z.repeat_interleave(group, dim=1)[:, :k]
    return _signed(q, bits), weight_scale.contiguous()


def from_int_quantized(weight: torch.Tensor, weight_scale: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors int-quantized (W8A8, per channel) -> (q [N, K] int8, scale [N, 1])."""
    return weight.to(torch.int8), weight_scale.reshape(weight.shape[0], -1).contiguous()


def grouped_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize, then matmul: W[n, k] = q[n, k] * scale[n, k // G], G = ceil(K / groups)."""
    k = q.shape[1]
    group = -(-k // scale.shape[1])
    w = q.to(x.dtype) * scale.to(x.dtype).repeat_interleave(group, dim=1)[:, :k]
    return F.linear(x, w, bias)
