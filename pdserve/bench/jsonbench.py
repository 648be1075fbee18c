"""`pdserve jsonbench`: structured outputs as a model writes them. Twenty chat prompts, each with
a strict JSON schema of its own (strings, integers, numbers, booleans, enums, arrays, nested
objects), sent greedy to any OpenAI-compatible server (`response_format` json_schema); per
prompt: did it finish with `stop`, does the text parse and validate against its schema (the
jsonschema package), how many tokens. Run it against pdserve and against another server with
the same model to compare the share that finish and validate.

    pdserve jsonbench --url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import time

S, I, N, B = ({"type": "string", "maxLength": 24}, {"type": "integer"}, {"type": "number"},
              {"type": "boolean"})


def _obj(props: dict, required: list | None = None) -> dict:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False}


CASES: list[tuple[str, dict]] = [
    ("Invent a person.", _obj({"name": S, "age": I})),
    ("Describe a cat.", _obj({"name": S, "color": S, "age": I, "indoor": B})),
    ("Give me a book recommendation.", _obj({"title": S, "author": S, "year": I})),
    ("What is the weather like in Paris today? Make it up.",
     _obj({"city": S, "temperature_c": N, "sky": {"enum": ["sunny", "cloudy", "rainy"]}})),
    ("Create a user account.", _obj({"username": S, "email": S, "admin": B})),
    ("List three fruits.", _obj({"fruits": {"type": "array", "items": S, "minItems": 3,
                                            "maxItems": 3}})),
    ("Describe a car.", _obj({"make": S, "model": S, "year": I, "electric": B})),
    ("Write a short movie review.", _obj({"movie": S, "rating": {"type": "integer",
                                                                  "minimum": 1, "maximum": 5},
                                          "summary": {"type": "string", "maxLength": 80}})),
    ("Give the coordinates of a city.", _obj({"city": S, "lat": N, "lon": N})),
    ("Plan a small dinner party.", _obj({"guests": I, "dishes": {"type": "array", "items": S,
                                                                 "maxItems": 4}})),
    ("Describe a company.", _obj({"name": S, "employees": I,
                                  "address": _obj({"street": S, "city": S})})),
    ("Classify the sentence 'I love this phone' by sentiment.",
     _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]},
           "confidence": N})),
    ("Make a to-do item.", _obj({"task": S, "done": B, "priority": {"enum": ["low", "medium",
                                                                           "high"]}})),
    ("Describe a song.", _obj({"title": S, "artist": S, "seconds": I})),
    ("Give a recipe.", _obj({"name": S, "ingredients": {"type": "array", "items": S,
                                                        "minItems": 2, "maxItems": 5},
                             "minutes": I})),
    ("Describe a planet.", _obj({"name": S, "moons": I, "has_rings": B})),
    ("Make an order for an online shop.",
     _obj({"order_id": I, "items": {"type": "array", "maxItems": 3, "items": _obj(
         {"product": S, "quantity": I})}})),
    ("Describe a country.", _obj({"name": S, "capital": S, "population": I})),
    ("Create a calendar event.", _obj({"title": S, "day": {"enum": [
        "monday", "tuesday", "wednesday", "thursday", "friday"]}, "hour": {
        "type": "integer", "minimum": 0, "maximum": 23}})),
    ("Describe a pet dog.", _obj({"name": S, "breed": S, "age": I, "vaccinated": B})),
]


def run_case(client, model: str, prompt: str, schema: dict, max_tokens: int,
             extra: dict) -> dict:
    import jsonschema

    t0 = time.perf_counter()
    r = client.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": prompt}],
        "temperature": 0, "max_tokens": max_tokens,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "out", "schema": schema, "strict": True}}, **extra})
    out = {"prompt": prompt, "status": r.status_code, "seconds": time.perf_counter() - t0}
    if r.status_code != 200:
        out.update(finish=None, valid=False, text=r.text[:200], tokens=0)
        return out
    body = r.json()
    choice = body["choices"][0]
    text = choice["message"]["content"] or ""
    try:
        jsonschema.validate(json.loads(text), schema)
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    out.update(finish=choice["finish_reason"], valid=valid, text=text,
               tokens=body["usage"]["completion_tokens"])
    return out


def main(args) -> int:
    import logging

    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)        # no line per request

    extra = json.loads(args.extra) if args.extra else {}
    rows = []
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url, timeout=args.timeout, headers=headers) as client:
        for i, (prompt, schema) in enumerate(CASES[:args.cases]):
            row = run_case(client, args.model, prompt, schema, args.max_tokens, extra)
            rows.append(row)
            print(f"{i + 1:2d} {row['finish'] or '-':6s} {'valid' if row['valid'] else 'INVALID':7s}"
                  f" {row['tokens']:4d} tok  {row['text'][:90]!r}", flush=True)
    stop_valid = sum(r["finish"] == "stop" and r["valid"] for r in rows)
    failed = [r for r in rows if r["status"] != 200]
    if failed:
        print(f"{len(failed)} requests failed, e.g. {failed[0]['status']}: {failed[0]['text']}")
    print(f"finished with stop and valid: {stop_valid}/{len(rows)}; stop "
          f"{sum(r['finish'] == 'stop' for r in rows)}, valid {sum(r['valid'] for r in rows)}, "
          f"tokens {sum(r['tokens'] for r in rows)}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 1 if failed else 0


def register(sub) -> None:
    from pdserve.flags import DefaultsFormatter

    p = sub.add_parser("jsonbench", help="structured outputs against 20 JSON schemas: share that "
                       "finish and validate", formatter_class=DefaultsFormatter,
                       description=__doc__)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="an OpenAI-compatible server")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--cases", type=int, default=len(CASES), help="run the first N prompts")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--extra", default="", metavar="JSON",
                   help="more request fields, e.g. '{\"structured_outputs\": "
                        "{\"disable_any_whitespace\": true}}'")
    p.add_argument("--out", default=None, help="write every answer here (JSON)")
    p.set_defaults(target="pdserve.bench.jsonbench:main")
