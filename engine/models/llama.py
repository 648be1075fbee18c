"""Llama-family decoder (Llama, Qwen2, Qwen3) over a paged KV cache.

Parameter names mirror the HF checkpoints, so safetensors load without renaming (q/k/v and
gate/up are merged at load: PACKED). Family differences are ModelConfig flags:
`attention_bias` (Qwen2's q/k/v bias) and `qk_norm` (Qwen3's per-head RMSNorm on q and k before
rotary). The layers come from engine.layers; the residual stream runs through every norm, so the
add and the norm are one step (one kernel on GPUs).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers import LayerOptions
from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention
from engine.layers.embedding import VocabParallelEmbedding
from engine.layers.linear import ColumnParallelLinear, MergedLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.parallel import head_range


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, opts: LayerOptions) -> None:
        super().__init__()
        tp, d = opts.tp, cfg.head_dim
        q_first, self.num_heads = head_range(cfg.num_heads, tp.size, tp.rank)
        kv_first, self.num_kv_heads = head_range(cfg.num_kv_heads, tp.size, tp.rank)
        self.head_dim = d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        kv_rows = (kv_first * d, self.kv_size)       # this rank's rows of k_proj and v_proj
        self.qkv_proj = MergedLinear(cfg.hidden_size,
                                     [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d],
                                     cfg.attention_bias, opts.linear, tp,
                                     splits=[(q_first * d, self.q_size), kv_rows, kv_rows])
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, False, opts.linear, tp)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, opts.kernels)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, opts.kernels)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, opts.attention)

    def forward(self, x: torch.Tensor, rope, cache: torch.Tensor, meta) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)                     # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)                  # [T, KVH, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)                  # [T, KVH, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(self.attn(q, k, v, rope, cache, meta))        # [T, hidden]


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, opts: LayerOptions) -> None:
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [i, i], False, opts.linear, opts.tp)
        self.act = SiluAndMul(opts.kernels)
        self.down_proj = RowParallelLinear(i, cfg.hidden_size, False, opts.linear, opts.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))           # [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, opts: LayerOptions) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, opts)
        self.mlp = LlamaMLP(cfg, opts)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts.kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts.kernels)

    def forward(self, x, residual, rope, cache, meta):
        """x: the previous layer's output, residual: the stream before it (None at layer 0).
        Returns this layer's output and the stream before it."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, opts: LayerOptions) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, opts.tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, opts) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts.kernels)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], kv [L, 2, N, bs, KVH, D], meta) -> hidden [T, hidden]."""

    # checkpoint module name -> (our merged module, shard index)
    PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, opts: LayerOptions) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, opts)
        self.rotary = RotaryEmbedding(cfg)
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, False,
                                            opts.head_linear, opts.tp)

    def init_buffers(self, device: str | torch.device) -> None:
        self.rotary.init_buffers(device)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
                meta) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)                           # [T, hidden]
        rope = self.rotary(positions, x.dtype)                           # cos, sin [T, 1, D]
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, rope, kv[i], meta)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, vocab] in float32."""
        return self.lm_head.gather(self.lm_head(hidden)).float()
