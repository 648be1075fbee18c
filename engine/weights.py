"""Build a model from an HF folder: config.json + *.safetensors."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.models import model_class


def load_model(model_dir: str | Path, dtype: torch.dtype, device: str = "cpu",
               cfg: ModelConfig | None = None) -> torch.nn.Module:
    """Construct on the meta device, then assign tensors read from the safetensors files.

    Every parameter must be found in the checkpoint (a tied lm_head may be absent); checkpoint
    tensors with no parameter are errors, except rotary caches some exporters add.
    """
    d = Path(model_dir)
    cfg = cfg or ModelConfig.from_dir(d)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {d}")
    with torch.device("meta"):
        model = model_class(cfg.family)(cfg)
    params = dict(model.named_parameters())
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if name not in params:
                    raise ValueError(f"{f.name}: unexpected tensor {name!r} for {cfg.family}")
                state[name] = st.get_tensor(name).to(device=device, dtype=dtype)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing = set(params) - set(state) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if missing:
        raise ValueError(f"checkpoint in {d} lacks {sorted(missing)[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    model.init_buffers(device)   # non-persistent buffers were built on the meta device
    model.tie_weights()
    return model.eval()
