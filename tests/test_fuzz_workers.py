"""Property tests of the worker RPCs with malformed and hostile messages, over real gRPC channels
to a real prefill and a real decode worker (the default model).

Hypothesis builds DecodeRequest, PrefillRequest, KVChunk streams and AbortRequest messages that
a confused or hostile peer could send: token ids past the vocabulary, zero or huge max_tokens
and n, empty and over-long prompts, NaN and infinite sampling values, grammars that do not
compile, KV destinations on closed loopback ports, blocks nobody reserved, duplicate ids, data
of the wrong size, `last` before any data, aborts of unknown ids, request ids with odd
characters. Every call must end within its deadline with a proper status (OK, or one that names
the caller's mistake: never UNKNOWN or INTERNAL, never a Python traceback); after every example
the worker answers Stats and its pool returns to all-free; at the end a valid request still
gives the tokens it gave before the fuzzing.

Bounded for CI: the workers serve a 128-token context, valid outputs are at most 3 tokens, and
each test runs a fixed number of derandomized examples, without shrinking a failing one.
"""

from __future__ import annotations

import itertools
import json
import math
import threading

import grpc
import pytest
from hypothesis import HealthCheck, Phase, event, given, note, settings
from hypothesis import strategies as st

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.stack import Stack, free_port, wait_until

pytestmark = pytest.mark.slow

CONTEXT = 128                # --max-model-len of both workers
BLOCK = 16                   # --block-size (the default)
DEADLINE_S = 30.0            # no call may take longer: a longer one is a hang
# What a worker may answer a caller's mistake with. ABORTED: the prefill worker's KV transfer
# failed (the destination is gone or refused it); DATA_LOSS: KV whose checksums do not match.
PROPER = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
          grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
          grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.ALREADY_EXISTS,
          grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED, grpc.StatusCode.DATA_LOSS}
