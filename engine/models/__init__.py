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

FAMILY_MODULES = ("llama", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe",
                  "minimax_m2")

DENSE_QUANT = ("int8", "gptq", "awq", "compressed-tensors")
MOE_QUANT = ("int8",)


@dataclass(frozen=True)
class Family:
    name: str                            # HF model_type
    architectures: tuple[str, ...]       # HF `architectures` served by this code
    model: type                          # the nn.Module (engine.layers.decoder.DecoderLM)
    config: Callable[[dict], dict] = field(default=lambda hf: {})
    examples: str = ""                   # checkpoints people run
    moe: bool = False
    quantization: tuple[str, ...] = DENSE_QUANT   # --quantization / pre-quantized formats
    notes: str = ""


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
