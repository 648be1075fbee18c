"""A LoRA adapter as PEFT saves it: adapter_config.json + adapter_model.safetensors.

    W x  ->  W x + scaling * B (A x)        A [r, in], B [out, r], scaling = alpha / r
                                            (alpha / sqrt(r) with use_rslora)

Loaded on the host in float32, checked against the base model before anything is kept: the
projections it targets (q/k/v/o, gate/up/down of the decoder layers), each tensor's shape, its
rank against --max-lora-rank, and PEFT features not served (DoRA, trained biases, modules to
save, per-module ranks, fan-in-fan-out layouts) are refused by name. `digest` (SHA-256 of the
config and the tensors) names the weights: it enters the prefix cache's keys
(engine.kv_cache_manager), so KV computed under one adapter never serves another, nor the
same name loaded again with new weights.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

# the projections an adapter may target, and the merged layer (and shard) each lives in
TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
           "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", None),
           "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
           "down_proj": ("mlp.down_proj", None),
           # checkpoints that fuse them (Phi-3): one A and B over the merged output
           "qkv_proj": ("self_attn.qkv_proj", None), "gate_up_proj": ("mlp.gate_up_proj", None)}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served (the message says why)."""


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    # (layer, projection name) -> (A [r, in], B [out, r]) float32 on the host
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    digest: str = ""

    @property
    def key(self) -> bytes:
        """What the prefix cache keys this adapter's KV by: its name and its weights."""
        return f"lora:{self.name}:{self.digest}".encode()


def _config(path: Path) -> dict:
    f = path / "adapter_config.json"
    if not f.is_file():
        raise AdapterError(f"LoRA adapter {path}: no adapter_config.json")
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise AdapterError(f"LoRA adapter {path}: adapter_config.json is not JSON: {exc}")


def load_adapter(name: str, path: str | Path, model_cfg, max_rank: int) -> LoRAAdapter:
    """The adapter at `path` for a model of `model_cfg` (engine.config.ModelConfig), or
    AdapterError saying why it cannot be served."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"LoRA adapter {name!r}: {path} is not a folder")
    cfg = _config(path)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not "
                           "LORA")
    for key, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out layouts"),
                      ("modules_to_save", "modules_to_save"), ("rank_pattern", "rank_pattern"),
                      ("alpha_pattern", "alpha_pattern"), ("layers_to_transform",
                                                           "layers_to_transform")):
        if cfg.get(key):
            raise AdapterError(f"LoRA adapter {name!r}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"LoRA adapter {name!r}: trained biases (bias={cfg['bias']!r}) are "
                           "not supported")
    rank = int(cfg.get("r", 0))
    if rank <= 0:
        raise AdapterError(f"LoRA adapter {name!r}: rank r={rank} must be positive")
    if rank > max_rank:
        raise AdapterError(f"LoRA adapter {name!r}: rank {rank} exceeds --max-lora-rank "
                           f"{max_rank}")
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):
        raise AdapterError(f"LoRA adapter {name!r}: target_modules as a pattern ({targets!r}) "
                           "is not supported: list the projections")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise AdapterError(f"LoRA adapter {name!r}: target modules {unknown} are not "
                           f"projections of {model_cfg.family} this server adapts "
                           f"({', '.join(TARGETS)})")
    files = sorted(path.glob("adapter_model*.safetensors"))
    if not files:
        raise AdapterError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {path}")
    digest = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
    pieces: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for key in sorted(st.keys()):
                m = _KEY.search(key)
                if m is None:
                    raise AdapterError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA "
                                       "A/B weight of a decoder projection")
                layer, proj, ab = int(m[1]), m[3], m[4]
                if proj not in TARGETS:
                    raise AdapterError(f"LoRA adapter {name!r}: {proj} is not a projection "
                                       f"this server adapts ({', '.join(TARGETS)})")
                t = st.get_tensor(key).to(torch.float32)
                digest.update(key.encode())
                digest.update(t.numpy().tobytes())
                pieces.setdefault((layer, proj), {})[ab] = t
    weights = {}
    for (layer, proj), ab in sorted(pieces.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"LoRA adapter {name!r}: layer {layer} {proj} lacks lora_"
                               f"{'A' if 'A' not in ab else 'B'}")
        if not 0 <= layer < model_cfg.num_layers:
            raise AdapterError(f"LoRA adapter {name!r}: layer {layer} beyond the model's "
                               f"{model_cfg.num_layers}")
        a, b = ab["A"], ab["B"]
        want_in, want_out = projection_shape(model_cfg, proj)
        if a.shape != (rank, want_in) or b.shape != (want_out, rank):
            raise AdapterError(
                f"LoRA adapter {name!r}: layer {layer} {proj} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}; a rank-{rank} adapter of this model's {proj} needs "
                f"({rank}, {want_in}) and ({want_out}, {rank}) (an adapter of another base "
                "model?)")
        weights[layer, proj] = (a.contiguous(), b.contiguous())
    if not weights:
        raise AdapterError(f"LoRA adapter {name!r}: no LoRA weights in {path}")
    return LoRAAdapter(name, str(path), rank, scaling, weights, digest.hexdigest()[:32])


def projection_shape(model_cfg, proj: str) -> tuple[int, int]:
    """(in_features, out_features) of a decoder projection of the (whole, unsplit) model."""
    h, hd = model_cfg.hidden_size, model_cfg.head_dim
    q, kv = model_cfg.num_heads * hd, model_cfg.num_kv_heads * hd
    inter = model_cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
            "qkv_proj": (h, q + 2 * kv), "gate_up_proj": (h, 2 * inter)}[proj]
