"""One streamed POST /v1/completions, timed per chunk (OpenAI server-sent events)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

from pdserve.bench.stats import RequestResult
from pdserve.bench.workloads import Prompt

if TYPE_CHECKING:
    import httpx


def request_body(prompt: Prompt, model: str, prompt_format: str, temperature: float,
                 extra: dict | None = None) -> dict:
    """The completions request every server gets: streamed, usage at the end, ignore_eos so the
    output length is exactly max_tokens."""
    body = {"model": model,
            "prompt": list(prompt.token_ids) if prompt_format == "ids" else prompt.text,
            "max_tokens": prompt.output_len, "temperature": temperature, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    body.update(extra or {})
    return body


def _chunk_text(choice: dict) -> str:
    """Completions chunks carry `text`; chat-style chunks carry `delta.content`."""
    if choice.get("text"):
        return choice["text"]
    return (choice.get("delta") or {}).get("content") or ""


async def _read_stream(resp: httpx.Response, res: RequestResult, sent: float) -> bool:
    """Fills `res` from the event stream; True when it ended with [DONE]. When no chunk had text
    (e.g. only special tokens were generated), TTFT falls back to the first chunk with a choice."""
    last = first_choice = None
    chunks = 0
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            if res.output_tokens == 0:
                res.output_tokens = chunks
            if res.ttft_s is None and first_choice is not None:
                res.ttft_s = first_choice - sent
            return True
        now = time.perf_counter()
        event = json.loads(data)
        if event.get("error"):
            err = event["error"]
            res.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return False
        if event.get("usage"):
            res.output_tokens = int(event["usage"].get("completion_tokens") or 0)
            res.prompt_tokens = event["usage"].get("prompt_tokens")
        for choice in event.get("choices") or []:
            first_choice = first_choice or now
            piece = _chunk_text(choice)
            if piece:
                res.text += piece
                if last is None:
                    res.ttft_s = now - sent
                else:
                    res.itl_s.append(now - last)
                last = now
                chunks += 1
            res.finish_reason = choice.get("finish_reason") or res.finish_reason
    res.error = "the stream ended without data: [DONE]"
    return False


async def send(client: httpx.AsyncClient, url: str, body: dict, prompt: Prompt, t0: float,
               timeout_s: float) -> RequestResult:
    """Sends one request and measures it; never raises for server or network errors (they are
    recorded in the result). t0 is the run's start on the time.perf_counter clock."""
    import httpx

    res = RequestResult(prompt.kind, prompt.input_len, prompt.output_len)
    sent = time.perf_counter()
    res.start_s = sent - t0

    async def exchange() -> None:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                res.error = f"HTTP {resp.status_code}: {text[:300]}"
            else:
                res.ok = await _read_stream(resp, res, sent)

    try:
        await asyncio.wait_for(exchange(), timeout_s)
    except asyncio.TimeoutError:
        res.error = f"timed out after {timeout_s:g}s"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.end_s = time.perf_counter() - t0
    if res.ok and res.ttft_s is None:
        res.ok, res.error = False, "the stream had no choices"
    return res
