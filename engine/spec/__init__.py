"""Speculative decoding on the decode worker: guess several tokens, verify them in one pass.

Each step, before scheduling, the engine asks a proposer for up to k tokens per decoding
sequence (engine.spec.proposers: n-gram prompt lookup, or a smaller draft model), and the
controller (engine.spec.controller) decides how many of them are worth verifying: per sequence
from its recent acceptance, and for the batch from the measured cost of a step's tokens, so
speculation fades out when the batch is large enough that verifying costs more than it saves.

A sequence with k proposed tokens is scheduled with 1 + k new tokens (its last sampled token and
the proposals) inside the same continuous batch as everything else; the forward pass returns
logits at all 1 + k positions and engine.spec.verify keeps the longest accepted prefix plus one
token from the target model: identical to plain decoding when greedy, and, with temperature > 0,
rejection sampling that makes the output distribution exactly the target's. KV written for
rejected positions is simply overwritten later: the request's num_computed_tokens only counts
accepted tokens (the catch-up rule of engine.scheduler).
"""

from engine.spec.controller import SpecController
from engine.spec.proposers import DraftProposer, NgramProposer, Proposal, Proposer
from engine.spec.verify import verify

__all__ = ["SpecController", "DraftProposer", "NgramProposer", "Proposal", "Proposer",
           "verify"]
