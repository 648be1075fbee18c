"""Sampling: logits processing (logit_bias, min_tokens, grammar masks, repetition / frequency /
presence penalties), then greedy, or temperature, min-p, top-k, top-p, seeded; with logprobs;
batched on the device.

Randomness is a pure function of (seed, index of the token in the output, stream): token i of a
request draws its uniform number from a counter-based hash of those (`uniform`, computed on the
host in a few integer operations and staged with the step's inputs). The same request therefore
gives the same tokens whichever worker samples it, whatever else shares its batch, and after
preemption. A token is drawn by inverting the CDF of its distribution (summed in float64, so
each token keeps its probability to ~1e-16) at that number. Top-p finds its nucleus among
each row's most likely candidates without sorting the vocabulary (`filter_rows`), and the CDF
is then summed over those candidates only.

`Sampler` is the device path: every sampled row of a step in one batched call (processing,
greedy rows, temperature, min-p, top-k and top-p per row), the chosen tokens and their logprobs
returned to the host in ONE transfer. Processing is vectorised over the rows: a logit bias is
one scatter-add of (row, token, bias) triples; penalties count each row's tokens with one
scatter-add into a [rows, vocab] table; bans and grammar masks are scatters / a bit-unpacking.
Steps whose rows need none of it skip it. `sample` runs it on plain lists (tests, one-off callers); `draw`,
`sampling_probs` and `token_logprob` are the per-row pieces rejection sampling and the draft
proposer use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from engine.request import SamplingParams, TokenLogprob

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant spreading (seed, index) over the hash's space
_M64 = (1 << 64) - 1


def token_seed(seed: int, index: int) -> int:
    return (seed * _MIX + index * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


def uniform(seed: int, index: int, stream: int = 0) -> float:
    """A number in [0, 1) that depends only on its arguments (splitmix64 finalizer over the
    mixed counter; 53 bits). Stream 0 draws tokens; rejection sampling's acceptance tests use
    stream 1."""
    z = token_seed(seed, index) ^ ((stream * 0xD6E8FEB86659FD93) & _M64)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z ^= z >> 31
    return (z >> 11) * (1.0 / (1 << 53))


# top-p looks for the nucleus among each row's CANDIDATES most likely tokens first (a partial
# top-k, no full-vocabulary sort), then among SPILL_CANDIDATES for the rows whose nucleus reaches
# past those (flatter distributions); only rows it reaches past both are sorted in full.
CANDIDATES = 256
SPILL_CANDIDATES = 4096


def _keep_prefix(x: torch.Tensor, vals: torch.Tensor, ids: torch.Tensor, n: torch.Tensor,
                 stable: bool = False) -> torch.Tensor:
    """x [R, V] with all but each row's n[r] most likely tokens set to -inf, given candidates
    vals/ids [R, C] sorted by value (descending; ties in any order unless `stable`: by id)
    holding them. Among tokens tied at the last kept value, the lowest ids stay (what a stable
    descending sort keeps)."""
    out = torch.full_like(x, float("-inf"))
    if stable:                           # the first n are the ones kept
        keep = torch.arange(vals.shape[1], device=x.device)[None, :] < n[:, None]
        return out.scatter(1, ids, torch.where(keep, vals, float("-inf")))
    last = vals.gather(1, (n - 1)[:, None])                              # [R, 1]
    tied = vals == last
    m = n[:, None] - (vals > last).sum(-1, keepdim=True)                 # tied tokens kept
    # the m-th smallest id among the tied candidates bounds the ones kept
    tied_ids = torch.where(tied, ids, torch.iinfo(ids.dtype).max).sort(-1).values
    id_cap = tied_ids.gather(1, (m - 1).clamp(min=0))
    keep = (vals > last) | (tied & (ids <= id_cap))
    return out.scatter(1, ids, torch.where(keep, vals, float("-inf")))


def filter_rows(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor | None, max_top_k: int, any_top_p: bool,
                drawn: torch.Tensor | None = None, sort_all: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [R, V] (temperature applied) with entries outside min-p, top-k and the top-p nucleus
    set to -inf, in that order; per row top_k (0: off), top_p (1: off), min_p (0: off).

    Top-p keeps a token while the probability mass of the tokens ranked above it is below
    top_p (the first always stays; ties ranked by id). It is decided on the CANDIDATES (or
    max_top_k) most likely tokens where the nucleus ends within them, which is every row of a
    peaked distribution, else on the SPILL_CANDIDATES most likely, and on a full sort of the
    rows where it ends past those too.

    Also returns the candidate ids [R, C] when every `drawn` row keeps nothing outside them,
    so the draw can sum over C tokens instead of the vocabulary (else None). One host sync at
    most, and one more where rows spill past the first candidates. `sort_all`: every top-p
    row takes the full sort (the memory profile's worst case)."""
    v = x.shape[-1]
    if min_p is not None:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), float("-inf"))
    if not (max_top_k or any_top_p):
        return x, None
    c = min(v, max(max_top_k, CANDIDATES))
    vals, ids = x.topk(c, dim=-1)                                        # [R, C] descending
    bounded = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    if max_top_k:
        k = top_k.long()
        kth = vals.gather(1, (k.clamp(max=v) - 1).clamp(min=0, max=c - 1)[:, None])
        cut = ((k > 0) & (k < v))[:, None]
        x = x.masked_fill(cut & (x < kth), float("-inf"))
        vals = vals.masked_fill(cut & (vals < kth), float("-inf"))
        # a row keeps only candidates unless tokens tied with its k-th reach past them
        bounded = (k > 0) & ((vals[:, -1] < kth[:, 0]) | (c == v))
    if not any_top_p:
        return x, _if_holding(ids, bounded, drawn)
    on = top_p < 1.0
    n, decided, reach = _nucleus_in(x, vals, ids, top_p, SPILL_CANDIDATES)
    fits = bounded | decided          # (top-k may already leave nothing outside them)
    if sort_all:
        fits = torch.zeros_like(on)
    x = torch.where((on & fits)[:, None], _keep_prefix(x, vals, ids, n), x)
    spill = on & ~fits
    bounded = bounded | (on & fits)
    holds = (bounded | ~drawn).all() if drawn is not None else torch.zeros_like(on[0])
    any_spill, holds = torch.stack([spill.any(), holds]).tolist()
    if any_spill:
        rows = spill.nonzero()[:, 0]
        wide = (reach[rows] >= top_p[rows]) & (not sort_all)   # else no use trying it
        x = x.index_copy(0, rows, _wide_nucleus(x[rows], top_p[rows], wide))
    return x, ids if holds else None


