"""Model families: the registry from HF `architectures` to our model code.

A family is one file here: a `config(hf)` function (the ModelConfig fields beyond the ones
every family shares, engine.config.ModelConfig.from_hf) and a model class composed of the shared
layers (engine.layers.decoder, engine.layers.moe), registered as a `Family` in its module's
FAMILIES. Adding a family: a file here, and its module in FAMILY_MODULES. What each family
supports is declared here too, and docs/models.md (the supported-models table) is generated
from it (`python -m engine.models`; a test keeps the two equal).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

FAMILY_MODULES = ("llama", "mistral", "phi3", "gemma", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
                  "glm4_moe", "minimax_m2", "gpt_oss")

DENSE_QUANT = ("int8", "gptq", "awq", "compressed-tensors")
MOE_QUANT = ("int8",)


@dataclass(frozen=True)
class Family:
    name: str                            # HF model_type
    architectures: tuple[str, ...]       # HF `architectures` served by this code
    model: type                          # the nn.Module (engine.layers.decoder.DecoderLM)
    config: Callable[[dict], dict] = field(default=lambda hf: {})
    examples: str = ""                   # checkpoints people run
    attention: str = "GQA"               # the table's words for its attention
    feed_forward: str = "dense SwiGLU"   # and its feed-forward
    moe: bool = False
    tensor_parallel: bool = True         # --tensor-parallel-size > 1
    speculative: tuple[str, ...] = ("ngram", "draft")
    transports: tuple[str, ...] = ("grpc", "nixl", "torch")   # KV from prefill to decode
    quantization: tuple[str, ...] = DENSE_QUANT   # --quantization / pre-quantized formats


def _load() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for mod in FAMILY_MODULES:
        for fam in importlib.import_module(f"engine.models.{mod}").FAMILIES:
            for arch in fam.architectures:
                found[arch] = fam
    return found


_REGISTRY: dict[str, Family] | None = None


def registry() -> dict[str, Family]:
    """HF architecture name -> its Family."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = _load()
    return _REGISTRY


def families() -> list[Family]:
    seen: dict[str, Family] = {}
    for fam in registry().values():
        seen.setdefault(fam.name, fam)
    return list(seen.values())


def family_for(architectures: list[str]) -> Family:
    reg = registry()
    for a in architectures:
        if a in reg:
            return reg[a]
    raise ValueError(f"unsupported architectures {architectures}; supported: {sorted(reg)}")


def family_named(name: str) -> Family:
    for fam in families():
        if fam.name == name:
            return fam
    raise ValueError(f"no model code for family {name!r}; known: "
                     f"{sorted(f.name for f in families())}")


def model_class(family: str):
    return family_named(family).model


TABLE_HEADER = """# Supported models

Generated from the model registry (`engine/models/`) by `python -m engine.models > docs/models.md`;
a test keeps it equal to the registry. A family is served by the HF `architectures` listed; a
checkpoint of another architecture is refused at start, naming these. Each family is tested on
tiny random models against HF transformers (fp32 logits of every position through chunked
prefill and the paged cache, greedy tokens of a batch: tests/test_model_parity.py,
tests/test_moe_models.py, tests/test_attention_families.py). Sliding windows, soft-capped
scores and attention sinks run in every attention path (the Triton kernels, the C++ CPU
kernel, gather + SDPA), and a sliding layer holds only its window: its KV group releases the
blocks behind it, and a KV transfer moves only the blocks the window needs
(engine/kv_groups.py; `pdserve windowbench` prints the bytes a sequence holds). What the
engine does around the model (tensor parallelism with `--tensor-parallel-size`, prefill and
decode pools of different sizes, KV transfer over grpc, nixl or torch, the prefix cache,
n-gram and draft-model speculation, structured outputs, beam search, prompt logprobs) does not
depend on the family; what does is in the table. The KV offload tiers (`--kv-offload-gib`)
refuse models with sliding-window layers. Expert
parallelism (`--expert-parallel`) splits the experts whole over the tensor-parallel ranks
(tests/test_expert_parallel.py). nixl moves the KV of one-process workers (no tensor
parallelism) only.

| family | HF architectures | examples | attention | feed-forward | TP | EP | quantization | speculation | PD transfer |
|---|---|---|---|---|---|---|---|---|---|
"""


def table() -> str:
    rows = []
    for fam in families():
        quant = ", ".join(f"`{q}`" for q in fam.quantization)
        if fam.moe:
            quant += " (experts too); pre-quantized MoE checkpoints refused at start"
        rows.append(f"| {fam.name} | {', '.join(f'`{a}`' for a in fam.architectures)} | "
                    f"{fam.examples} | {fam.attention} | {fam.feed_forward} | "
                    f"{'yes' if fam.tensor_parallel else '-'} | {'yes' if fam.moe else '-'} | "
                    f"{quant} | {', '.join(fam.speculative) or '-'} | "
                    f"{', '.join(fam.transports)} |")
    return TABLE_HEADER + "\n".join(rows) + "\n"
