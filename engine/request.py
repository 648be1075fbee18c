"""Per-request token state. A Request owns its tokens and progress; managers own resources."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Status(enum.Enum):
    WAITING = "waiting"                          # queued for (re)computation
    WAITING_FOR_REMOTE_KV = "waiting_remote_kv"  # decode: blocks reserved, KV not arrived yet
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling settings. temperature 0 is greedy; top_k 0 and top_p 1 are off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_tokens: int = 16
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Request:
    """Token state of one sequence.

    Invariant: tokens [0, num_computed_tokens) have their KV in this request's blocks. Each step
    the scheduler advances num_computed_tokens toward num_tokens (the catch-up rule); when it
    reaches num_tokens, the step's logits sample the next token.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    arrival: int = 0                      # admission order, for FIFO and preemption
    num_preemptions: int = 0
    cache_salt: str = ""                  # requests share cached blocks only with equal salts
    block_hashes: list[int] = field(default_factory=list)   # of full blocks (engine.block_hash)
    num_cached_blocks: int = 0            # leading blocks registered in the prefix cache
    num_cached_tokens: int = 0            # prompt tokens found in the prefix cache at admission
    num_blocks_streamed: int = 0          # prefill: leading blocks handed out for transfer
    spec_token_ids: list[int] = field(default_factory=list)  # proposals verified this step

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def token_ids_between(self, start: int, end: int, with_spec: bool = False) -> list[int]:
        """Tokens [start, end) of prompt + output (+ this step's proposals), without building
        the whole sequence (a decode step needs its last token only)."""
        p = len(self.prompt_token_ids)
        out = self.prompt_token_ids[start:end] if start < p else []
        if end > p:
            tail = self.output_token_ids + self.spec_token_ids if with_spec \
                else self.output_token_ids
            out = out + tail[max(start - p, 0):end - p]
        return out

    def append_token(self, token_id: int, logprob: TokenLogprob | None) -> None:
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)


@dataclass
class RequestOutput:
    """What one step produced for one request: new tokens, and the finish reason if done."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob]
    finish_reason: str | None = None      # "stop" (EOS), "length", "prefilled", "abort", "error"
    error: str | None = None
    # Prefill role: blocks whose KV became final this step, in prompt order (once finished: all
    # the rest, the partial last block too). Each carries one extra reference for the transfer,
    # which the receiver of this output gives back (Engine.unpin) once the blocks are sent.
    kv_blocks: list[int] | None = None
    # With kv_blocks on a GPU: an event (torch.cuda.Event: query(), synchronize()) recorded after
    # the step that wrote them; their KV is final once it has completed on the device. None when
    # it is final already (CPUs). Stream-ordered copies need not wait; one-sided writes must.
    kv_ready: object | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
