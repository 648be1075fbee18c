"""Beam search on the decode worker: HF's algorithm (transformers' `generate(num_beams=...)`,
as vLLM's original engine defined `use_beam_search`, `length_penalty` and `early_stopping`),
one BeamGroup per request, its beams ordinary sequences of the continuous batch.

Each step every running beam computes its last token; its row's top 2 x width logprobs (the
model's raw distribution) are the beam's candidates. Once every beam of the group has its
candidates, `select` ranks all of them by cumulative logprob and keeps the best 2 x width:
those that end a sequence (an EOS token, or max_tokens reached) and rank within the first
`width` become finished hypotheses, scored cumulative logprob / generated length **
length_penalty (EOS counted), the best `width` kept; the best `width` that do not end one are
the next step's beams. A beam chosen by several candidates is forked (its full blocks shared,
its partial block copied, as for n > 1); a beam chosen by none ends. The search stops when all
candidates end sequences, or, once `width` hypotheses are finished: at once with
early_stopping true; with false (the default) when the best running beam, scored at its
present length, cannot beat the worst finished one; with "never" when it could not at any
length up to max_tokens (length_penalty > 0) or at the present one. The request's `width`
choices are the finished hypotheses, best first.

Deterministic: no temperature, top-p/top-k or seed applies (the gateway refuses them), as in
vLLM, whose beam search ranks raw logprobs too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EARLY_STOPPING = (False, True, "never")


def candidates_per_beam(width: int) -> int:
    """Candidates a beam's row gives each step (and the group keeps): 2 x width, as HF keeps
    for one EOS token, so `width` beams go on even when the best `width` all end."""
    return 2 * width


@dataclass
class Hypothesis:
    score: float                 # cumulative logprob / generated length ** length_penalty
    token_ids: list[int]         # the whole output, its last token included (EOS too)
    finish_reason: str           # "stop" (EOS) or "length"


@dataclass(frozen=True)
class Continuation:
    """One of the next step's beams: `parent` (a running beam's id) extended by `token`."""

    parent: str
    token: int
    score: float                 # cumulative logprob of the output with `token`


@dataclass
class BeamGroup:
    """The search of one request. `eos`: the token ids that end a sequence (none when the
    request ignores EOS); `max_tokens`: the output's length limit (max_tokens, or what the
    context leaves, whichever is less)."""

    width: int
    length_penalty: float
    early_stopping: bool | str
    eos: frozenset[int]
    max_tokens: int
    scores: dict[str, float] = field(default_factory=dict)       # running beam -> cumulative
    outputs: dict[str, list[int]] = field(default_factory=dict)  # running beam -> its output
    finished: list[Hypothesis] = field(default_factory=list)     # best first, <= width
    improvable: bool = True      # HF's early-stop heuristic not yet satisfied
    done: bool = False
    members: dict = field(default_factory=dict)     # running beam id -> the engine's Request
    forks: int = 0               # beams forked so far (their ids' numbers)
    prompt_logprobs: list | None = None             # the request's, for its first output
    _candidates: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.early_stopping not in EARLY_STOPPING:
            raise ValueError(f"early_stopping must be true, false or 'never', got "
                             f"{self.early_stopping!r}")

    def start(self, beam: str, output: list[int]) -> None:
        """The first beam: the request itself, its output so far (empty)."""
        self.scores[beam] = 0.0
        self.outputs[beam] = list(output)

    def observe(self, beam: str, top: list[tuple[int, float]]) -> bool:
        """Beam `beam`'s candidates this step ((token, logprob), best first); True once every
        running beam has given its own (select may run)."""
        self._candidates[beam] = list(top)
        return all(b in self._candidates for b in self.scores)

    def select(self) -> list[Continuation]:
        """The step: finished hypotheses updated, the next beams returned (none when the
        search is done; `done` says so)."""
        ranked = sorted(((self.scores[b] + lp, b, tok)
                         for b, top in self._candidates.items() if b in self.scores
                         for tok, lp in top), key=lambda c: -c[0])
        ranked = ranked[:candidates_per_beam(self.width)]
        self._candidates.clear()
        length = len(next(iter(self.outputs.values()))) + 1     # generated, with the new token
        ends = [tok in self.eos or length >= self.max_tokens for _, _, tok in ranked]
        if self.improvable and not (len(self.finished) >= self.width
                                    and self.early_stopping is True):
            for rank, ((score, beam, tok), end) in enumerate(zip(ranked, ends)):
                if end and rank < self.width:
                    reason = "stop" if tok in self.eos else "length"
                    self.finished.append(Hypothesis(score / length ** self.length_penalty,
                                                    self.outputs[beam] + [tok], reason))
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[self.width:]
        going = [Continuation(b, tok, s) for (s, b, tok), end in zip(ranked, ends)
                 if not end][:self.width]
        if going and len(self.finished) >= self.width:
            if self.early_stopping == "never" and self.length_penalty > 0:
                best_length = self.max_tokens
            else:
                best_length = length
            best = going[0].score / best_length ** self.length_penalty
            self.improvable = self.improvable and best > self.finished[-1].score
        self.done = (not going or not self.improvable
                     or (len(self.finished) >= self.width and self.early_stopping is True))
        if self.done:
            return []
        self.scores, self.outputs = {}, {}
        return going

    def adopt(self, beam: str, cont: Continuation, output_before: list[int]) -> None:
        """`beam` (the parent itself or a fork of it) runs `cont` next."""
        self.scores[beam] = cont.score
        self.outputs[beam] = list(output_before) + [cont.token]

    def results(self) -> list[Hypothesis]:
        """The request's choices, best first."""
        return list(self.finished)
