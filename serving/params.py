"""A request as it crosses a worker's process boundary: the wire's SamplingParams (written by
the gateway's `GenerationParams.to_proto`, every field checked there) become the engine's
SamplingParams, and a Decode or Prefill request the engine's Request. The one place both roles
convert; proto3 defaults read as the gateway's grpc_api documents them (top_p 0: 1, n 0: 1,
absent seed 0, absent repetition_penalty 1)."""

from __future__ import annotations

import json

from engine.request import Request, SamplingParams
from engine.sampling_limits import EARLY_STOPPING
from engine.structured.spec import StructuredSpec
from proto import pdserve_pb2 as pb


def structured_from_pb(p: pb.StructuredOutput) -> StructuredSpec | None:
    """proto StructuredOutput -> the engine's StructuredSpec, or None when unset."""
    which = p.WhichOneof("kind")
    if which is None:
        return None
    if which == "json_object":
        return StructuredSpec("json_object", compact=p.compact_json)
    if which == "choice":
        return StructuredSpec("choice", json.dumps(list(p.choice.choices), ensure_ascii=False))
    return StructuredSpec(which, getattr(p, which), compact=which == "json_schema" and
                          p.compact_json)


def sampling_from_pb(p: pb.SamplingParams) -> SamplingParams:
    """proto SamplingParams -> the engine's SamplingParams (ValueError on bad values)."""
    return SamplingParams(temperature=p.temperature, top_p=p.top_p or 1.0, top_k=p.top_k,
                          seed=p.seed if p.HasField("seed") else 0,
                          max_tokens=max(p.max_tokens, 1), ignore_eos=p.ignore_eos,
                          logprobs=p.logprobs or p.top_logprobs > 0, top_logprobs=p.top_logprobs,
                          min_p=p.min_p, presence_penalty=p.presence_penalty,
                          frequency_penalty=p.frequency_penalty,
                          repetition_penalty=(p.repetition_penalty
                                              if p.HasField("repetition_penalty") else 1.0),
                          logit_bias=tuple(sorted(p.logit_bias.items())),
                          min_tokens=p.min_tokens, stop_token_ids=tuple(p.stop_token_ids),
                          n=p.n or 1, structured=structured_from_pb(p.structured)
                          if p.HasField("structured") else None,
                          prompt_logprobs=p.prompt_logprobs
                          if p.HasField("prompt_logprobs") else None,
                          beam_width=p.beam_width,
                          length_penalty=(p.length_penalty if p.HasField("length_penalty")
                                          else 1.0),
                          early_stopping=_early_stopping(p.early_stopping))


def _early_stopping(text: str) -> bool | str:
    """The wire's early_stopping ("", "false", "true", "never") as HF's value."""
    if text not in EARLY_STOPPING:
        raise ValueError(f"early_stopping must be true, false or never, got {text!r}")
    return EARLY_STOPPING[text]


def request_from_pb(rid: str, msg: pb.DecodeRequest | pb.PrefillRequest) -> Request:
    """The engine's Request of a Decode or Prefill call, known by `rid` (ValueError on bad
    values): its prompt, parameters, cache salt and the output a moved stream resumes after."""
    req = Request(rid, list(msg.prompt_token_ids), sampling_from_pb(msg.params),
                  output_token_ids=list(msg.resume_token_ids), cache_salt=msg.cache_salt)
    req.lora_name = msg.lora_name
    return req
