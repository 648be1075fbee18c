"""Fused mixture-of-experts MLP (Triton), beside its torch reference.

Contract. x [T, H] (fp32, fp16 or bf16; last dim contiguous, any row stride); w13 [E, 2I, H]
(expert e's gate projection in rows 0..I-1, its up projection in rows I..2I-1, nn.Linear
layout [out, in]) and w2 [E, H, I] (down projection), both contiguous and in x's dtype;
topk_weights [T, k] (fp32; other float dtypes are converted) and topk_ids [T, k] (int32 or int64;
any layout). An id outside [0, E) -- -1 by convention, an expert held by another rank under
expert parallelism -- makes its (token, slot) contribute nothing; ids are not range-checked (that
would cost a host sync). out [T, H], new and contiguous, in x's dtype:

  out[t] = sum over j of topk_weights[t, j] * w2[e] @ act(w13[e] @ x[t]),  e = topk_ids[t, j]

with act(gate, up) = silu(gate) * up rounded as HF's MLP does (gate and up projections each
accumulated in fp32 and rounded to x's dtype, silu computed in fp32 and rounded, the product in
fp32 and rounded), the down projection accumulated in fp32 and the weighted sum over the k slots
done in fp32, rounded once at the end.

Optional (gpt-oss): biases b13 [E, 2I] (added to the gate and up projections before the
activation) and b2 [E, H] (added to the down projection before the top-k weight), in x's dtype;
activation "swiglu_limit": gate and up clamped to `limit` (gate from above only), act = (up + 1)
* gate * sigmoid(alpha * gate), in fp32, rounded once.

Work decomposition.
- moe_align (torch ops on the device): the T * k (token, slot) pairs, flattened as t * k + j,
  are grouped by expert and each expert's run is padded to a multiple of BLOCK_M with the
  sentinel T * k. Every M-block (BLOCK_M consecutive entries) then belongs to one expert. The
  buffers are sized by the worst case, pairs + min(E, pairs) * (BLOCK_M - 1) rounded up, so the
  grids follow the shapes alone; blocks past the real padded count are marked expert E and
  their programs return at once. No host sync, no data-dependent shape: capturable in a CUDA
  graph (the reference, fused_moe_ref, does sync).
- _moe_gate_up_kernel, program (M-block, column tile of I): gathers the block's x rows (token =
  pair // k) and multiplies them by the gate and the up tile of its expert in the same K loop
  (two fp32 accumulators), applies SiLU-and-mul in the epilogue and writes the activated rows
  once, to the intermediate [T * k, I] in x's dtype, at their pair index.
- _moe_down_kernel, program (M-block, column tile of H): the block's intermediate rows times
  w2[e], scaled by the pair's top-k weight in the epilogue, written in fp32 to a [T, k, H]
  buffer (one row per pair: no atomics, the result is the same from run to run).
- _moe_combine_kernel, program (token, column tile): adds a token's k rows in slot order,
  skipping slots whose id is out of range (their rows were never written), and rounds to out.

Launch parameters come from `plan` (the tokens, the shapes and the SM count alone): BLOCK_M from
the mean number of pairs per expert (16 at decode, where an expert sees a token or two; up to
64 at prefill); at decode the column tiles shrink until the grid reaches WAVES programs per SM
(the kernels are bound by reading the experts' weights, and every resident program adds loads
in flight). The wrapper queries no device: num_sms comes from the caller (default H200_SMS).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

H200_SMS = 132        # SMs assumed when the caller gives none (H100 and H200 both have 132)
WAVES = 4             # programs per SM the decode tiles aim for
MIN_BLOCK_N = 16      # column tiles shrink to this at decode (tl.dot's smallest N)
COMBINE_BLOCK = 1024  # columns per program of the combine kernel


# ---------------------------------------------------------------------------------------------
# Host-side planning


@dataclass(frozen=True)
class GemmTiles:
    """One grouped GEMM's launch: columns and K per tile, warps, pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoePlan:
    """How one fused_moe call is launched: rows per M-block and each GEMM's tiles."""

    block_m: int
    gate_up: GemmTiles    # x [pairs, H] @ w13[e].T -> act [pairs, I]
    down: GemmTiles       # act [pairs, I] @ w2[e].T -> [pairs, H]


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """M-blocks moe_align allocates: the most the padded runs can fill (every expert that gets
    a pair pads at most BLOCK_M - 1 entries, and at most min(E, pairs) experts get one)."""
    return triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m)


