"""`pdserve baseline hf`: HF transformers behind an OpenAI-compatible /v1/completions, with
STATIC batching, as the simplest reference to measure pdserve against.

Requests queue. The batch former takes the first waiting request, waits up to --batch-wait-ms
for more (at most --batch-size), left-pads the prompts and decodes the whole batch with the HF
model and its DynamicCache until every member is done. Each step's tokens stream to their
requests as SSE chunks; a request that finishes early ends its stream while its row keeps running.
Requests that arrive meanwhile wait for the whole batch: no request joins a running batch.
Honoured: prompt (text or token ids; no BOS is added), max_tokens (default 16), temperature
(0 = greedy; default 1), ignore_eos, stream, stream_options.include_usage. Other fields are ignored.

    left-padded batch (P = pad, masked out; positions count real tokens only)
        row 0:  P  P  a0 a1 a2 | g0 g1 ...     positions  0 0 0 1 2 | 3 4 ...
        row 1:  b0 b1 b2 b3 b4 | h0 h1 ...     positions  0 1 2 3 4 | 5 6 ...
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from cluster.paths import resolve_model

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One request. The batch thread pushes token ids, then None (done) or an Exception."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    cancelled: bool = False

    def push(self, item) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class StaticBatcher:
    """Runs batches one after another on a single thread; see the module docstring."""

    def __init__(self, model, eos_ids: set[int], pad_id: int, batch_size: int,
                 wait_s: float) -> None:
        self.model, self.eos_ids, self.pad_id = model, eos_ids, pad_id
        self.batch_size, self.wait_s = batch_size, wait_s
        self.jobs: queue.Queue[Job] = queue.Queue()
        threading.Thread(target=self._serve, name="static-batcher", daemon=True).start()

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def _gather(self) -> list[Job]:
        batch = [self.jobs.get()]
        deadline = time.monotonic() + self.wait_s
        while len(batch) < self.batch_size:
            try:
                batch.append(self.jobs.get(timeout=max(deadline - time.monotonic(), 1e-4)))
            except queue.Empty:
                break
        return [job for job in batch if not job.cancelled]

    def _serve(self) -> None:
        while True:
            batch = self._gather()
            try:
                if batch:
                    self._run(batch)
            except Exception as exc:  # noqa: BLE001 - report to the requests, keep serving
                log.exception("batch of %d failed", len(batch))
                for job in batch:
                    job.push(exc)

    @torch.inference_mode()
    def _run(self, batch: list[Job]) -> None:
        n, width = len(batch), max(len(j.prompt_ids) for j in batch)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)      # [n, width]
        mask = torch.zeros((n, width), dtype=torch.long)                 # [n, width]
        for i, job in enumerate(batch):
            ids[i, width - len(job.prompt_ids):] = torch.tensor(job.prompt_ids)
            mask[i, width - len(job.prompt_ids):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)                         # [n, width]
        temps = torch.tensor([j.temperature for j in batch])             # [n]
        cache = DynamicCache(config=self.model.config)
        counts, done = [0] * n, [False] * n
        while not all(done):
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                                past_key_values=cache, use_cache=True,
                                logits_to_keep=1).logits[:, -1, :].float()   # [n, vocab]
            next_ids = _sample(logits, temps)                            # [n]
            for i, (job, tok) in enumerate(zip(batch, next_ids.tolist())):
                if done[i]:
                    continue
                counts[i] += 1
                job.push(tok)
                eos = tok in self.eos_ids and not job.ignore_eos
                if counts[i] >= job.max_tokens or eos or job.cancelled:
                    done[i] = True
                    job.push(None)
            ids = next_ids[:, None]                                      # [n, 1]
            mask = torch.cat([mask, mask.new_ones((n, 1))], dim=1)       # [n, width + step]
            pos = pos[:, -1:] + 1                                        # [n, 1]


def _sample(logits: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """Greedy where temperature is 0, else a draw from softmax(logits / temperature)."""
    greedy = logits.argmax(-1)
    if not bool((temps > 0).any()):
        return greedy
    probs = torch.softmax(logits / temps.clamp(min=1e-5)[:, None], dim=-1)
    return torch.where(temps > 0, torch.multinomial(probs, 1).squeeze(1), greedy)


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                   "param": None, "code": None}}, status_code=status)


def _sse(obj) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def create_app(batcher: StaticBatcher, tokenizer, name: str, max_len: int) -> FastAPI:
    app = FastAPI(title="pdserve HF static-batching baseline", docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                            "owned_by": "baseline-hf", "max_model_len": max_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await request.json()
            prompt, temperature = body.get("prompt"), body.get("temperature")
            temperature = 1.0 if temperature is None else float(temperature)
            max_tokens = int(body.get("max_tokens") or 16)
        except (ValueError, TypeError, AttributeError) as exc:
            return _error(f"invalid request body: {exc}")
        if isinstance(prompt, str):
            prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = prompt
        else:
            return _error("prompt must be a non-empty string or a list of token ids")
        if max_tokens < 1 or len(prompt_ids) + max_tokens > max_len:
            return _error(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) must "
                          f"be within 1..{max_len}")
        job = Job(prompt_ids, max_tokens, temperature,
                  bool(body.get("ignore_eos", False)), asyncio.get_running_loop(), asyncio.Queue())
        batcher.submit(job)
        head = {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion",
                "created": int(time.time()), "model": name}
        usage_wanted = bool((body.get("stream_options") or {}).get("include_usage"))
        if body.get("stream"):
            return StreamingResponse(_stream(job, tokenizer, head, usage_wanted),
                                     media_type="text/event-stream")
        text, finish, n = "", None, 0
        async for piece, finish, n in _pieces(job, tokenizer):
            text += piece
        return {**head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                     "finish_reason": finish}], "usage": _usage(job, n)}

    return app


def _usage(job: Job, n: int) -> dict:
    return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": n,
            "total_tokens": len(job.prompt_ids) + n}


async def _pieces(job: Job, tokenizer):
    """(text delta, finish_reason or None, tokens so far) per generated token. A delta that ends
    inside a multi-byte character is held back until the character completes."""
    out: list[int] = []
    sent = text = ""
    try:
        while (item := await job.out.get()) is not None:
            if isinstance(item, Exception):
                raise item
            out.append(item)
            text = tokenizer.decode(out, skip_special_tokens=True)
            if not text.endswith("\ufffd"):
                yield text[len(sent):], None, len(out)
                sent = text
        yield text[len(sent):], "length" if len(out) >= job.max_tokens else "stop", len(out)
    finally:
        job.cancelled = True


async def _stream(job: Job, tokenizer, head: dict, usage_wanted: bool):
    n = 0
    try:
        async for piece, finish, n in _pieces(job, tokenizer):
            if piece or finish:
                yield _sse({**head, "choices": [{"index": 0, "text": piece, "logprobs": None,
                                                 "finish_reason": finish}]})
        if usage_wanted:
            yield _sse({**head, "choices": [], "usage": _usage(job, n)})
    except Exception as exc:  # noqa: BLE001 - the 200 is already sent: report in-stream
        yield _sse({"error": {"message": f"generation failed: {exc}", "type": "server_error"}})
    yield _sse("[DONE]")


def main(args) -> int:
    model_dir = resolve_model(args.model)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    batcher = StaticBatcher(model, eos_ids, pad_id, args.batch_size, args.batch_wait_ms / 1000)
    name = args.served_model_name or Path(model_dir).name
    app = create_app(batcher, tokenizer, name, model.config.max_position_embeddings)
    log.info("serving %s (%s, batch %d, wait %d ms) on %s:%d", name, args.dtype, args.batch_size,
             args.batch_wait_ms, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
