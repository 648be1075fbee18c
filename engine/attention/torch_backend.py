"""The `torch` attention backend: paged attention in torch (the CPU path and the reference).

On x86 CPUs with AVX2 (fp32), decodes and short queries after cached context go to our C++
kernel (pdkernels/cpu_attention.py), which reads each sequence's blocks in place with the query
heads of a KV head sharing every K/V row: at 32 decodes of 256-token contexts a step spends a
fraction of what gathering and SDPA took (see the README); the layers' RMSNorms and the rotary
embeddings then run in one pass each too (pdkernels/cpu_ops.py, `kernels` "cpu"). Elsewhere,
and for prompt chunks, the torch path below.

A step's batch is ragged: B sequences, each contributing q_len_i new tokens, concatenated into
T = sum(q_len_i) rows with no padding. `AttentionMetadata` describes that batch once per step and
is passed explicitly to every layer.

Sequences are attended in groups, each one gather of the group's context blocks and one SDPA
call over a padded [B, heads, Q_max, L_max] problem with a mask (causal per row, padding off):
decodes (q_len 1) in some groups, short queries after cached context (q_len <=
MAX_GROUPED_QUERY: a decode verifying speculative tokens, the tail of a prompt whose prefix was
cached) in others. On accelerators a group takes every such sequence; on CPUs a group gathers at
most CPU_GROUP_BYTES of K/V per layer, so what it gathers is still in cache when SDPA reads it
(at 32 sequences of 400 tokens one group of 20 MB made a decode step 2.3x slower than groups of
2 MB). Prompt chunks are attended one by one (causal, offset by cached context).

A layer's attention may add to that (engine.config.LayerAttention): a sliding window narrows
each query's mask to its last `window` positions (a group's masks are built per window once a
step), soft-capping and learned sinks take an explicit softmax (SDPA has neither), HF's
arithmetic: scores in the model dtype, the softmax in fp32. The C++ kernel takes them too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, BatchLayout
from engine.config import CPU_ATTENTION, FULL, LayerAttention
from engine.layers.rotary import apply_rotary
from pdkernels import cpu_attention, cpu_build, cpu_ops


MAX_GROUPED_QUERY = 32     # longest query attended in a padded group rather than on its own
CPU_GROUP_BYTES = 2 << 20  # K and V one group gathers per layer on CPUs (fits the caches)


def group_tokens_for(kv: torch.Tensor) -> int | None:
    """The group_tokens limit for a KV pool [layers, 2, blocks, block_size, kv_heads, head_dim]:
    on CPUs what CPU_GROUP_BYTES hold; none on accelerators."""
    return _group_tokens(kv.device, kv.shape[-2], kv.shape[-1], kv.element_size())


def _group_tokens(device: torch.device, kv_heads: int, head_dim: int, elem: int) -> int | None:
    if device.type != "cpu":
        return None
    return max(CPU_GROUP_BYTES // (2 * kv_heads * head_dim * elem), 1)


@dataclass(frozen=True)
class QueryGroup:
    """Sequences attended together, each query padded to the group's longest, Q.

    rows:   [Bg, Q] long, the step's row of each query (padding repeats a real row);
    real:   [Bg * Q] bool, which of those are real queries (None when all are: Q == 1);
    blocks: [Bg, nb_max] long, each sequence's block table padded with block 0;
    mask:   [Bg, 1, Q, nb_max * block_size] bool, True where a query may attend the position;
    limit:  [Bg, 1, Q, 1] long, one past each query's position (for `window_mask`).
    """

    rows: torch.Tensor
    real: torch.Tensor | None
    blocks: torch.Tensor
    mask: torch.Tensor
    limit: torch.Tensor | None = None
    _windows: dict = field(default_factory=dict, compare=False, repr=False)

    def window_mask(self, window: int) -> torch.Tensor:
        """The mask of a sliding layer: each query's last `window` positions (built once)."""
        if window not in self._windows:
            pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            self._windows[window] = self.mask & (pos >= self.limit - window)
        return self._windows[window]

    @classmethod
    def build(cls, seqs: list[int], tables: list[list[int]], starts: list[int], q_lens: list[int],
              qsl: list[int], block_size: int, device: torch.device) -> "QueryGroup":
        q = max(q_lens[i] for i in seqs)
        ends = [starts[i] + q_lens[i] for i in seqs]
        nb = -(-max(ends) // block_size)
        blocks = torch.zeros(len(seqs), nb, dtype=torch.long)
        rows = torch.empty(len(seqs), q, dtype=torch.long)
        limit = torch.empty(len(seqs), q, dtype=torch.long)   # attend positions < limit
        for j, i in enumerate(seqs):
            used = -(-ends[j] // block_size)
            blocks[j, :used] = torch.tensor(tables[i][:used], dtype=torch.long)
            n = q_lens[i]
            rows[j, :n] = torch.arange(qsl[i], qsl[i] + n)
            rows[j, n:] = qsl[i] + n - 1
            limit[j, :n] = torch.arange(starts[i] + 1, ends[j] + 1)
            limit[j, n:] = ends[j]
        mask = torch.arange(nb * block_size)[None, None, :] < limit[:, :, None]   # [Bg, Q, L]
        real = None
        if q > 1:
            real = (torch.arange(q)[None, :] < torch.tensor([q_lens[i] for i in seqs])[:, None])
            real = real.view(-1).to(device)
        return cls(rows.to(device), real, blocks.to(device), mask[:, None].to(device),
                   limit[:, None, :, None].to(device))


@dataclass(frozen=True)
class AttentionMetadata:
    """Shapes: T = new tokens in the step, B = sequences in the step.

    slot_mapping:     [T] long, flat slot (block_id * block_size + offset) each new token's KV goes to
    query_start_loc:  B + 1 ints, sequence i owns rows [query_start_loc[i], query_start_loc[i+1])
    seq_lens:         B ints, context length of sequence i after this step (cached + new)
    block_tables:     per sequence attended one by one after cached context, its used blocks
    one_by_one:       indices i of sequences attended one by one (prompt chunks)
    masks:            per sequence, [q_len, seq_len] bool for queries after cached context
                      attended one by one (None where no mask is needed)
    groups:           the sequences attended batched (decodes, then short queries)
    kernel:           those sequences for the CPU attention kernel instead (then no groups)
    """

    slot_mapping: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[torch.Tensor]
    one_by_one: list[int]
    masks: list[torch.Tensor | None]
    groups: tuple[QueryGroup, ...]
    kernel: "KernelBatch | None" = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def build(cls, tables: list[list[int]], starts: list[int], q_lens: list[int],
              block_size: int, device: torch.device,
              group_tokens: int | None = None, kernel: bool = False) -> "AttentionMetadata":
        """tables: each sequence's blocks; starts: its cached tokens; q_lens: its new tokens;
        group_tokens: the most padded context tokens one group may gather (None: no limit; see
        group_tokens_for); kernel: decodes and short queries go to the CPU attention kernel."""
        slots, qsl, seq_lens, one_by_one, decodes, short = [], [0], [], [], [], []
        for i, (table, start, n) in enumerate(zip(tables, starts, q_lens)):
            slots.extend(table[p // block_size] * block_size + p % block_size
                         for p in range(start, start + n))
            if n == 1:
                decodes.append(i)
            elif start > 0 and n <= MAX_GROUPED_QUERY:
                short.append(i)
            else:
                one_by_one.append(i)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
        batch, groups = None, ()
        if kernel:
            batch = KernelBatch.build(decodes + short, tables, seq_lens, q_lens, qsl, block_size)
        else:
            groups = tuple(QueryGroup.build(chunk, tables, starts, q_lens, qsl, block_size,
                                            device)
                           for seqs in (decodes, short)
                           for chunk in _chunks(seqs, seq_lens, group_tokens))
        tabs: list[torch.Tensor | None] = [None] * len(tables)
        masks: list[torch.Tensor | None] = [None] * len(tables)
        for i in one_by_one:          # a chunk after cached context: query j sits at start + j
            start, n = starts[i], q_lens[i]
            if start > 0:
                used = -(-(start + n) // block_size)
                tabs[i] = torch.tensor(tables[i][:used], dtype=torch.long, device=device)
                masks[i] = (torch.arange(start + n, device=device)[None, :]
                            <= torch.arange(start, start + n, device=device)[:, None])
        return cls(torch.tensor(slots, dtype=torch.long, device=device), qsl, seq_lens,
                   tabs, one_by_one, masks, groups, batch)


@dataclass(frozen=True)
class KernelBatch:
    """Sequences for pdkernels.cpu_attention (int32 CPU tensors): block_tables [n, W] (row i:
    sequence i's used blocks, padded with 0), seq_lens, q_start, q_lens [n]."""

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    q_start: torch.Tensor
    q_lens: torch.Tensor

    @classmethod
    def build(cls, seqs: list[int], tables, seq_lens: list[int], q_lens: list[int],
              qsl: list[int], block_size: int) -> "KernelBatch | None":
        if not seqs:
            return None
        used = [-(-seq_lens[i] // block_size) for i in seqs]
        bt = torch.zeros(len(seqs), max(used), dtype=torch.int32)
        for j, (i, n) in enumerate(zip(seqs, used)):
            bt[j, :n] = torch.tensor(tables[i][:n], dtype=torch.int32)
        ints = torch.tensor([[seq_lens[i], qsl[i], q_lens[i]] for i in seqs], dtype=torch.int32)
        return cls(bt, ints[:, 0].contiguous(), ints[:, 1].contiguous(), ints[:, 2].contiguous())


def _chunks(seqs: list[int], lens: list[int], limit: int | None) -> list[list[int]]:
    """Split seqs, in order, so that each part's count x longest context is at most limit."""
    if not seqs:
        return []
    if limit is None:
        return [seqs]
    out, cur, longest = [], [], 0
    for i in seqs:
        if cur and (len(cur) + 1) * max(longest, lens[i]) > limit:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, lens[i])
    out.append(cur)
    return out


def store_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write new K/V rows into one layer's cache.

    cache: [2, num_blocks, block_size, kv_heads, head_dim]; k, v: [T, kv_heads, head_dim].
    """
    kv_heads, head_dim = k.shape[1], k.shape[2]
    cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
    cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, v)


def gather_kv(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
    """K and V of the first `length` tokens of a sequence: two [length, kv_heads, head_dim]."""
    _, _, block_size, kv_heads, head_dim = cache.shape
    n = -(-length // block_size)
    k = _gather_blocks(cache[0], blocks[:n]).view(-1, kv_heads, head_dim)[:length]
    v = _gather_blocks(cache[1], blocks[:n]).view(-1, kv_heads, head_dim)[:length]
    return k, v


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, ...] -> [len(blocks), block elements]. Each block is one row of a 2-D
    view, which index_select copies whole (on CPU, about 3x faster than on the 4-D shape)."""
    return cache.view(cache.shape[0], -1).index_select(0, blocks)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, spec: LayerAttention = FULL,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole context (its last
    spec.window positions on a sliding layer; soft-capped scores and sinks where spec says).

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] (already stored in `cache`).
    Returns [T, heads, head_dim].
    """
    out = torch.empty_like(q)
    if meta.kernel is not None:
        b = meta.kernel
        cpu_attention.paged_attention(q, cache[0], cache[1], out, b.block_tables, b.seq_lens,
                                      b.q_start, b.q_lens, scale, spec.window, spec.softcap,
                                      sinks)
    for group in meta.groups:
        o = _grouped_attention(q, cache, group, scale, spec, sinks)       # [Bg * Q, H, D]
        if group.real is None:
            out[group.rows.view(-1)] = o
        else:
            out[group.rows.view(-1)[group.real]] = o[group.real]
    qsl = meta.query_start_loc
    for i in meta.one_by_one:
        start, end, seq_len = qsl[i], qsl[i + 1], meta.seq_lens[i]
        n = end - start
        if n == seq_len:                 # nothing cached before: attend over the step's own rows
            ks, vs, first = k[start:end], v[start:end], 0
        elif spec.window:                # a sliding layer reads from its first query's window on
            bs = cache.shape[2]
            lo = max(seq_len - n - spec.window + 1, 0) // bs
            ks, vs = gather_kv(cache, meta.block_tables[i][lo:], seq_len - lo * bs)
            first = lo * bs
        else:
            ks, vs, first = *gather_kv(cache, meta.block_tables[i], seq_len), 0
        mask = meta.masks[i]
        if spec.window:
            mask = window_mask(seq_len - n, n, spec.window, q.device, first)
        out[start:end] = _attend(q[start:end], ks, vs, scale, mask, spec, sinks)
    return out


def window_mask(start: int, n: int, window: int, device, first: int = 0) -> torch.Tensor:
    """[n, start + n - first] bool: query j (at position start + j) sees positions p with
    start + j - window < p <= start + j, of the positions from `first` on."""
    pos = torch.arange(first, start + n, device=device)[None, :]
    at = torch.arange(start, start + n, device=device)[:, None]
    return (pos <= at) & (pos > at - window)


def _grouped_attention(q: torch.Tensor, cache: torch.Tensor, group: QueryGroup, scale: float,
                       spec: LayerAttention = FULL, sinks: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """A group's padded queries over their padded contexts. Returns [Bg * Q, heads, head_dim]."""
    _, _, block_size, kv_heads, head_dim = cache.shape
    bg, nb = group.blocks.shape
    flat = group.blocks.view(-1)
    k = _gather_blocks(cache[0], flat).view(bg, nb * block_size, kv_heads, head_dim)
    v = _gather_blocks(cache[1], flat).view(bg, nb * block_size, kv_heads, head_dim)
    k, v = k.transpose(1, 2), v.transpose(1, 2)                          # [Bg, KVH, L, D]
    qg = q[group.rows].transpose(1, 2)                                    # [Bg, H, Q, D]
    mask = group.window_mask(spec.window) if spec.window else group.mask
    o = sdpa(qg, k, v, mask, False, scale, spec, sinks)                  # [Bg, H, Q, D]
    return o.transpose(1, 2).reshape(-1, q.shape[1], head_dim)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: torch.Tensor | None, spec: LayerAttention = FULL,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [q_len, heads, d]; k, v: [kv_len, kv_heads, d]; queries are the last q_len positions
    (mask: [q_len, kv_len] when 1 < q_len < kv_len)."""
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))   # [1, heads, len, d]
    causal = mask is None and 1 < q.shape[0] == k.shape[0]
    o = sdpa(qh, kh, vh, mask, causal, scale, spec, sinks)
    return o.squeeze(0).transpose(0, 1)                                  # [q_len, heads, d]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
         causal: bool, scale: float, spec: LayerAttention = FULL,
         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, Q, D] over k, v [B, KVH, L, D] (queries the last Q positions); mask
    broadcastable to [B, H, Q, L]. With soft-capping or sinks, the explicit softmax (HF's eager
    arithmetic: scores in q's dtype, the softmax in fp32; a sink is a logit of its own per head
    that takes its share of the mass and has no value)."""
    if not spec.softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=True)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale                # [B, H, Q, L]
    if spec.softcap:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if causal:
        ql, kl = scores.shape[-2:]
        mask = torch.ones(ql, kl, dtype=torch.bool, device=q.device).tril(kl - ql)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        b, h, ql, _ = scores.shape
        scores = torch.cat([scores, sinks.to(scores.dtype).view(1, h, 1, 1).expand(b, h, ql, 1)],
                           dim=-1)
    probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, v)


def use_cpu_kernel(choice: str, device: torch.device, head_dim: int, block_size: int,
                   dtype: torch.dtype) -> bool:
    """Whether decodes and short queries go to our AVX2 kernel (`choice` "avx2") or to gather +
    SDPA ("sdpa"); "auto": the kernel where it runs on a host where our kernels are preferred
    (AVX2-best hosts, AMD Zen 4, Intel AVX-512: pdkernels.cpu_build.kernels_preferred, measured
    faster there); on other AVX-512 hosts gather + SDPA until measured otherwise."""
    if choice not in CPU_ATTENTION:
        raise ValueError(f"cpu_attention must be one of {CPU_ATTENTION}, got {choice!r}")
    runs = device.type == "cpu" and cpu_attention.supports(head_dim, block_size, dtype)
    if choice == "avx2" and not runs:
        why = ("it runs on CPUs only" if device.type != "cpu" else
               "it needs an x86 CPU with AVX2 and FMA and a C++ compiler"
               if not cpu_attention.available() else
               f"it takes float32, head_dim a multiple of 8 and blocks of at most "
               f"{cpu_attention.max_block()} tokens (got {dtype}, {head_dim}, {block_size})")
        raise ValueError(f"--cpu-attention avx2: the AVX2 attention kernel cannot run here: {why}")
    if choice == "auto":
        return runs and cpu_build.kernels_preferred()
    return choice == "avx2"


def runnable_cpu_attention(head_dim: int, block_size: int, dtype: torch.dtype) -> list[str]:
    """The forced --cpu-attention choices that run on this host for these shapes."""
    ok = []
    for choice in CPU_ATTENTION[1:]:
        try:
            use_cpu_kernel(choice, torch.device("cpu"), head_dim, block_size, dtype)
        except ValueError:
            continue
        ok.append(choice)
    return ok


class TorchBackend(AttentionBackend):
    """Metadata built from the host's lists each step (AttentionMetadata); eager only."""

    name = "torch"

    def __init__(self, *args, cpu_attention: str = "auto") -> None:
        super().__init__(*args)
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.group_tokens = _group_tokens(self.device, self.model.num_kv_heads,
                                          self.model.head_dim, elem)
        self.kernel = use_cpu_kernel(cpu_attention, self.device, self.model.head_dim,
                                     self.block_size, self.dtype)
        if self.kernel and cpu_ops.available():   # norms and rotary in one pass too
            self.kernels = "cpu"

    def build(self, batch: BatchLayout, buffers=None, pad_to: int | None = None
              ) -> tuple[AttentionMetadata, ...]:
        if pad_to is not None:
            raise ValueError("the torch attention backend does not pad batches (no CUDA graphs)")
        return tuple(AttentionMetadata.build(batch.tables(g), batch.starts, batch.q_lens,
                                             self.block_size, self.device, self.group_tokens,
                                             self.kernel)
                     for g in range(self.num_groups))

    def forward(self, q, k, v, rope, cache, meta: AttentionMetadata, scale: float,
                spec: LayerAttention = FULL, sinks: torch.Tensor | None = None):
        cos, sin = rope
        if self.kernels == "cpu" and cpu_ops.usable_rotary(q, cos):
            q, k = cpu_ops.rotary_(q, cos, sin), cpu_ops.rotary_(k, cos, sin)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        store_kv(cache, k, v, meta.slot_mapping)
        return paged_attention(q, k, v, cache, meta, scale, spec, sinks)   # [T, H, D]
