"""The ranges of the sampling parameters, defined once.

Each process checks a request at its own door against these: the gateway a client's request
(gateway/params.py, with the field's name in a 400), the engine a worker's request off the wire
(engine/request.py, reached through serving/params.py, as an INVALID_ARGUMENT). A range changes
here and nowhere else. Standard library only: the torch-free gateway imports it, as it does
engine/block_hash.py."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """A closed range of floats, or one open at its low end; only finite values are inside."""

    lo: float
    hi: float
    open_low: bool = False

    def __contains__(self, value: float) -> bool:
        if not math.isfinite(value) or value > self.hi:
            return False
        return value > self.lo if self.open_low else value >= self.lo

    def __str__(self) -> str:
        return f"({self.lo:g}, {self.hi:g}]" if self.open_low else f"[{self.lo:g}, {self.hi:g}]"


TEMPERATURE = Range(0.0, 2.0)
TOP_P = Range(0.0, 1.0, open_low=True)
MIN_P = Range(0.0, 1.0)
PRESENCE_PENALTY = Range(-2.0, 2.0)
FREQUENCY_PENALTY = Range(-2.0, 2.0)
REPETITION_PENALTY = Range(0.0, 2.0, open_low=True)
LOGIT_BIAS = Range(-100.0, 100.0)        # each biased token's value
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16                         # n of one request, at most
# a beam search's early_stopping as the wire spells it (SamplingParams.early_stopping) -> HF's
EARLY_STOPPING = {"": False, "false": False, "true": True, "never": "never"}
