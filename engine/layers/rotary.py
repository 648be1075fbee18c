"""Rotary position embeddings (rotate-half layout), with Llama 3, linear and YaRN frequency
scaling (YaRN also scales cos and sin by its attention factor).
A layer may have its own base and scaling (ModelConfig.layer_attention: Gemma 3's local
layers); the decoder computes each distinct rotary once per forward pass.

Partial rotary (ModelConfig.rotary_dim): angle 0 (cos 1, sin 0) for the dims that do not
rotate; engine.layers.decoder orders each head's dims so that this is the model's arithmetic.

`RotaryEmbedding(positions, dtype)` computes cos and sin once per forward pass, shared by every
layer; the attention backend applies them (the triton one inside its KV-store kernel).

LongRoPE (Phi-3 / Phi-4 128K checkpoints) has two sets of per-dim factors: short ones within the
original context, long ones past it. HF's rule: a sequence longer than
original_max_position_embeddings takes the long factors at every position, and one that grows
past it during generation is computed again with them (HF's Phi-3 drops its cache there; the
scheduler recomputes the sequence). The runner marks a long sequence's positions by adding
LONG_ROPE (BatchLayout.rope_long), so that the rotary needs nothing else (CUDA graphs replay the
positions buffer). Both factor sets take LongRoPE's attention factor.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.config import ModelConfig

LONG_ROPE = 1 << 24      # added to a position: its sequence's every position uses long factors


def rope_inv_freq(cfg: ModelConfig, theta: float = 0.0, rope_scaling: tuple | None = None
                  ) -> torch.Tensor:
    """[rope_dim / 2] inverse frequencies of base `theta` (0: the model's), with the scaling
    `rope_scaling` (None: the model's) asks for."""
    d = cfg.rope_dim
    theta = theta or cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    scaling = dict(cfg.rope_scaling if rope_scaling is None else rope_scaling)
    if scaling.get("rope_type") == "linear":
        return inv / scaling["factor"]
    if scaling.get("rope_type") == "longrope":       # the short factors (long_inv_freq: long)
        return inv / torch.tensor(scaling["short_factor"], dtype=torch.float)
    if scaling.get("rope_type") == "yarn":
        return _yarn_inv_freq(inv, d, theta, scaling, cfg.max_position_embeddings)
    if scaling.get("rope_type") == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def _yarn_factor(scaling: dict, max_positions: int) -> float:
    factor = scaling.get("factor")
    return factor if factor is not None else \
        max_positions / scaling["original_max_position_embeddings"]


def _yarn_inv_freq(inv: torch.Tensor, d: int, theta: float, scaling: dict,
                   max_positions: int) -> torch.Tensor:
    """YaRN: each frequency between its extrapolated (unscaled) and interpolated (/ factor)
    value, by a linear ramp over the dims between the correction range beta_fast..beta_slow
    rotations over the original context."""
    factor = _yarn_factor(scaling, max_positions)
    original = scaling["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return (inv / factor) * (1 - extrapolate) + inv * extrapolate


def long_inv_freq(cfg: ModelConfig, theta: float = 0.0) -> torch.Tensor:
    """LongRoPE's inverse frequencies past the original context (its long factors)."""
    d = cfg.rope_dim
    inv = 1.0 / ((theta or cfg.rope_theta) ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    return inv / torch.tensor(dict(cfg.rope_scaling)["long_factor"], dtype=torch.float)


def attention_scaling(cfg: ModelConfig, rope_scaling: tuple | None = None) -> float:
    """The factor YaRN and LongRoPE scale cos and sin by (1 for the other types)."""
    scaling = dict(cfg.rope_scaling if rope_scaling is None else rope_scaling)
    if scaling.get("rope_type") not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if scaling["rope_type"] == "longrope":
        original = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or cfg.max_position_embeddings / original
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    factor = _yarn_factor(scaling, cfg.max_position_embeddings)

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(m) / mscale(m_all)) if m and m_all else mscale()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] with cos, sin [T, 1, D] (HF's arithmetic, in x's dtype)."""
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, theta: float = 0.0, rope_scaling: tuple | None = None
                 ) -> None:
        super().__init__()
        self.cfg, self.args = cfg, (theta, rope_scaling)
        self.register_buffer("inv_freq", rope_inv_freq(cfg, *self.args), persistent=False)
        self.scaling = attention_scaling(cfg, rope_scaling)
        # LongRoPE (the model's own rotary only): past this position, the long factors
        self.long_after = cfg.long_rope_after if rope_scaling is None else 0
        if self.long_after:
            self.register_buffer("long_inv_freq", long_inv_freq(cfg, theta), persistent=False)

    def init_buffers(self, device: str | torch.device) -> None:
        """Rebuild the buffers after the model was built on the meta device."""
        self.inv_freq = rope_inv_freq(self.cfg, *self.args).to(device)
        if self.long_after:
            self.long_inv_freq = long_inv_freq(self.cfg, self.args[0]).to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, D] in `dtype`, laid out as cat(freqs, freqs)."""
        if self.long_after:
            long = positions >= LONG_ROPE
            pos = torch.where(long, positions - LONG_ROPE, positions)
            inv = torch.where(long[:, None], self.long_inv_freq.float(), self.inv_freq.float())
            freqs = pos[:, None].float() * inv                             # [T, R/2]
        else:
            freqs = positions[:, None].float() * self.inv_freq.float()   # [T, R/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.scaling != 1.0:             # YaRN, LongRoPE: the rotated dims only
            cos, sin = cos * self.scaling, sin * self.scaling
        if self.cfg.rope_dim != self.cfg.head_dim:   # partial: the pass-through dims cos 1, sin 0
            pad = (self.cfg.head_dim - self.cfg.rope_dim) // 2
            cos = torch.nn.functional.pad(cos, (0, pad), value=1.0)
            sin = torch.nn.functional.pad(sin, (0, pad))
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)   # [T, D]
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]