def _nucleus_in(x: torch.Tensor, vals: torch.Tensor, ids: torch.Tensor, top_p: torch.Tensor,
                 wider: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How many of a row's candidates (vals / ids [R, C], by value descending) top-p keeps,
    whether that is decided on them (the last candidate is dropped and no tie with the last
    kept one reaches past them, or they are the whole vocabulary), and the most mass `wider`
    candidates could hold (theirs, plus each further one at most the last one's)."""
    p = x.softmax(-1).gather(1, ids)                                     # [R, C]
    cum = p.cumsum(-1)
    before = cum - p                              # mass ranked above each candidate
    n = (before < top_p[:, None]).sum(-1).clamp(min=1)
    last = vals.gather(1, (n - 1)[:, None])[:, 0]
    whole = vals.shape[1] == x.shape[1]
    reach = cum[:, -1] + max(wider - vals.shape[1], 0) * p[:, -1]
    return n, ((before[:, -1] >= top_p) & (vals[:, -1] < last)) | whole, reach


def _wide_nucleus(xs: torch.Tensor, top_p: torch.Tensor, wide: torch.Tensor) -> torch.Tensor:
    """Rows whose nucleus passed their first candidates: decided among SPILL_CANDIDATES
    where `wide` (rows whose nucleus those can hold at all), and by a full stable sort for the
    rest (every row in the memory profile). The same cumulative sums as the first tier's: the
    decisions agree whichever tier makes them."""
    fits = torch.zeros(xs.shape[0], dtype=torch.bool, device=xs.device)
    out = xs
    if bool(wide.any()):
        rows = wide.nonzero()[:, 0]
        sub = xs[rows]
        vals, ids = sub.topk(min(xs.shape[-1], SPILL_CANDIDATES), dim=-1)
        n, decided, _ = _nucleus_in(sub, vals, ids, top_p[rows])
        fits = fits.index_copy(0, rows, decided)
        out = out.index_copy(0, rows, _keep_prefix(sub, vals, ids, n))
    if not bool(fits.all()):
        rows = (~fits).nonzero()[:, 0]
        sub = xs[rows]
        svals, sids = sub.sort(dim=-1, descending=True, stable=True)
        n, _, _ = _nucleus_in(sub, svals, sids, top_p[rows])
        out = out.index_copy(0, rows, _keep_prefix(sub, svals, sids, n, stable=True))
    return out


def _if_holding(ids: torch.Tensor, bounded: torch.Tensor, drawn: torch.Tensor | None
                ) -> torch.Tensor | None:
    return ids if drawn is not None and bool((bounded | ~drawn).all()) else None


def _filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """logits [V] (temperature applied) filtered as one row of `filter_rows`."""
    one = lambda val, dt: torch.tensor([val], dtype=dt, device=logits.device)  # noqa: E731
    x, _ = filter_rows(logits[None], one(top_k, torch.int32), one(top_p, torch.float32),
                          one(min_p, torch.float32) if min_p > 0.0 else None,
                          max(top_k, 0), top_p < 1.0)
    return x[0]


def sampling_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[V] logits (processed: see `process_row`) -> the distribution sampled from
    (temperature, min-p, top-k, top-p applied)."""
    return _filter(logits / p.temperature, p.top_k, p.top_p, p.min_p).softmax(-1)


def process_row(logits: torch.Tensor, p: SamplingParams, output: Sequence[int],
                prompt: Sequence[int], eos_token_ids: Sequence[int] = (),
                allowed: torch.Tensor | None = None, grammar_ends: bool = False) -> torch.Tensor:
    """The per-row reference of the batched processing (tests, one-off callers): logits [V] of
    a row whose output so far is `output`; `allowed` [V] bool (a grammar's mask) or None;
    `grammar_ends`: the grammar allows only its end here (min_tokens does not apply)."""
    x = logits.clone()
    for tok, bias in p.logit_bias:
        x[tok] += bias
    if allowed is not None:
        x = x.masked_fill(~allowed, float("-inf"))
    if len(output) < p.min_tokens and not grammar_ends:
        for tok in {*eos_token_ids, *p.stop_token_ids}:
            x[tok] = float("-inf")
    if p.repetition_penalty != 1.0:
        for tok in set(prompt) | set(output):
            x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    counts: dict[int, int] = {}
    for tok in output:
        counts[tok] = counts.get(tok, 0) + 1
    for tok, c in counts.items():
        x[tok] -= p.frequency_penalty * c + p.presence_penalty
    return x


def draw(probs: torch.Tensor, u: float) -> int:
    """One token from `probs` [V] (non-negative, any positive total) at uniform number `u`:
    the first token whose float64 CDF exceeds u * total (a u that rounds up to the total lands
    on the last token with mass)."""
    cdf = probs.to(torch.float64).cumsum(-1)
    target = torch.tensor([u], dtype=torch.float64, device=probs.device) * cdf[-1]
    i = int(torch.searchsorted(cdf, target, right=True))
    if i >= cdf.numel():
        i = int(torch.searchsorted(cdf, cdf[-1:], right=False))
    return i


def draw_rows(probs: torch.Tensor, us: Sequence[float]) -> torch.Tensor:
    """`draw` of each row of `probs` [R, V] at its `us[r]`, on the device (no host sync):
    tokens [R] int64, the same as R calls of `draw`."""
    cdf = probs.to(torch.float64).cumsum(-1)                              # [R, V]
    total = cdf[:, -1:].contiguous()
    u = torch.tensor(list(us), dtype=torch.float64, device=probs.device)[:, None]
    i = torch.searchsorted(cdf, u * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)
    return torch.where(i >= cdf.shape[-1], last, i).squeeze(1)


def token_logprob(logits: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    """Logprob of `token` and the top_n alternatives under the model's raw distribution."""
    lp = logits.log_softmax(-1)
    top: list[tuple[int, float]] = []
    if top_n:
        vals, ids = torch.topk(lp, top_n)
        top = list(zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(token, float(lp[token]), top)


@dataclass(frozen=True)
class RowSampling:
    """One logits row of a step: whose params, which output token it samples, and whether to
    draw it here (False: only its argmax; the row is verified by rejection sampling).
    `output` / `prompt`: the tokens before this row's (output: with the proposals a
    verification row follows), given when the params penalise repetition or set min_tokens."""

    params: SamplingParams
    index: int
    draw: bool = True
    output: Sequence[int] = ()
    prompt: Sequence[int] = ()
    # the row's grammar allows nothing but its end here (only EOS): min_tokens yields to it
    grammar_ends: bool = False

    @property
    def drawn(self) -> bool:
        return self.draw and not self.params.greedy

    @property
    def decided(self) -> bool:
        """This row's token (and logprob) is decided here: greedy, or drawn."""
        return self.draw or self.params.greedy


@dataclass
class Processing:
    """A step's logits processing, staged on the host as flat index lists (None: not needed)."""

    bias: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None      # rows, tokens, values
    bans: tuple[np.ndarray, np.ndarray] | None = None                  # rows, tokens
    counted: tuple[np.ndarray, np.ndarray] | None = None     # output tokens: rows, tokens
    seen: tuple[np.ndarray, np.ndarray] | None = None        # prompt + output (repetition)
    penalties: np.ndarray | None = None      # [R, 3] presence, frequency, repetition
    bitmask: torch.Tensor | None = None      # [R, words] int32 (grammar rows; others all set)

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.bias, self.bans, self.penalties, self.bitmask))


@dataclass(frozen=True)
class SamplingPlan:
    """What a step's rows need, known on the host before the forward pass."""

    rows: tuple[RowSampling, ...]
    any_drawn: bool
    max_top_k: int         # largest top_k among drawn rows (0: none filters by top-k)
    any_top_p: bool
    any_logprobs: bool
    max_top_logprobs: int
    any_min_p: bool = False
    processing: Processing = field(default_factory=Processing)


def _flat(per_row: list[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Row indices and tokens of ragged per-row token lists, flattened."""
    lens = np.fromiter((len(t) for t in per_row), dtype=np.int64, count=len(per_row))
    toks = (np.concatenate([np.asarray(t, dtype=np.int64) for t in per_row]) if lens.sum()
            else np.zeros(0, dtype=np.int64))
    return np.repeat(np.arange(len(per_row), dtype=np.int64), lens), toks


def plan_processing(rows: Sequence[RowSampling], eos_token_ids: Sequence[int],
                    bitmask: torch.Tensor | None = None) -> Processing:
    """The flat index lists of a step's processing (only what its rows use)."""
    proc = Processing(bitmask=bitmask)
    if not any(r.params.processed for r in rows):
        return proc
    bias = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias]
    if bias:
        b = np.asarray(bias, dtype=np.float64)
        proc.bias = (b[:, 0].astype(np.int64), b[:, 1].astype(np.int64), b[:, 2])
    ban_rows, ban_toks = [], []
    for i, r in enumerate(rows):
        p = r.params
        if p.min_tokens and len(r.output) < p.min_tokens and not r.grammar_ends:
            stops = sorted({*eos_token_ids, *p.stop_token_ids})
            ban_rows += [i] * len(stops)
            ban_toks += stops
    if ban_rows:
        proc.bans = (np.asarray(ban_rows, dtype=np.int64), np.asarray(ban_toks, dtype=np.int64))
    if any(r.params.penalized for r in rows):
        proc.penalties = np.asarray([(r.params.presence_penalty, r.params.frequency_penalty,
                                      r.params.repetition_penalty) for r in rows],
                                    dtype=np.float32)
        proc.counted = _flat([r.output if r.params.penalized else () for r in rows])
        if any(r.params.repetition_penalty != 1.0 for r in rows):
            proc.seen = _flat([list(r.prompt) + list(r.output)
                               if r.params.repetition_penalty != 1.0 else () for r in rows])
    return proc


class Sampler:
    """Per-row sampling parameters staged in the runner's StepBuffers, sampled in one call."""

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.sort_all = False       # the memory profile: top-p's worst case (a full sort)

    @staticmethod
    def regions(n: int) -> list[tuple[str, int, torch.dtype]]:
        """StepBuffers regions for n sampled rows."""
        return [("temperature", n, torch.float32), ("top_p", n, torch.float32),
                ("top_k", n, torch.int32), ("min_p", n, torch.float32),
                ("uniform", n, torch.float64)]

    def stage(self, rows: list[RowSampling], host, bitmask: torch.Tensor | None = None
              ) -> SamplingPlan:
        if len(rows) > len(host["temperature"]):
            raise ValueError(f"{len(rows)} sampled rows exceed the {len(host['temperature'])} "
                             "staged")
        temp, top_p, top_k, u = host["temperature"], host["top_p"], host["top_k"], host["uniform"]
        min_p = host["min_p"]
        max_k, any_p, any_draw, any_min_p = 0, False, False, False
        for i, r in enumerate(rows):
            p = r.params
            if r.drawn:
                any_draw = True
                temp[i], top_p[i], top_k[i], min_p[i] = p.temperature, p.top_p, p.top_k, p.min_p
                u[i] = uniform(p.seed, r.index)
                max_k = max(max_k, p.top_k)
                any_p = any_p or p.top_p < 1.0
                any_min_p = any_min_p or p.min_p > 0.0
            else:
                temp[i], top_p[i], top_k[i], min_p[i], u[i] = 0.0, 1.0, 0, 0.0, 0.0
        lps = [r.params.num_top_logprobs for r in rows if r.params.wants_logprobs and r.decided]
        return SamplingPlan(tuple(rows), any_draw, max_k, any_p, bool(lps), max(lps, default=0),
                            any_min_p, plan_processing(rows, self.eos_token_ids, bitmask))

    def sample(self, logits: torch.Tensor, plan: SamplingPlan, dev
               ) -> tuple[list[int], list[TokenLogprob | None], torch.Tensor]:
        """logits [R, V] float32 -> a token per row and, where asked, its logprob; and the
        processed logits (the logits themselves when nothing is processed). One host
        transfer."""
        r = logits.shape[0]
        x = process_logits(logits, plan.processing)
        packed = sample_tensors(logits, dev["temperature"][:r], dev["top_p"][:r],
                                dev["top_k"][:r], dev["uniform"][:r], plan,
                                processed=x, min_p=dev["min_p"][:r],
                                sort_all=self.sort_all).tolist()
        tokens, logprobs = [], []
        n = plan.max_top_logprobs
        for row, vals in zip(plan.rows, packed):
            tok = int(vals[0])
            tokens.append(tok)
            p = row.params
            if p.wants_logprobs and row.decided:
                k = p.num_top_logprobs
                top = [(int(vals[2 + j]), vals[2 + n + j]) for j in range(k)]
                logprobs.append(TokenLogprob(tok, vals[1], top))
            else:
                logprobs.append(None)
        return tokens, logprobs, x


def _dev(a: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(a).to(device, non_blocking=True)


def process_logits(logits: torch.Tensor, proc: Processing) -> torch.Tensor:
    """The batched processing of a step's logits [R, V] (a new tensor; `logits` when there is
    nothing to do). Same result as `process_row` on every row."""
    if not proc.any:
        return logits
    dev, (r, v) = logits.device, logits.shape
    x = logits.clone()
    if proc.bias is not None:
        rows, toks, vals = proc.bias
        x.index_put_((_dev(rows, dev), _dev(toks, dev)),
                     _dev(vals.astype(np.float32), dev), accumulate=True)
    if proc.bitmask is not None:
        from engine.structured import apply_bitmask
        apply_bitmask(x, proc.bitmask.to(dev, non_blocking=True))
    if proc.bans is not None:
        rows, toks = proc.bans
        x.index_put_((_dev(rows, dev), _dev(toks, dev)),
                     torch.tensor(float("-inf"), device=dev))
    if proc.penalties is not None:
        pen = _dev(proc.penalties, dev)
        presence, frequency, repetition = pen[:, 0:1], pen[:, 1:2], pen[:, 2:3]
        if proc.seen is not None:
            rows, toks = proc.seen
            seen = torch.zeros(r, v, dtype=torch.bool, device=dev)
            seen[_dev(rows, dev), _dev(toks, dev)] = True
            x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        rows, toks = proc.counted
        if len(rows):
            counts = torch.zeros(r, v, dtype=torch.float32, device=dev)
            counts.index_put_((_dev(rows, dev), _dev(toks, dev)),
                              torch.ones(len(rows), device=dev), accumulate=True)
            x = x - frequency * counts - presence * (counts > 0).to(torch.float32)
    return x


def sample_tensors(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                   top_k: torch.Tensor, u: torch.Tensor, plan: SamplingPlan,
                   processed: torch.Tensor | None = None,
                   min_p: torch.Tensor | None = None, sort_all: bool = False) -> torch.Tensor:
    """The batched sampler. logits [R, V] f32 (raw: logprobs are theirs), processed [R, V] (what
    the token is chosen from; default: the logits); per row: temperature (0: argmax), top_p,
    top_k, min_p, u [R] f64. Returns [R, 2 + 2n] f64: token, its logprob, n top ids, n top
    logprobs."""
    x = logits if processed is None else processed
    tok = x.argmax(-1)                                                   # [R]
    if plan.any_drawn:
        v = logits.shape[-1]
        drawn = temperature > 0
        x = x / torch.where(drawn, temperature, 1.0)[:, None]            # [R, V]
        x, ids = filter_rows(x, top_k, top_p, min_p if plan.any_min_p else None,
                             plan.max_top_k, plan.any_top_p, drawn, sort_all)
        probs = x.softmax(-1)
        if ids is not None:
            # every drawn row keeps only candidates: the CDF over them, in id order, is the
            # vocabulary's at those ids (the tokens between add exactly zero)
            ids = ids.sort(-1).values
            probs = probs.gather(1, ids)
        cdf = probs.to(torch.float64).cumsum(-1)                         # [R, V or C]
        total = cdf[:, -1:].contiguous()
        i = torch.searchsorted(cdf, u[:, None] * total, right=True)     # [R, 1]
        last = torch.searchsorted(cdf, total, right=False)               # last token with mass
        i = torch.where(i >= cdf.shape[-1], last, i)
        if cdf.shape[-1] < v:
            i = ids.gather(1, i)
        tok = torch.where(drawn, i.squeeze(1), tok)
    cols = [tok.to(torch.float64)[:, None]]
    if plan.any_logprobs:
        lp = logits.log_softmax(-1)
        cols.append(lp.gather(1, tok[:, None]).to(torch.float64))
        if plan.max_top_logprobs:
            vals, ids = lp.topk(plan.max_top_logprobs, dim=-1)
            cols += [ids.to(torch.float64), vals.to(torch.float64)]
    else:
        cols.append(torch.zeros_like(cols[0]))
    return torch.cat(cols, dim=1)


def sample(logits: torch.Tensor, params: list[SamplingParams], indices: list[int],
           rows: list[RowSampling] | None = None, eos_token_ids: Sequence[int] = (),
           bitmask: torch.Tensor | None = None
           ) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits [B, V] float32, one row per request -> token ids and (when asked) logprobs.
    `rows` replaces params/indices when rows carry history (penalties, min_tokens)."""
    sampler = Sampler(eos_token_ids)
    rows = rows if rows is not None else [RowSampling(p, i) for p, i in zip(params, indices)]
    host = {name: torch.zeros(n, dtype=dt).numpy()
            for name, n, dt in sampler.regions(len(rows))}
    plan = sampler.stage(rows, host, bitmask)
    dev = {k: torch.from_numpy(a).to(logits.device) for k, a in host.items()}
    tokens, logprobs, _ = sampler.sample(logits, plan, dev)
    return tokens, logprobs
