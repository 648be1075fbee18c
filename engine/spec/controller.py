"""How many proposed tokens each sequence verifies this step.

Two estimates drive it:
  * the probability that a proposed token is accepted, alpha: a decayed count of accepted and
    rejected proposals with a prior of `prior` worth `prior_weight` proposals (so a newcomer
    tries). It is kept per sequence (each step's counts weigh `decay` times the last's) for
    proposals with no kind, and per kind across sequences (`kind_decay`) for proposals that say
    what kind they are (the n-gram proposer: the length of the match they come from, which
    predicts acceptance far better than the sequence's own history). The j-th proposal of a
    step is only kept if the j - 1 before it are, so it is worth alpha**j tokens;
  * per step, the cost of its tokens: time = a + b * T + e * S, fitted by least squares over
    recent steps, where T is the step's tokens and S the sequences that verify proposals (a
    sequence's first proposal costs more than its later ones: a query of two rows instead of
    one, a GEMM instead of a GEMV on small batches), plus the draft model's cost per proposed
    token if there is one.

Tokens are granted one at a time, the most valuable first, while they raise the step's expected
throughput: with G expected tokens out of a step taking t, one more proposal worth m costing c
(b, plus e for a sequence's first) is kept when (G + m) / (t + c) > G / t, i.e. m * t > G * c.
With few sequences a step's cost is mostly fixed (weights are read once whatever T is), so even
modest acceptance pays; with many, each token costs nearly its share and speculation backs off
by itself. A sequence (or kind) offered but left at zero for `probe_after` steps is granted one
token, so a change in its acceptance is noticed. `disable_batch_size` (if > 0) switches
speculation off while more sequences than that decode.

Throughput alone would let a step grow without bound while its sequences accept: at 16
sequences each verifying 16 proposals a step is 272 tokens instead of 16. A sequence whose
proposals fail rides in those steps and gets one token from each, so its time per token grows
with the others' luck (at 16 concurrent on 2 cores, no bound: 191 ms per token for a sequence
that accepted 13 of its 41 proposals, 51 ms for the median request; docs/performance.md,
"N-gram speculation by default"). `max_step_growth` bounds that: a step's expected time may
grow by at most that share over the same step without proposals, a + b * (sequences + other
tokens), and so may no sequence's expected time per token (0: no bound). A step of one
sequence and no prompt tokens is not bounded: there is nobody else to wait.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import torch


@dataclass
class _Acceptance:
    accepted: float = 0.0
    trials: float = 0.0
    idle_steps: int = 0


class SpecController:
    def __init__(self, max_tokens: int, disable_batch_size: int = 0, prior: float = 0.6,
                 decay: float = 0.8, probe_after: int = 16, window: int = 64,
                 prior_weight: float = 0.5, kind_decay: float = 0.95,
                 max_step_growth: float = 0.0) -> None:
        self.max_tokens = max_tokens
        self.max_step_growth = max_step_growth
        self.disable_batch_size = disable_batch_size
        self.prior, self.decay, self.probe_after = prior, decay, probe_after
        self.prior_weight, self.kind_decay = prior_weight, kind_decay
        self._seqs: dict[str, _Acceptance] = {}
        self._kinds: dict[int, _Acceptance] = {}
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._draft_cost = 0.0           # seconds per proposed token (draft model), EMA

    # ------------------------------------------------------------------ estimates
    def _stats(self, request_id: str, kind: int) -> _Acceptance:
        if kind:
            return self._kinds.setdefault(kind, _Acceptance())
        return self._seqs.setdefault(request_id, _Acceptance())

    def alpha(self, request_id: str, kind: int = 0) -> float:
        s = self._kinds.get(kind) if kind else self._seqs.get(request_id)
        if s is None:
            return self.prior
        w = self.prior_weight
        return min((s.accepted + self.prior * w) / (s.trials + w), 0.99)

    def cost_model(self) -> tuple[float, float, float] | None:
        """(a, b, e) of time = a + b * T + e * S, or None while the steps seen cannot fit it
        (e is 0 until steps with and without proposals have both been seen)."""
        if len(self._steps) < 8:
            return None
        rows = torch.tensor(self._steps, dtype=torch.float64)
        tokens, spec, seconds = rows[:, 0], rows[:, 1], rows[:, 2]
        if float(tokens.var()) < 1e-9:
            return None
        both = bool((spec > 0).any() and (spec == 0).any())
        x = torch.stack([torch.ones_like(tokens), tokens] + ([spec] if both else []), dim=1)
        coef = torch.linalg.lstsq(x, seconds[:, None]).solution[:, 0].tolist()
        a, b, e = coef[0], coef[1], coef[2] if both else 0.0
        return max(a, 0.0), max(b, 1e-6), max(e, 0.0)

    # ------------------------------------------------------------------ feedback
    def observe_step(self, num_tokens: int, num_spec_seqs: int, seconds: float) -> None:
        if num_tokens > 0:
            self._steps.append((num_tokens, num_spec_seqs, seconds))

    def observe_draft(self, seconds: float, num_tokens: int) -> None:
        if num_tokens > 0:
            per = seconds / num_tokens
            self._draft_cost = per if not self._draft_cost else 0.8 * self._draft_cost + 0.2 * per

    def record(self, request_id: str, proposed: int, accepted: int, kind: int = 0) -> None:
        s = self._stats(request_id, kind)
        if proposed == 0:
            return
        decay = self.kind_decay if kind else self.decay
        s.accepted = decay * s.accepted + accepted
        s.trials = decay * s.trials + accepted + (1 if accepted < proposed else 0)

    def release(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)

    # ------------------------------------------------------------------ the decision
    def plan(self, request_ids: list[str], caps: list[int], other_tokens: int = 0,
             kinds: list[int] | None = None) -> list[int]:
        """Proposals to verify per decoding sequence (at most caps[i] each). `other_tokens`:
        tokens of the step that are not decodes (prompt chunks), when known; `kinds`: the
        kind of each sequence's proposal, when known before planning."""
        kinds = kinds or [0] * len(request_ids)
        ks = [0] * len(request_ids)
        n = len(request_ids)
        if n == 0 or (self.disable_batch_size and n > self.disable_batch_size):
            return ks
        model = self.cost_model()
        if model is None:                  # too little seen to judge: explore
            return [min(c, self.max_tokens) for c in caps]
        a, b, e = model
        c = b + self._draft_cost
        gain, time = float(n), a + b * (n + other_tokens)
        # the bound protects the others in the step: one sequence alone only gains
        shared = n > 1 or other_tokens > 0
        limit = (time * (1.0 + self.max_step_growth) if self.max_step_growth > 0 and shared
                 else float("inf"))
        alphas = [self.alpha(r, kd) for r, kd in zip(request_ids, kinds)]
        heap = [(-alphas[i], i) for i in range(n) if caps[i] > 0]
        heapq.heapify(heap)
        while heap:
            neg_m, i = heapq.heappop(heap)
            m = -neg_m
            cost = c + (e if ks[i] == 0 else 0.0)
            if m * time <= gain * cost or time + cost > limit:
                continue                    # not worth it or too long; cheaper ones may be
            ks[i] += 1
            gain, time = gain + m, time + cost
            if ks[i] < min(caps[i], self.max_tokens):
                heapq.heappush(heap, (-(m * alphas[i]), i))
        # Probes: counted in steps per estimate (a sequence's, or a kind's across all the
        # sequences offering it), so a kind offered by 32 sequences at once is not probed twice
        # a step: at a large batch of low acceptance that alone cost ~5% of the throughput.
        offers: dict[int, tuple[_Acceptance, list[int]]] = {}
        for i, rid in enumerate(request_ids):
            if caps[i] > 0:
                s = self._stats(rid, kinds[i])
                offers.setdefault(id(s), (s, []))[1].append(i)
        for s, idx in offers.values():
            if any(ks[i] for i in idx):
                s.idle_steps = 0
                continue
            s.idle_steps += 1
            if s.idle_steps >= self.probe_after:
                ks[idx[0]], s.idle_steps = 1, 0
        return ks
