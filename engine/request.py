"""Per-request token state. A Request owns its tokens and progress; managers own resources."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import engine.sampling_limits as limits


class Status(enum.Enum):
    WAITING = "waiting"                          # queued for (re)computation
    WAITING_FOR_REMOTE_KV = "waiting_remote_kv"  # decode: blocks reserved, KV not arrived yet
    RUNNING = "running"
    FINISHED = "finished"


MAX_CHOICES = limits.MAX_CHOICES


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a request seeded `seed` (choice 0 keeps it): each choice
    draws its own stream, and a seeded n > 1 request repeats itself."""
    if choice == 0:
        return seed
    z = (seed + choice * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) % (1 << 63)


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling settings. temperature 0 is greedy; top_k 0, top_p 1, min_p 0,
    penalties 0 (repetition 1) are off.

    Logits are processed before the token is chosen (greedy or drawn), in this order:
    logit_bias added; tokens the grammar (`structured`) forbids and, while fewer than
    min_tokens are out, EOS and stop_token_ids removed (unless the grammar allows nothing but
    its end: a complete structure ends the output, min_tokens or not); repetition_penalty on every token seen
    in the prompt or output (positive logits divided, negative multiplied), frequency_penalty x
    count and presence_penalty once for each token in the output subtracted; then temperature,
    min_p, top_k, top_p. Logprobs are of the model's raw distribution.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_tokens: int = 16
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1                           # choices of one prompt (decode workers fork them)
    structured: object | None = None     # engine.structured.StructuredSpec, or None
    # the prompt's logprobs (None: not computed): each prompt token after the first under the
    # model's distribution there, its rank, and this many top alternatives (0: none). Computed
    # from the logits of the forward pass that computes the prompt, so a request asking for
    # them does not read the prefix cache (a cached block has no logits)
    prompt_logprobs: int | None = None
    # beam search of this width (0: none; engine.beam_search): n is the width, and the request's
    # choices are the best finished beams; scored by cumulative logprob / length **
    # length_penalty, stopped as early_stopping says (False, True or "never", HF's)
    beam_width: int = 0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        for name, allowed in (("temperature", limits.TEMPERATURE), ("top_p", limits.TOP_P),
                              ("min_p", limits.MIN_P),
                              ("presence_penalty", limits.PRESENCE_PENALTY),
                              ("frequency_penalty", limits.FREQUENCY_PENALTY),
                              ("repetition_penalty", limits.REPETITION_PENALTY)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be in {allowed}, got {getattr(self, name)}")
        if any(b not in limits.LOGIT_BIAS for _, b in self.logit_bias):
            raise ValueError(f"logit_bias values must be in {limits.LOGIT_BIAS}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.top_logprobs <= limits.MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {limits.MAX_TOP_LOGPROBS}], got "
                             f"{self.top_logprobs}")
        if self.prompt_logprobs is not None and \
                not 0 <= self.prompt_logprobs <= limits.MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {limits.MAX_TOP_LOGPROBS}], got "
                             f"{self.prompt_logprobs}")
        if self.beam_width:
            if self.beam_width != self.n:
                raise ValueError(f"beam search: n is the beam width, got n={self.n} and "
                                 f"beam_width={self.beam_width}")
            if not math.isfinite(self.length_penalty):
                raise ValueError(f"length_penalty must be finite, got {self.length_penalty}")
            if self.early_stopping not in (False, True, "never"):
                raise ValueError(f"early_stopping must be true, false or 'never', got "
                                 f"{self.early_stopping!r}")
            if self.structured is not None or self.processed or not self.greedy:
                raise ValueError("beam search ranks the raw logprobs: no temperature, "
                                 "penalties, logit_bias, min_tokens or structured output")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got "
                             f"{self.min_tokens}")
        if not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        """The sampled rows report logprobs: asked for, or the candidates of a beam search."""
        return self.logprobs or self.beam_width > 0

    @property
    def num_top_logprobs(self) -> int:
        """Alternatives a sampled row reports: top_logprobs, or a beam's candidates."""
        return max(self.top_logprobs, 2 * self.beam_width)

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def processed(self) -> bool:
        """Logits are changed before the choice (bias, bans, grammar, penalties)."""
        return bool(self.logit_bias or self.min_tokens or self.penalized
                    or self.structured is not None)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)   # best first: ranks 1, 2, ..
    rank: int | None = None     # token_id's rank in the distribution (1: the most likely);
    #                             set for prompt logprobs