# No shrinking: a failing example takes seconds (a deadline), and the notes show the messages.
FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def model(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    s = Stack(str(model_dir), tmp_path_factory.mktemp("fuzz-workers"))
    try:
        s.start_redis()
        flags = ("--max-model-len", str(CONTEXT), "--block-size", str(BLOCK))
        s.start_worker("prefill", *flags, name="prefill")
        s.start_worker("decode", *flags, name="decode")
        s.wait_healthy()
        yield s
    except BaseException:
        print(s.logs())
        raise
    finally:
        s.stop()


class Workers:
    """Stubs of both workers, and the checks every example ends with."""

    def __init__(self, stack: Stack, vocab: int) -> None:
        self.stack = stack
        self.vocab = vocab
        self.channels = [grpc.insecure_channel(p.address) for p in stack.procs[1:]]
        self.prefill = pb_grpc.PrefillWorkerStub(self.channels[0])
        self.decode = pb_grpc.DecodeWorkerStub(self.channels[1])
        self.decode_address = stack.procs[2].address
        self.ids = itertools.count()
        descriptor, call = self.reserve([1] * BLOCK)
        call.cancel()
        self.layout = descriptor.layout

    def unique_id(self, what: str) -> str:
        return f"fuzz-{what}-{next(self.ids)}"

    def close(self) -> None:
        for ch in self.channels:
            ch.close()

    def stats(self) -> list[pb.WorkerStats]:
        return [stub.Stats(pb.StatsRequest(), timeout=10) for stub in (self.prefill, self.decode)]

    def idle(self) -> bool:
        return all(s.running == 0 and s.waiting == 0 and s.free_blocks == s.total_blocks
                   for s in self.stats())

    def settle(self) -> None:
        """Both workers answer Stats and hold nothing: no request, every block free."""
        try:
            wait_until(self.idle, 15, "both workers idle with every block free")
        except TimeoutError:
            raise AssertionError(f"a request leaked: {self.stats()}") from None
        for p in self.stack.procs:
            assert p.alive(), f"{p.name} died:\n{p.log.read_text()[-3000:]}"

    def reserve(self, ids: list[int], request_id: str = "fuzz-reserved",
                params: pb.SamplingParams | None = None):
        """A Decode stream that has reserved blocks for IDS: (its descriptor, the call)."""
        params = params or pb.SamplingParams(max_tokens=2, ignore_eos=True)
        call = self.decode.Decode(pb.DecodeRequest(request_id=request_id,
                                                   prompt_token_ids=ids, params=params),
                                  timeout=DEADLINE_S)
        first = next(call)
        assert first.HasField("reservation"), first
        return first.reservation, call

    def disaggregated(self, ids: list[int], request_id: str) -> list[int]:
        """Tokens of IDS computed the way the gateway asks for them: Decode reserves, Prefill
        fills the reservation."""
        params = pb.SamplingParams(max_tokens=3, ignore_eos=True)
        descriptor, call = self.reserve(ids, request_id, params)
        self.prefill.Prefill(pb.PrefillRequest(request_id=request_id, prompt_token_ids=ids,
                                               params=params, destination=descriptor),
                             timeout=DEADLINE_S)
        return [t for ev in call for t in ev.tokens.token_ids]


@pytest.fixture(scope="module")
def workers(stack, model):
    w = Workers(stack, model["vocab_size"])
    yield w
    w.close()


@pytest.fixture(scope="module")
def before(workers) -> list[int]:
    """Tokens of a valid request before any fuzzing: the answer the workers must still give."""
    workers.settle()
    return workers.disaggregated(list(range(100, 140)), "fuzz-before")


def ended(fn, *args) -> tuple[grpc.StatusCode, str, object]:
    """(status, details, result) of a call (a result of None when it failed)."""
    try:
        return grpc.StatusCode.OK, "", fn(*args)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", None


def assert_proper(code: grpc.StatusCode, details: str, what: str) -> None:
    """A status that names the caller's mistake, in the worker's words, not a crash or hang."""
    assert code in PROPER, f"{what}: {code.name}: {details}"
    assert "Traceback" not in details and "Exception calling application" not in details, \
        f"{what}: {code.name}: {details}"


def read_decode(call) -> tuple[list[pb.DecodeEvent], grpc.StatusCode, str]:
    """The events of a Decode stream up to its first reservation (then it is cancelled: no KV
    will come) or its end."""
    events = []
    try:
        for ev in call:
            events.append(ev)
            if ev.HasField("reservation"):
                call.cancel()
                return events, grpc.StatusCode.OK, ""
        return events, grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return events, exc.code(), exc.details() or ""


# ----------------------------------------------------------------------------- strategies

def prompts(vocab: int) -> st.SearchStrategy[list[int]]:
    """Valid prompts, ones with an id past the vocabulary, empty ones, ones about the context
    long or longer."""
    valid = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40)
    poisoned = st.tuples(valid, st.sampled_from([vocab, 2 ** 31 - 1, 2 ** 32 - 1]),
                         st.integers(0, 40)).map(lambda t: t[0][:t[2]] + [t[1]] + t[0][t[2]:])
    long = st.lists(st.integers(0, vocab - 1), min_size=CONTEXT - 4, max_size=CONTEXT + 40)
    return st.one_of(valid, valid, valid, poisoned, st.just([]), long)


def few(names: list[str]) -> st.SearchStrategy[list[str]]:
    """None of NAMES half the time, else one or two of them: the parts an example breaks."""
    return st.one_of(st.just([]), st.lists(st.sampled_from(names), min_size=1, max_size=2))


ODD_FLOATS = st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0, 3.0, 1e30, math.nan, math.inf, -math.inf])
REQUEST_IDS = st.one_of(st.text(max_size=24), st.text(max_size=24), st.sampled_from(
    ["", "#", "a#1", "x" * 5000, "\x00", "\u202e", "../../etc"]))


@st.composite
def structured(draw) -> pb.StructuredOutput:
    kind = draw(st.sampled_from(["json_object", "json_schema", "regex", "choice", "grammar"]))
    if kind == "json_object":
        return pb.StructuredOutput(json_object=draw(st.booleans()))
    if kind == "choice":
        return pb.StructuredOutput(choice=pb.ChoiceList(
            choices=draw(st.lists(st.sampled_from(["", "yes", "no", "\x00"]), max_size=3))))
    garbage = {"json_schema": ["not json", "{\"type\": \"object\"}", "[]", "{\"type\": 7}"],
               "regex": ["(", "[a-z]{2}", "", "(a*)*b"],
               "grammar": ["root ::= ", "root ::= \"a\"", "not a grammar", ""]}[kind]
    return pb.StructuredOutput(**{kind: draw(st.sampled_from(garbage))})


