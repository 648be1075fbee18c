"""Sampling: greedy, temperature, top-k, top-p, seeded, with logprobs.

Randomness is a pure function of (seed, index of the token in the output): token i of a
request draws its noise from a generator seeded with both. The same request therefore gives the
same tokens whichever worker samples it, whatever else shares its batch, and after preemption.
"""

from __future__ import annotations

import torch

from engine.request import SamplingParams, TokenLogprob

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant spreading (seed, index) over the generator space


def token_seed(seed: int, index: int) -> int:
    return (seed * _MIX + index * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] with entries outside top-k / the top-p nucleus set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sample_one(logits: torch.Tensor, p: SamplingParams, index: int) -> int:
    """logits [V] float32 -> token id. `index` is the position of the token in the output."""
    if p.greedy:
        return int(torch.argmax(logits))
    return draw(sampling_probs(logits, p), generator(p.seed, index, logits.device))


def sampling_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> the distribution sampled from (temperature, top-k, top-p applied)."""
    return _filter(logits / p.temperature, p.top_k, p.top_p).softmax(-1)


def generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    """The generator output token `index` of a request with `seed` draws from."""
    return torch.Generator(device=device).manual_seed(token_seed(seed, index))


def draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One token from `probs` [V] (non-negative, any positive total): the inverse of its CDF at
    one uniform draw. The CDF is summed in float64, so each token keeps its probability to
    ~1e-16; one random number per token instead of one per vocabulary entry (an exponential
    race over 49,152 entries took 1 ms a row, most of a 32-sequence sampled step's sampling)."""
    cdf = probs.to(torch.float64).cumsum(-1)
    u = torch.rand(1, generator=gen, dtype=torch.float64, device=probs.device) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))    # the first token whose CDF exceeds u
    if i >= cdf.numel():                                # u rounded up to the total
        i = int(torch.nonzero(probs).max())
    return i


def token_logprob(logits: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    """Logprob of `token` and the top_n alternatives under the model's raw distribution."""
    lp = logits.log_softmax(-1)
    top: list[tuple[int, float]] = []
    if top_n:
        vals, ids = torch.topk(lp, top_n)
        top = list(zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(token, float(lp[token]), top)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           indices: list[int]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits [B, V] float32; one row per request -> token ids and (when asked) logprobs."""
    greedy_ids = torch.argmax(logits, dim=-1).tolist()
    tokens, logprobs = [], []
    for row, (p, idx) in enumerate(zip(params, indices)):
        tok = greedy_ids[row] if p.greedy else sample_one(logits[row], p, idx)
        tokens.append(tok)
        logprobs.append(token_logprob(logits[row], tok, p.top_logprobs) if p.logprobs else None)
    return tokens, logprobs