def plan(tokens: int, hidden: int, inter: int, num_experts: int, topk: int,
         num_sms: int = H200_SMS) -> MoePlan:
    """Tiles for T = tokens routed to `topk` of `num_experts` experts of hidden size `hidden` and
    intermediate size `inter`.

    block_m follows the mean pairs per expert, tokens * topk / E (a balanced router; a skewed one
    leaves more blocks half empty): 16 below 8 (decode: one token per block), 32 below 24, else
    64. Decode-sized blocks (16) read each weight tile for one token or two, so the grid is what
    brings bandwidth: column tiles start at 64 and halve, down to MIN_BLOCK_N, until the M-blocks
    likely busy (one per expert that gets a pair) times the column tiles reach WAVES * num_sms,
    with 4 stages to keep loads in flight and K tiles of 128 where the tiles are narrow (64 for
    64 columns: 3 x 36 KiB of bf16 gate/up stages would leave room for two programs per SM
    only). Larger blocks are tensor-core tiles: 64 columns, K tiles of 64, 3 stages (8 warps
    for 64 x 64 blocks of the gate/up kernel, whose two accumulators double the registers)."""
    pairs = tokens * topk
    per_expert = pairs / max(num_experts, 1)
    block_m = 16 if per_expert < 8 else 32 if per_expert < 24 else 64
    if block_m > 16:
        return MoePlan(block_m, GemmTiles(64, 64, 8 if block_m == 64 else 4, 3),
                       GemmTiles(64, 64, 4, 3))
    busy = max(1, min(num_experts, pairs))
    target = WAVES * num_sms

    def tiles(n: int) -> GemmTiles:
        block_n = 64
        while block_n > MIN_BLOCK_N and busy * triton.cdiv(n, block_n) < target:
            block_n //= 2
        return GemmTiles(block_n, 128 if block_n < 64 else 64, 4, 4)

    return MoePlan(16, tiles(inter), tiles(hidden))