# Per field of SamplingParams: a valid value (outputs of at most 3 tokens), and hostile ones.
def _fields(vocab: int) -> dict[str, tuple[st.SearchStrategy, st.SearchStrategy]]:
    bad_ids = st.lists(st.sampled_from([vocab, 2 ** 32 - 1]), min_size=1, max_size=2)
    return {
        "temperature": (st.sampled_from([0.0, 0.7]), ODD_FLOATS),
        "top_p": (st.sampled_from([0.0, 0.9, 1.0]), ODD_FLOATS),
        "min_p": (st.sampled_from([0.0, 0.1]), ODD_FLOATS),
        "top_k": (st.sampled_from([0, 5]), st.sampled_from([-1, -2 ** 31, 2 ** 31 - 1])),
        "max_tokens": (st.sampled_from([0, 1, 3]), st.sampled_from([CONTEXT, 2 ** 31,
                                                                    2 ** 32 - 1])),
        "n": (st.sampled_from([0, 1, 2]), st.sampled_from([17, 2 ** 32 - 1])),
        "min_tokens": (st.sampled_from([0, 1]), st.sampled_from([4, 10 ** 6, 2 ** 32 - 1])),
        "top_logprobs": (st.sampled_from([0, 2]), st.sampled_from([21, 2 ** 32 - 1])),
        "presence_penalty": (st.sampled_from([0.0, 1.0]), ODD_FLOATS),
        "frequency_penalty": (st.sampled_from([0.0, -1.0]), ODD_FLOATS),
        "repetition_penalty": (st.sampled_from([1.0, 1.3]), ODD_FLOATS),
        "stop_token_ids": (st.lists(st.integers(0, vocab - 1), max_size=3), bad_ids),
        "logit_bias": (st.dictionaries(st.integers(0, vocab - 1), st.sampled_from([-5.0, 5.0]),
                                       max_size=2),
                       st.dictionaries(st.sampled_from([0, 7, vocab, 2 ** 32 - 1]), ODD_FLOATS,
                                       min_size=1, max_size=2)),
        "seed": (st.sampled_from([0, 1, 2 ** 64 - 1]), st.sampled_from([2 ** 64 - 1])),
        "structured": (st.just(None), structured()),
    }


@st.composite
def sampling(draw, vocab: int, hostile_ok: bool = True) -> pb.SamplingParams:
    """Valid sampling parameters (outputs of at most 3 tokens) with (`hostile_ok`) one or two
    fields hostile: out of range, NaN, infinite, ids past the vocabulary, grammars that do not
    compile."""
    fields = _fields(vocab)
    hostile = set(draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=2))
                  if hostile_ok else ())
    p = pb.SamplingParams(ignore_eos=True, logprobs=draw(st.booleans()))
    for name, (valid, bad) in fields.items():
        value = draw(bad if name in hostile else valid)
        if name == "structured":
            if value is not None:
                p.structured.CopyFrom(value)
        elif name == "logit_bias":
            p.logit_bias.update(value)
        elif name == "stop_token_ids":
            p.stop_token_ids.extend(value)
        elif name in ("seed", "repetition_penalty"):
            if name in hostile or draw(st.booleans()):
                setattr(p, name, value)
        else:
            setattr(p, name, value)
    return p


@st.composite
def requests(draw, w: Workers) -> tuple[str, list[int], pb.SamplingParams]:
    """(request id, prompt, sampling parameters) with at most one of them hostile."""
    part = draw(st.sampled_from(["none", "id", "prompt", "params"]))
    rid = draw(REQUEST_IDS) if part == "id" else w.unique_id("request")
    ids = draw(prompts(w.vocab) if part == "prompt"
               else st.lists(st.integers(0, w.vocab - 1), min_size=1, max_size=40))
    return rid, ids, draw(sampling(w.vocab, hostile_ok=part == "params"))


def layouts(good: pb.KVLayout) -> st.SearchStrategy[pb.KVLayout]:
    wrong = st.builds(pb.KVLayout, dtype=st.sampled_from(["", "float32", "bfloat16", "int4",
                                                          "\x00"]),
                      block_size=st.sampled_from([0, 1, 16, 2 ** 32 - 1]),
                      num_layers=st.sampled_from([0, good.num_layers, 2 ** 32 - 1]),
                      num_kv_heads=st.sampled_from([0, good.num_kv_heads]),
                      head_dim=st.sampled_from([0, good.head_dim, 7]))
    return st.one_of(st.just(good), st.just(good), st.just(pb.KVLayout()), wrong)


def closed_address() -> str:
    """A loopback port that nothing listens on (it was free a moment ago)."""
    return f"127.0.0.1:{free_port()}"


