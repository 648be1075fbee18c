"""Verification of proposed tokens against the target model's logits.

logits[i] (i = 0..k) are the target's logits after the request's tokens plus the first i
proposals. Greedy: proposals are kept while each equals the target's argmax; the first mismatch
is replaced by the argmax, and when all k match, the argmax after the last one is added (the
"bonus" token). The result is exactly plain greedy decoding.

Temperature > 0: rejection sampling. Proposal x_i drawn from q_i is accepted with probability
min(1, p_i(x_i) / q_i(x_i)), where p_i is the target's distribution after temperature, top-k and
top-p (the same processing as engine.sampler); on rejection the token is drawn from
max(p_i - q_i, 0), renormalized, and verification stops; when all are accepted the bonus token
is drawn from p_k. Every emitted token is then distributed exactly as the target model's. An
n-gram proposal is a point mass: q_i(x_i) = 1, and the residual is p_i without x_i.

Randomness: output token j of a request draws from a generator seeded with (seed, j), as in
engine.sampler, so a seeded request repeats itself for the same proposals.
"""

from __future__ import annotations

import torch

from engine.request import SamplingParams, TokenLogprob
from engine.sampler import draw, generator, sampling_probs, token_logprob


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[n, V] logits -> [n, V] sampling distributions (temperature, top-k, top-p applied)."""
    return torch.stack([sampling_probs(row, p) for row in logits])


def rejection_sample(probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
                     seed: int, index: int) -> list[int]:
    """probs [k + 1, V] (target), draft k tokens, draft_probs [k, V] or None (point masses).
    Returns the accepted proposals plus one token drawn by the target (1..k + 1 tokens)."""
    out: list[int] = []
    for i, x in enumerate(draft):
        gen = generator(seed, index + i, probs.device)
        p = probs[i]
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        u = float(torch.rand((), generator=gen, device=probs.device))
        if q_x > 0 and u * q_x < float(p[x]):      # u < p(x) / q(x)
            out.append(x)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:           # p == q: rejection has probability 0
            residual = p
        out.append(draw(residual / residual.sum(), gen))
        return out
    out.append(draw(probs[len(draft)], generator(seed, index + len(draft), probs.device)))
    return out


def verify(logits: torch.Tensor, params: SamplingParams, index: int, draft: list[int],
           draft_probs: torch.Tensor | None = None
           ) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits [k + 1, V] float32 of one request; `index`: its number of output tokens so far.
    Returns the tokens to append (accepted proposals + one) and their logprobs (when asked)."""
    if params.greedy:
        target = torch.argmax(logits, dim=-1).tolist()
        n = 0
        while n < len(draft) and draft[n] == target[n]:
            n += 1
        tokens = draft[:n] + [target[n]]
    else:
        tokens = rejection_sample(target_probs(logits, params), draft, draft_probs,
                                  params.seed, index)
    if not params.logprobs:
        return tokens, [None] * len(tokens)
    return tokens, [token_logprob(logits[i], t, params.top_logprobs) for i, t in enumerate(tokens)]