# ---------------------------------------------------------------------------------------------
# Routing: pairs sorted and padded per expert


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, block_expert, num_padded) for topk_ids [T, k] (int32 or int64):
    - sorted_ids int32 [max_blocks * block_m]: pair indices t * k + j grouped by expert in
      expert order (pairs in their own order within an expert), each expert's run padded to a
      multiple of block_m with the sentinel T * k, which also fills everything past the padded
      total; pairs whose id is outside [0, E) are left out;
    - block_expert int32 [max_blocks]: the expert of each block of block_m entries, E (no
      expert) past the padded total;
    - num_padded int64 [1]: the padded total (a multiple of block_m), on the device.
    About 20 small torch ops (a stable sort, two searchsorted, cumsum, a scatter), none of which
    waits for the device: every shape follows T, k, E and block_m."""
    pairs = topk_ids.numel()
    dev = topk_ids.device
    cap = max_blocks(pairs, num_experts, block_m) * block_m
    # ids outside [0, E) become key E, sorted after every expert's run and dropped
    key = topk_ids.reshape(-1).clamp(-1, num_experts) % (num_experts + 1)
    sorted_key, order = torch.sort(key, stable=True)
    run_start = torch.searchsorted(                         # [E + 1]: where each key's run starts
        sorted_key, torch.arange(num_experts + 1, dtype=key.dtype, device=dev))
    counts = run_start[1:] - run_start[:-1]
    rank = torch.arange(pairs, device=dev) - run_start[sorted_key]      # place within the run
    padded = (counts + (block_m - 1)) // block_m * block_m
    ends = padded.cumsum(0)
    # key E goes past the padded area, to cap + rank: a spare tail of `pairs` entries
    starts = F.pad(ends - padded, (0, 1), value=cap)
    sorted_ids = torch.full((cap + pairs,), pairs, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, starts[sorted_key] + rank, order.to(torch.int32))
    block_expert = torch.searchsorted(                      # the first expert ending past it
        ends, torch.arange(0, cap, block_m, device=dev), right=True, out_int32=True)
    return sorted_ids[:cap], block_expert, ends[-1:]


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    """acc + a [M, K] @ b [N, K].T; fp32 inputs (IEEE) multiplied exactly, without tf32."""
    if IEEE:
        acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_ptr, expert_ptr, PAIRS, TOPK, H, INTER,
                        NUM_EXPERTS, stride_x, stride_we, b_ptr, alpha, limit,
                        IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        HAS_BIAS: tl.constexpr = False, CLAMPED: tl.constexpr = False):
    """Program (M-block, column tile of I): act[pair, cols] = silu(x[tok] @ gate.T) *
    (x[tok] @ up.T) for the block's pairs, tok = pair // TOPK, gate / up the tile's rows of
    w13[e]."""
    block = tl.program_id(0)
    expert = tl.load(expert_ptr + block)
    if expert >= NUM_EXPERTS:                        # past the padded total
        return
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < PAIRS
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    x_row = x_ptr + (pairs // TOPK).to(tl.int64)[:, None] * stride_x
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    gate_row = w_expert + cols.to(tl.int64)[:, None] * H
    up_row = w_expert + (INTER + cols).to(tl.int64)[:, None] * H
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)[None, :]
        k_ok = kk < H
        x = tl.load(x_row + kk, mask=row_ok[:, None] & k_ok, other=0.0)         # [BM, BK]
        w_gate = tl.load(gate_row + kk, mask=col_ok[:, None] & k_ok, other=0.0)  # [BN, BK]
        w_up = tl.load(up_row + kk, mask=col_ok[:, None] & k_ok, other=0.0)
        acc_gate = _mma(x, w_gate, acc_gate, IEEE)
        acc_up = _mma(x, w_up, acc_up, IEEE)
    dtype = act_ptr.dtype.element_ty
    if HAS_BIAS:
        b_row = b_ptr + expert.to(tl.int64) * 2 * INTER
        acc_gate += tl.load(b_row + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b_row + INTER + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    gate = acc_gate.to(dtype).to(tl.float32)
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(acc_up.to(dtype).to(tl.float32), -limit), limit)
        act = ((up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))).to(dtype)
    else:
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        act = (silu.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(act_ptr + pairs.to(tl.int64)[:, None] * INTER + cols[None, :], act,
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_down_kernel(act_ptr, w_ptr, topk_w_ptr, part_ptr, sorted_ptr, expert_ptr, PAIRS, H,
                     INTER, NUM_EXPERTS, stride_we, b_ptr, IEEE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     HAS_BIAS: tl.constexpr = False):
    """Program (M-block, column tile of H): part[pair, cols] = topk_w[pair] * act[pair] @
    w2[e][cols].T in fp32."""
    block = tl.program_id(0)
    expert = tl.load(expert_ptr + block)
    if expert >= NUM_EXPERTS:                        # past the padded total
        return
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < PAIRS
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    a_row = act_ptr + pairs.to(tl.int64)[:, None] * INTER
    w_row = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * INTER
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)[None, :]
        k_ok = kk < INTER
        a = tl.load(a_row + kk, mask=row_ok[:, None] & k_ok, other=0.0)           # [BM, BK]
        w = tl.load(w_row + kk, mask=col_ok[:, None] & k_ok, other=0.0)           # [BN, BK]
        acc = _mma(a, w, acc, IEEE)
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert.to(tl.int64) * H + cols, mask=col_ok,
                       other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(topk_w_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    tl.store(part_ptr + pairs.to(tl.int64)[:, None] * H + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_combine_kernel(part_ptr, ids_ptr, out_ptr, H, TOPK, NUM_EXPERTS, stride_out,
                        BLOCK: tl.constexpr):
    """Program (token, column tile): out[t] = sum over slots j = 0, 1, ... whose id is in
    [0, E) of part[t, j], in fp32, rounded to out's dtype."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(TOPK):
        e = tl.load(ids_ptr + t * TOPK + j + tl.zeros((BLOCK,), dtype=tl.int32))   # broadcast
        ok = col_ok & (e >= 0) & (e < NUM_EXPERTS)
        acc += tl.load(part_ptr + (t * TOPK + j) * H + cols, mask=ok, other=0.0)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