@st.composite
def destinations(draw, w: Workers, num_blocks: int) -> pb.KVDescriptor:
    """Where a prefill worker is told to send KV: a well-formed descriptor for a closed loopback
    port or the real decode worker (which reserved nothing), with up to 3 fields hostile:
    malformed addresses, unknown transports, wrong layouts, block ids that do not fit."""
    hostile = set(draw(few(["address", "transport", "layout", "count", "cached",
                            "metadata"])))
    address = draw(st.sampled_from(["closed", "decode"]))
    if "address" in hostile:
        address = draw(st.sampled_from(["", "127.0.0.1:0", "127.0.0.1:99999",
                                        "127.0.0.1:notaport", "unix:", "[::1]:1"]))
    address = {"closed": closed_address(), "decode": w.decode_address}.get(address, address)
    count = num_blocks
    if "count" in hostile:
        count = draw(st.sampled_from([0, num_blocks - 1, num_blocks + 1, 5000]))
    block_ids = draw(st.lists(st.sampled_from([0, 1, 2, 3, 2 ** 20, 2 ** 32 - 1]),
                              min_size=count, max_size=count))
    return pb.KVDescriptor(
        transport=draw(st.sampled_from(["", "nixl", "torch", "carrier-pigeon"]))
        if "transport" in hostile else "grpc",
        address=address, engine_id=draw(st.sampled_from(["", "decode-x"])),
        layout=draw(layouts(w.layout)) if "layout" in hostile else w.layout,
        block_ids=block_ids,
        num_cached_blocks=draw(st.sampled_from([1, count, count + 1, 2 ** 32 - 1]))
        if "cached" in hostile else 0,
        transport_metadata=draw(st.binary(min_size=1, max_size=16))
        if "metadata" in hostile else b"")


# ---------------------------------------------------------------------------------- tests

def test_the_workers_serve_before_fuzzing(workers, before):
    assert len(before) == 3 and all(0 <= t < workers.vocab for t in before)
    workers.settle()