@dataclass
class Timeline:
    """When things happened to one request in the engine (epoch ns, time.time_ns; 0: not yet),
    for its trace and its timing block. Recorded only for a request whose `timeline` is set
    (traced, or timing asked for): the engine then does this bookkeeping for it once per step it
    is in; a request without one costs nothing.

    `chunks`: (step start, step end, prompt tokens computed) of each step that computed prompt
    tokens (chunked prefill, a recompute after preemption); steps that only sampled count in
    `decode_steps`."""

    arrived_ns: int                       # handed to the engine (add, reserve)
    reserved_ns: int = 0                  # decode: blocks reserved for the prompt's KV
    loaded_ns: int = 0                    # decode: the prompt's KV and first token arrived
    scheduled_ns: int = 0                 # the first step that computed any of it
    first_token_ns: int = 0
    finished_ns: int = 0
    chunks: list[tuple[int, int, int]] = field(default_factory=list)
    preempted_ns: list[int] = field(default_factory=list)
    decode_steps: int = 0
    output_tokens: int = 0
    spec_proposed: int = 0                # speculative tokens verified for it, and accepted
    spec_accepted: int = 0


@dataclass
class Request:
    """Token state of one sequence.

    Invariant: tokens [0, num_computed_tokens) have their KV in this request's blocks. Each step
    the scheduler advances num_computed_tokens toward num_tokens (the catch-up rule); when it
    reaches num_tokens, the step's logits sample the next token.

    A request may start with output tokens (resumed: the stream of a worker that failed goes on
    here). They count as output in every respect (sampling index, penalties, min_tokens,
    max_tokens, the grammar state) and their KV is computed like the prompt's, as after a
    preemption, so the request continues exactly as it would have on the first worker.
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
    kv_tokens: int = 0                    # prefill: tokens whose KV the transfer moves
    kv_cached_entries: int = 0            # decode: leading transfer entries cached here
    lora_name: str = ""                   # the LoRA adapter asked for ("": the base model)
    lora: object = None                   # that adapter (engine.lora.adapter), at admission
    long_rope: bool = False               # LongRoPE: longer than the original context when
    #                                       admitted (every position's long factors)
    spec_token_ids: list[int] = field(default_factory=list)  # proposals verified this step
    # n > 1: choice 0 is the request itself; choices 1.. are forked from it once its prompt is
    # computed (engine.scheduler), sharing the prompt's full blocks. `group` is the id of the
    # request a choice belongs to ("" for the request itself), whose stream gets its outputs.
    choice: int = 0
    group: str = ""
    forked: bool = False
    # engine.structured.GrammarMatcher of the output so far (params.structured set; the worker
    # compiles the grammar and sets it before the request reaches the engine)
    structured_state: object | None = None
    timeline: Timeline | None = None      # set by the worker for a traced / timed request
    beam_group: object | None = None      # engine.beam_search.BeamGroup of a beam search
    # params.prompt_logprobs set: one entry per prompt token computed so far, the first None
    # (nothing precedes it); complete once the first output token is sampled
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        if self.output_token_ids:        # resumed: a stream moved from a worker that failed
            if self.params.n > 1:
                raise ValueError(f"request {self.request_id}: a request of n > 1 cannot "
                                 "resume on another worker")
            if len(self.output_token_ids) >= self.params.max_tokens:
                raise ValueError(f"request {self.request_id}: {len(self.output_token_ids)} "
                                 f"resume tokens leave nothing of max_tokens "
                                 f"{self.params.max_tokens}")

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

    @property
    def stream_id(self) -> str:
        return self.group or self.request_id

    def append_token(self, token_id: int, logprob: TokenLogprob | None) -> bool:
        """Append one output token; False (nothing appended) when the grammar refuses it."""
        if self.structured_state is not None and not self.structured_state.accept(token_id):
            return False
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        return True


@dataclass
class RequestOutput:
    """What one step produced for one request: new tokens, and the finish reason if done."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob]
    finish_reason: str | None = None      # "stop" (EOS), "length", "prefilled", "abort", "error"
    error: str | None = None
    # Prefill role: blocks whose KV became final this step, in prompt order (once finished: all
    # the rest, the partial last block too). The connector holds a reference on each for the
    # transfer until Engine.save_done(request_id) (engine.kv_connector).
    kv_blocks: list[int] | None = None
    # With kv_blocks on a GPU: an event (torch.cuda.Event: query(), synchronize()) recorded after
    # the step that wrote them; their KV is final once it has completed on the device. None when
    # it is final already (CPUs). Stream-ordered copies need not wait; one-sided writes must.
    kv_ready: object | None = None
    choice: int = 0                       # which choice of an n > 1 request
    group: str = ""                       # the id whose stream gets this output ("": request_id)
    # with the first token of a request asking for them: the prompt's logprobs (first None)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stream_id(self) -> str:
        return self.group or self.request_id