# ---------------------------------------------------------------------------------------------
# Wrapper


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, num_sms: int | None = None, b13: torch.Tensor | None = None,
              b2: torch.Tensor | None = None, activation: str = "silu", alpha: float = 1.702,
              limit: float = 7.0) -> torch.Tensor:
    """The MoE MLP of the module docstring's contract: a new [T, H] tensor in x's dtype."""
    assert activation in ("silu", "swiglu_limit"), activation
    assert (b13 is None) == (b2 is None), "both biases or neither"
    if b13 is not None:
        assert b13.shape == (w13.shape[0], w13.shape[1]) and b2.shape == w2.shape[:2] and \
            b13.is_contiguous() and b2.is_contiguous(), (b13.shape, b2.shape)
    assert x.dim() == 2 and x.stride(1) == 1, f"x: [T, H] with a contiguous last dim, {x.shape}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), x.dtype
    t, hidden = x.shape
    e, two_inter, _ = w13.shape
    inter = two_inter // 2
    assert w13.shape == (e, 2 * inter, hidden) and w2.shape == (e, hidden, inter), \
        f"w13 [E, 2I, H], w2 [E, H, I] for H {hidden}: {tuple(w13.shape)}, {tuple(w2.shape)}"
    assert w13.dtype == x.dtype and w2.dtype == x.dtype, (w13.dtype, w2.dtype, x.dtype)
    assert w13.is_contiguous() and w2.is_contiguous(), "w13 and w2 must be contiguous"
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == t and topk_weights.shape == \
        topk_ids.shape, f"topk_ids / topk_weights [T, k]: {topk_ids.shape}, {topk_weights.shape}"
    assert not topk_ids.is_floating_point(), topk_ids.dtype
    topk = topk_ids.shape[1]
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    pairs = t * topk
    if pairs == 0 or hidden == 0 or inter == 0 or e == 0:
        return out.zero_()
    p = plan(t, hidden, inter, e, topk, num_sms if num_sms is not None else H200_SMS)
    ids = topk_ids.contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    sorted_ids, block_expert, _ = moe_align(ids, e, p.block_m)
    blocks = block_expert.shape[0]
    ieee = x.dtype == torch.float32
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    g = p.gate_up
    _moe_gate_up_kernel[(blocks, triton.cdiv(inter, g.block_n))](
        x, w13, act, sorted_ids, block_expert, pairs, topk, hidden, inter, e, x.stride(0),
        w13.stride(0), b13 if b13 is not None else w13, float(alpha), float(limit),
        IEEE=ieee, BLOCK_M=p.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k,
        HAS_BIAS=b13 is not None, CLAMPED=activation == "swiglu_limit",
        num_warps=g.num_warps, num_stages=g.num_stages)
    part = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    d = p.down
    _moe_down_kernel[(blocks, triton.cdiv(hidden, d.block_n))](
        act, w2, weights, part, sorted_ids, block_expert, pairs, hidden, inter, e, w2.stride(0),
        b2 if b2 is not None else w2, IEEE=ieee, BLOCK_M=p.block_m, BLOCK_N=d.block_n,
        BLOCK_K=d.block_k, HAS_BIAS=b2 is not None,
        num_warps=d.num_warps, num_stages=d.num_stages)
    block = min(COMBINE_BLOCK, triton.next_power_of_2(hidden))
    _moe_combine_kernel[(t, triton.cdiv(hidden, block))](
        part, ids, out, hidden, topk, e, out.stride(0), BLOCK=block, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------
# Torch reference


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                  activation: str = "silu", alpha: float = 1.702, limit: float = 7.0
                  ) -> torch.Tensor:
    """The same in torch, one expert at a time over the experts that got a pair (ids outside
    [0, E) ignored), with the kernel's roundings: projections in fp32 rounded to x's dtype,
    the weighted down projections added in fp32, rounded once. Syncs with the device."""
    t, hidden = x.shape
    e_count, inter = w13.shape[0], w2.shape[2]
    out = torch.zeros(t, hidden, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in torch.unique(ids[(ids >= 0) & (ids < e_count)]).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        xe = x[tok].float()
        gb = (None, None) if b13 is None else (b13[e, :inter].float(), b13[e, inter:].float())
        gate = F.linear(xe, w13[e, :inter].float(), gb[0]).to(x.dtype)
        up = F.linear(xe, w13[e, inter:].float(), gb[1]).to(x.dtype)
        if activation == "swiglu_limit":
            g, u = gate.float().clamp(max=limit), up.float().clamp(-limit, limit)
            act = ((u + 1) * g * torch.sigmoid(alpha * g)).to(x.dtype)
        else:
            act = (F.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)
        y = F.linear(act.float(), w2[e].float(), None if b2 is None else b2[e].float())
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out.to(x.dtype)