def test_hostile_decode_requests(workers, before):
    @FUZZ
    @given(request=requests(workers), local=st.booleans(),
           salt=st.sampled_from(["", "s", "\x00" * 3]))
    def run(request, local, salt):
        rid, ids, params = request
        req = pb.DecodeRequest(request_id=rid, prompt_token_ids=ids, params=params,
                               local_prefill=local, cache_salt=salt)
        note(f"DecodeRequest: {req}")
        events, code, details = read_decode(workers.decode.Decode(req, timeout=DEADLINE_S))
        event(f"Decode {'local' if local else 'reserve'}: {code.name}")
        assert_proper(code, details, "Decode")
        if code is grpc.StatusCode.OK and not local:
            assert events and events[0].HasField("reservation"), events
            blocks = events[0].reservation.block_ids
            assert len(blocks) == -(-len(ids) // BLOCK), (len(ids), list(blocks))
        if code is grpc.StatusCode.OK and local:
            finished = {e.tokens.index for e in events if e.tokens.finish_reason}
            assert len(finished) == max(params.n, 1), events
            tokens = [t for e in events for t in e.tokens.token_ids]
            assert all(0 <= t < workers.vocab for t in tokens), tokens
        workers.settle()

    run()


def test_hostile_prefill_requests(workers, before):
    @FUZZ
    @given(data=st.data(), request=requests(workers))
    def run(data, request):
        rid, ids, params = request
        dest = data.draw(destinations(workers, max(1, -(-len(ids) // BLOCK))))
        req = pb.PrefillRequest(request_id=rid, prompt_token_ids=ids, params=params,
                                destination=dest)
        note(f"PrefillRequest: {req}")
        code, details, reply = ended(lambda: workers.prefill.Prefill(req, timeout=DEADLINE_S))
        event(f"Prefill: {code.name}")
        assert_proper(code, details, "Prefill")
        # nothing reserved these blocks on the decode worker: no transfer may succeed
        assert code is not grpc.StatusCode.OK, reply
        workers.settle()

    run()


FILLS = [b"\x00", b"\x7f\xc0\x00\x00", b"\x3c"]    # zeros, NaN, 0.0118 (float32)


@st.composite
def honest_streams(draw, w: Workers) -> list[dict]:
    """The transfer an honest prefill worker sends (every reserved block once, their checksums,
    then `last` with the first token), with at most one thing tampered with."""
    whole = dict(rid="reserved", layout=w.layout, blocks="all", sums="right", dup=False,
                 size="right", fill=draw(st.sampled_from(FILLS)), last=True, first=5,
                 logprob=draw(st.sampled_from(["none", "fine"])))
    tamper = draw(st.sampled_from(["none", "none", "first", "logprob", "sums", "again",
                                   "split", "last first", "dup"]))
    if tamper == "first":
        whole["first"] = draw(st.sampled_from([w.vocab, 2 ** 32 - 1]))
    elif tamper == "logprob":
        whole["logprob"] = "hostile"
    elif tamper == "sums":
        whole["sums"] = "wrong"
    elif tamper == "dup":
        whole["dup"] = True
    elif tamper == "again":                     # the completion, twice
        return [whole, dict(whole, blocks=[], size="empty")]
    elif tamper == "split":                     # two pieces, then the completion alone
        return [dict(whole, blocks="head", last=False), dict(whole, blocks="tail", last=False),
                dict(whole, blocks=[], size="empty")]
    elif tamper == "last first":                # the completion before any data
        return [dict(whole, blocks=[], size="empty"), dict(whole, last=False)]
    return [whole]


@st.composite
def kv_streams(draw, w: Workers):
    """A PushKV stream for a reserved request, as chunk descriptions that `build_chunks` turns
    into messages (block ids are known once reserved): an honest transfer with one thing
    tampered with, or up to 4 random pieces."""
    if draw(st.booleans()):
        return draw(honest_streams(w))
    chunks = []
    for _ in range(draw(st.integers(0, 4))):
        chunks.append(dict(
            rid=draw(st.sampled_from(["reserved", "reserved", "unknown", ""])),
            layout=draw(st.one_of(*[st.just(w.layout)] * 4, layouts(w.layout))),
            blocks=draw(st.one_of(st.just("all"), st.lists(st.sampled_from(
                ["mine", "mine", "other", "huge"]), max_size=3))),
            sums=draw(st.sampled_from(["right", "right", "none", "wrong", "one"])),
            dup=draw(st.booleans()),
            size=draw(st.sampled_from(["right", "right", "short", "long", "empty"])),
            fill=draw(st.sampled_from(FILLS)),
            last=draw(st.booleans()),
            first=draw(st.sampled_from([5, 5, w.vocab, 2 ** 32 - 1])),
            logprob=draw(st.sampled_from(["none", "fine", "hostile"]))))
    return chunks


def block_bytes(layout: pb.KVLayout) -> int:
    return 2 * layout.num_layers * layout.block_size * layout.num_kv_heads * layout.head_dim * 4


def checksums_of(w: Workers, data: bytes, num_blocks: int) -> list[int]:
    """What an honest sender computes for DATA (kvtransfer.integrity's block checksums)."""
    import torch

    from kvtransfer.integrity import checksums

    lay = w.layout
    kv = torch.frombuffer(bytearray(data), dtype=torch.float32).view(
        lay.num_layers, 2, num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)
    return checksums(kv).tolist()


def build_chunks(w: Workers, plan: list[dict], rid: str, mine: list[int]) -> list[pb.KVChunk]:
    out = []
    for c in plan:
        ids = {"all": list(mine), "head": mine[:1], "tail": mine[1:]}.get(c["blocks"]) \
            if isinstance(c["blocks"], str) else [
            {"mine": mine[i % len(mine)], "other": 0, "huge": 2 ** 32 - 1}[b]
            for i, b in enumerate(c["blocks"])]
        if c["dup"] and ids:
            ids.append(ids[0])
        want = block_bytes(w.layout) * len(ids)
        size = {"right": want, "short": max(want - 4, 0), "long": want + 4, "empty": 0}[c["size"]]
        data = (c["fill"] * (size // len(c["fill"]) + 1))[:size]
        sums = {"none": [], "wrong": [12345] * len(ids), "one": [7],
                "right": checksums_of(w, data, len(ids)) if size == want and ids else []}
        msg = pb.KVChunk(request_id={"reserved": rid, "unknown": "nobody", "": ""}[c["rid"]],
                         layout=c["layout"], block_ids=ids, last=c["last"], data=data,
                         first_token_id=c["first"], checksums=sums[c["sums"]])
        if c["logprob"] == "fine":
            msg.first_logprob.CopyFrom(pb.TokenLogprob(token_id=c["first"], logprob=-0.5))
        elif c["logprob"] == "hostile":
            msg.first_logprob.CopyFrom(pb.TokenLogprob(
                token_id=2 ** 32 - 1, logprob=math.nan,
                top=[pb.TopLogprob(token_id=2 ** 32 - 1, logprob=math.inf)] * 3))
        out.append(msg)
    return out


class Reader(threading.Thread):
    """Reads the rest of a Decode stream: its tokens and how it ended."""

    def __init__(self, call) -> None:
        super().__init__(daemon=True)
        self.call = call
        self.tokens: list[int] = []
        self.code, self.details = grpc.StatusCode.OK, ""
        self.start()

    def run(self) -> None:
        try:
            for ev in self.call:
                self.tokens += ev.tokens.token_ids
        except grpc.RpcError as exc:
            self.code, self.details = exc.code(), exc.details() or ""


def test_hostile_kv_streams(workers, before):
    @FUZZ
    @given(data=st.data(), num_blocks=st.integers(1, 3), logprobs=st.booleans())
    def run(data, num_blocks, logprobs):
        rid = workers.unique_id("kv")
        params = pb.SamplingParams(max_tokens=2, ignore_eos=True, logprobs=logprobs,
                                   temperature=1.0, seed=7)
        start = 7919 * int(rid.rsplit("-", 1)[1])      # a prompt no other example shares
        ids = [(start + i) % workers.vocab for i in range(BLOCK * num_blocks)]
        # drawn before the call: a draw may end the example, and the stream would stay open
        plan = data.draw(kv_streams(workers))
        descriptor, call = workers.reserve(ids, rid, params)
        try:
            check(rid, call, descriptor, plan)
        finally:
            call.cancel()
        workers.settle()

    def check(rid, call, descriptor, plan):
        reader = Reader(call)
        mine = list(descriptor.block_ids[descriptor.num_cached_blocks:]) or [0]
        chunks = build_chunks(workers, plan, rid, mine)
        note(f"reserved {list(descriptor.block_ids)}; KVChunks: "
             + "; ".join(f"rid={c.request_id!r} blocks={list(c.block_ids)} bytes={len(c.data)}"
                         f" data={c.data[:4]!r}... checksums={list(c.checksums)} last={c.last}"
                         f" first={c.first_token_id} first_logprob=({c.first_logprob})"
                         f" layout=({c.layout})" for c in chunks))
        code, details, _ = ended(lambda: list(workers.decode.PushKV(iter(chunks),
                                                                    timeout=DEADLINE_S)))
        event(f"PushKV: {code.name}")
        assert_proper(code, details, "PushKV")
        # a stream that took a `last` for the request decodes it to the end by itself
        completed = code is grpc.StatusCode.OK and any(c.last and c.request_id == rid
                                                       for c in chunks)
        reader.join(DEADLINE_S if completed else 0.5)
        if reader.is_alive():
            assert not completed, "the Decode stream did not end after its KV arrived"
            call.cancel()
            reader.join(DEADLINE_S)
        event(f"the Decode stream after PushKV: {reader.code.name}")
        if reader.code is not grpc.StatusCode.CANCELLED:
            assert_proper(reader.code, reader.details, "the Decode stream after PushKV")
        assert all(0 <= t < workers.vocab for t in reader.tokens), reader.tokens
        if completed and reader.code is grpc.StatusCode.OK:   # the first token and one more
            assert len(reader.tokens) == 2, reader.tokens

    run()


def test_hostile_aborts(workers, before):
    @FUZZ
    @given(rid=REQUEST_IDS, live=st.booleans(), choice=st.sampled_from([None, 0, 1, 2 ** 32 - 1]),
           n=st.integers(1, 3))
    def run(rid, live, choice, n):
        call = reader = None
        if live:
            rid = workers.unique_id("abort")
            _, call = workers.reserve([3] * BLOCK, rid, pb.SamplingParams(
                max_tokens=2, ignore_eos=True, n=n))
            reader = Reader(call)
        req = pb.AbortRequest(request_id=rid)
        if choice is not None:
            req.choice = choice
        note(f"AbortRequest: {req} (live: {live}, n {n})")
        try:
            for stub in (workers.decode, workers.prefill):
                code, details, reply = ended(lambda s=stub: s.Abort(req, timeout=DEADLINE_S))
                assert_proper(code, details, "Abort")
                assert code is grpc.StatusCode.OK, (code, details)
            if reader is not None and choice is None:     # the whole request is gone
                reader.join(10)
                assert not reader.is_alive(), "the Decode stream of an aborted request stays open"
                assert reader.code is grpc.StatusCode.CANCELLED, (reader.code, reader.details)
                assert "aborted" in reader.details
        finally:
            if call is not None:
                call.cancel()
        workers.settle()

    run()


def test_afterwards_the_workers_serve_as_before(workers, before):
    workers.settle()
    assert workers.disaggregated(list(range(100, 140)), "fuzz-after") == before
    workers.settle()
