"""Sampling: greedy, temperature, top-k, top-p, seeded, with logprobs; batched on the device.

Randomness is a pure function of (seed, index of the token in the output, stream): token i of a
request draws its uniform number from a counter-based hash of those (`uniform`, computed on the
host in a few integer operations and staged with the step's inputs). The same request therefore
gives the same tokens whichever worker samples it, whatever else shares its batch, and after
preemption. A token is drawn by inverting the CDF of its distribution (summed in float64, so
each token keeps its probability to ~1e-16) at that number.

`Sampler` is the device path: every sampled row of a step in one batched call (greedy rows,
temperature, top-k and top-p per row), the chosen tokens and their logprobs returned to the host
in ONE transfer. `sample` runs it on plain lists (tests, one-off callers); `draw`,
`sampling_probs` and `token_logprob` are the per-row pieces rejection sampling and the draft
proposer use.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] with entries outside top-k / the top-p nucleus set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, stable=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sampling_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[V] logits -> the distribution sampled from (temperature, top-k, top-p applied)."""
    return _filter(logits / p.temperature, p.top_k, p.top_p).softmax(-1)


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
    draw it here (False: only its argmax; the row is verified by rejection sampling)."""

    params: SamplingParams
    index: int
    draw: bool = True

    @property
    def drawn(self) -> bool:
        return self.draw and not self.params.greedy

    @property
    def decided(self) -> bool:
        """This row's token (and logprob) is decided here: greedy, or drawn."""
        return self.draw or self.params.greedy


@dataclass(frozen=True)
class SamplingPlan:
    """What a step's rows need, known on the host before the forward pass."""

    rows: tuple[RowSampling, ...]
    any_drawn: bool
    max_top_k: int         # largest top_k among drawn rows (0: none filters by top-k)
    any_top_p: bool
    any_logprobs: bool
    max_top_logprobs: int


class Sampler:
    """Per-row sampling parameters staged in the runner's StepBuffers, sampled in one call."""

    @staticmethod
    def regions(n: int) -> list[tuple[str, int, torch.dtype]]:
        """StepBuffers regions for n sampled rows."""
        return [("temperature", n, torch.float32), ("top_p", n, torch.float32),
                ("top_k", n, torch.int32), ("uniform", n, torch.float64)]

    def stage(self, rows: list[RowSampling], host) -> SamplingPlan:
        if len(rows) > len(host["temperature"]):
            raise ValueError(f"{len(rows)} sampled rows exceed the {len(host['temperature'])} "
                             "staged")
        temp, top_p, top_k, u = host["temperature"], host["top_p"], host["top_k"], host["uniform"]
        max_k, any_p, any_draw = 0, False, False
        for i, r in enumerate(rows):
            p = r.params
            if r.drawn:
                any_draw = True
                temp[i], top_p[i], top_k[i] = p.temperature, p.top_p, p.top_k
                u[i] = uniform(p.seed, r.index)
                max_k = max(max_k, p.top_k)
                any_p = any_p or p.top_p < 1.0
            else:
                temp[i], top_p[i], top_k[i], u[i] = 0.0, 1.0, 0, 0.0
        lps = [r.params.top_logprobs for r in rows if r.params.logprobs and r.decided]
        return SamplingPlan(tuple(rows), any_draw, max_k, any_p, bool(lps), max(lps, default=0))

    def sample(self, logits: torch.Tensor, plan: SamplingPlan, dev
               ) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits [R, V] float32 -> a token per row and, where asked, its logprob. One host
        transfer."""
        r = logits.shape[0]
        packed = sample_tensors(logits, dev["temperature"][:r], dev["top_p"][:r],
                                dev["top_k"][:r], dev["uniform"][:r], plan).tolist()
        tokens, logprobs = [], []
        n = plan.max_top_logprobs
        for row, vals in zip(plan.rows, packed):
            tok = int(vals[0])
            tokens.append(tok)
            p = row.params
            if p.logprobs and row.decided:
                k = p.top_logprobs
                top = [(int(vals[2 + j]), vals[2 + n + j]) for j in range(k)]
                logprobs.append(TokenLogprob(tok, vals[1], top))
            else:
                logprobs.append(None)
        return tokens, logprobs


def sample_tensors(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                   top_k: torch.Tensor, u: torch.Tensor, plan: SamplingPlan) -> torch.Tensor:
    """The batched sampler. logits [R, V] f32; per row: temperature (0: argmax), top_p, top_k,
    u [R] f64. Returns [R, 2 + 2n] f64: token, its logprob, n top ids, n top logprobs."""
    tok = logits.argmax(-1)                                              # [R]
    if plan.any_drawn:
        v = logits.shape[-1]
        drawn = temperature > 0
        x = logits / torch.where(drawn, temperature, 1.0)[:, None]       # [R, V]
        if plan.max_top_k:
            k = top_k.clamp(max=v).long()                                # 0: off
            vals = x.topk(min(plan.max_top_k, v), dim=-1).values         # [R, max_k]
            kth = vals.gather(1, (k - 1).clamp(min=0, max=vals.shape[1] - 1)[:, None])
            x = x.masked_fill((k[:, None] > 0) & (k[:, None] < v) & (x < kth), float("-inf"))
        if plan.any_top_p:
            sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
            probs = sorted_x.softmax(-1)
            drop = ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]
            x = x.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        cdf = x.softmax(-1).to(torch.float64).cumsum(-1)                 # [R, V]
        total = cdf[:, -1:].contiguous()
        i = torch.searchsorted(cdf, u[:, None] * total, right=True)     # [R, 1]
        last = torch.searchsorted(cdf, total, right=False)               # last token with mass
        i = torch.where(i >= v, last, i).squeeze(1)
        tok = torch.where(drawn, i, tok)
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


def sample(logits: torch.Tensor, params: list[SamplingParams], indices: list[int]
           ) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits [B, V] float32, one row per request -> token ids and (when asked) logprobs."""
    sampler = Sampler()
    host = {name: torch.zeros(n, dtype=dt).numpy()
            for name, n, dt in sampler.regions(len(params))}
    plan = sampler.stage([RowSampling(p, i) for p, i in zip(params, indices)], host)
    dev = {k: torch.from_numpy(a).to(logits.device) for k, a in host.items()}
    return sampler.sample(logits, plan, dev)
