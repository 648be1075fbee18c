"""Build a model from an HF folder: config.json + *.safetensors."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.linear import prepack_linears
from engine.models import model_class


def _target(name: str, packed: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """Checkpoint tensor name -> (our parameter name, shard index or None)."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in packed:
        module, shard = packed[parts[-2]]
        return ".".join(parts[:-2] + [module, parts[-1]]), shard
    return name, None


def load_model(model_dir: str | Path, dtype: torch.dtype, device: str = "cpu",
               cfg: ModelConfig | None = None, pack: bool = True,
               round_to: torch.dtype | None = None) -> torch.nn.Module:
    """Construct on the meta device, then fill parameters from the safetensors files.

    Checkpoint shards of a packed parameter (q/k/v -> qkv_proj, gate/up -> gate_up_proj) are
    copied into consecutive row ranges, in shard order. Every parameter must be filled completely
    (a tied lm_head may be absent); a checkpoint tensor with no parameter is an error, except
    rotary caches some exporters add. With `round_to` (a narrower dtype than `dtype`), weights
    are rounded to it first: a bf16 model computed in fp32. With `pack`, linear layers get the CPU fast path of
    engine.linear where it applies.
    """
    d = Path(model_dir)
    cfg = cfg or ModelConfig.from_dir(d)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {d}")
    cls = model_class(cfg.family)
    with torch.device("meta"):
        model = cls(cfg)
    packed = getattr(cls, "PACKED", {})
    metas = dict(model.named_parameters())
    state = {n: torch.empty(p.shape, dtype=dtype, device=device) for n, p in metas.items()}
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                target, shard = _target(name, packed)
                if target not in state:
                    raise ValueError(f"{f.name}: unexpected tensor {name!r} for {cfg.family}")
                shards.setdefault(target, {})[0 if shard is None else shard] = st.get_tensor(name)
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    for target, parts in shards.items():
        if target in tied:
            continue
        full = torch.cat([parts[i] for i in sorted(parts)], dim=0)
        if full.shape != state[target].shape:
            raise ValueError(f"{target}: checkpoint gives {tuple(full.shape)}, model expects "
                             f"{tuple(state[target].shape)} (missing shards?)")
        state[target].copy_(full if round_to is None else full.to(round_to))
    missing = set(state) - set(shards) - tied
    if missing:
        raise ValueError(f"checkpoint in {d} lacks {sorted(missing)[:5]}")
    for name in tied:
        state.pop(name, None)
    model.load_state_dict(state, strict=False, assign=True)
    model.init_buffers(device)   # non-persistent buffers were built on the meta device
    model.tie_weights()
    if pack:
        prepack_linears(model, torch.device(device), dtype)
    return model.eval()
