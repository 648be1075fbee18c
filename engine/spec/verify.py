"""Verification of proposed tokens against the target model's logits.

logits[i] (i = 0..k) are the target's logits after the request's tokens plus the first i
proposals. Greedy (`accept_greedy`): proposals are kept while each equals the target's argmax;
the first mismatch is replaced by the argmax, and when all k match, the argmax after the last
one is added (the "bonus" token). The result is exactly plain greedy decoding. The argmaxes come
from the step's batched sampler, with every other row's token, in one transfer.

Temperature > 0, a point-mass proposal (the n-gram proposer; `accept_greedy` over the drawn
rows): each verification row draws the target's own token at engine.sampler.uniform(seed, j)
(output index j, stream 0), exactly as plain sampling would at that index, and the proposals
are kept while they equal those draws. Accepting x with probability p(x) is what rejection
sampling of a point mass gives, so nothing is lost, and the output is token for token the
output without speculation: a seeded request repeats itself whatever was proposed. The draws
come from the step's batched sampler with every other row's, in one transfer.

Temperature > 0, a draft model's proposals x_i drawn from q_i (`verify`, rejection sampling):
x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), where p_i is the target's
distribution after logits processing (penalties, bias, bans, grammar masks, each row as if the
proposals before it were accepted), temperature, min-p, top-k and top-p (the same processing as
engine.sampler); on rejection the token is drawn from max(p_i - q_i, 0), renormalized, and
verification stops; when all are accepted the bonus token is drawn from p_k. Every emitted
token is then distributed exactly as the target model's. Output token j draws at
uniform(seed, j) (stream 0) and tests acceptance at stream 1: a seeded request repeats itself
for the same proposals.
"""

from __future__ import annotations

import torch

from engine.request import SamplingParams, TokenLogprob
from engine.sampler import draw, sampling_probs, token_logprob, uniform


def accept_greedy(draft: list[int], targets: list[int]) -> list[int]:
    """targets: the argmax after each proposal prefix (len(draft) + 1). Returns the tokens to
    append: the proposals that match, then the target's own."""
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return draft[:n] + [targets[n]]


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[n, V] logits -> [n, V] sampling distributions (temperature, top-k, top-p applied)."""
    return torch.stack([sampling_probs(row, p) for row in logits])


def rejection_sample(probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
                     seed: int, index: int) -> list[int]:
    """probs [k + 1, V] (target), draft k tokens, draft_probs [k, V] or None (point masses).
    Returns the accepted proposals plus one token drawn by the target (1..k + 1 tokens)."""
    out: list[int] = []
    if draft_probs is None:              # point masses: the target's own draws, compared
        for i, x in enumerate(draft):
            t = draw(probs[i], uniform(seed, index + i))
            out.append(t)
            if t != x:
                return out
        out.append(draw(probs[len(draft)], uniform(seed, index + len(draft))))
        return out
    for i, x in enumerate(draft):
        p = probs[i]
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if q_x > 0 and uniform(seed, index + i, 1) * q_x < float(p[x]):   # u < p(x) / q(x)
            out.append(x)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:           # p == q: rejection has probability 0
            residual = p
        out.append(draw(residual, uniform(seed, index + i)))
        return out
    out.append(draw(probs[len(draft)], uniform(seed, index + len(draft))))
    return out


def verify(logits: torch.Tensor, params: SamplingParams, index: int, draft: list[int],
           draft_probs: torch.Tensor | None = None, processed: torch.Tensor | None = None
           ) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits [k + 1, V] float32 of one request (raw: logprobs are theirs); `processed`: the
    same rows after logits processing (penalties, bias, bans, grammar; each row following the
    proposals before it), which p is taken from (default: the logits); `index`: its number of
    output tokens so far. Returns the tokens to append (accepted proposals + one) and their
    logprobs (when asked)."""
    x = logits if processed is None else processed
    if params.greedy:
        tokens = accept_greedy(draft, torch.argmax(x, dim=-1).tolist())
    else:
        tokens = rejection_sample(target_probs(x, params), draft, draft_probs,
                                  params.seed, index)
    if not params.logprobs:
        return tokens, [None] * len(tokens)
    return tokens, [token_logprob(logits[i], t, params.top_logprobs) for i, t in enumerate(tokens)]
