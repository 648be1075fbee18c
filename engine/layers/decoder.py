"""The decoder stack every family here composes: GQA attention, a gated MLP or an MoE layer
(engine.layers.moe), pre-norms with the residual carried through them, and the causal LM
around them (embeddings, final norm, vocabulary-parallel head).

A family file (engine.models) picks the pieces per layer (`DecoderLM.make_mlp`) and maps its
checkpoint's names to ours (`DecoderLM.checkpoint_target`); what differs between the attention
layers of these families is a ModelConfig flag:
- `attention_bias` (q/k/v biases), `o_proj_bias`;
- `qk_norm` (RMSNorm per head on q and k, Qwen3) or `qk_norm_across_heads` (one RMSNorm over all
  heads' q, another over all k, OLMoE and MiniMax-M2: under tensor parallelism the sum of
  squares is all-reduced);
- `clip_qkv` (q, k, v clamped);
- `rotary_dim` (partial rotary: the first rotary_dim dims of a head rotate, rotate-half within
  them). The backends rotate whole heads by the cos/sin they are given, so q and k enter them
  with their dims permuted (`partial_rotary_perm`) so that rotate-half over the head pairs the
  rotated dims as the model does, and the pass-through dims meet cos 1 and sin 0. q.k is the
  same under one permutation of both, V is not permuted: the output is unchanged.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers import LayerOptions
from engine.layers.attention import Attention
from engine.layers.embedding import VocabParallelEmbedding
from engine.layers.linear import ColumnParallelLinear, MergedLinear, RowParallelLinear
from engine.layers.mlp import GatedMLP
from engine.layers.moe import MoE
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.parallel import SINGLE, TPGroup, head_range


def partial_rotary_perm(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """[head_dim] the order of a head's dims as the backends see them: the rotated halves at
    0 and head_dim / 2, the pass-through dims filling the rest of each half."""
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first, second = torch.arange(r), torch.arange(r, 2 * r)
    passed = torch.arange(rotary_dim, head_dim)
    return torch.cat([first, passed[:p], second, passed[p:]])


class AcrossHeadsRMSNorm(nn.Module):
    """RMSNorm over all heads of q (or k) at once: the weight [heads * D] is split by the
    heads this rank holds; the mean of squares is over the whole model's width (all-reduced
    under tensor parallelism; a KV head held by `replicas` ranks is counted once)."""

    def __init__(self, first_head: int, heads: int, total_heads: int, head_dim: int, eps: float,
                 tp: TPGroup = SINGLE, replicas: int = 1) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads * head_dim), requires_grad=False)
        self.rows = (first_head * head_dim, heads * head_dim)
        self.full = total_heads * head_dim
        self.eps, self.tp, self.replicas = eps, tp, replicas

    def weight_loader(self, param: nn.Parameter, loaded, shard=None) -> None:
        if tuple(loaded.shape) != (self.full,):
            raise ValueError(f"checkpoint gives {tuple(loaded.shape)}, model expects "
                             f"({self.full},)")
        param.data.copy_(loaded.narrow(0, *self.rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads * D] (this rank's heads) -> normed, in x's dtype (HF's arithmetic)."""
        dtype, xf = x.dtype, x.float()
        if self.tp.size == 1:
            var = xf.pow(2).mean(-1, keepdim=True)
        else:
            var = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True)) / (self.full * self.replicas)
        return self.weight * (xf * torch.rsqrt(var + self.eps)).to(dtype)


class GQAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, opts: LayerOptions, layer: int = 0,
                 norm_cls=RMSNorm) -> None:
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
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, cfg.o_proj_bias,
                                        opts.linear, tp)
        self.qk_norm = "head" if cfg.qk_norm else "all" if cfg.qk_norm_across_heads else None
        if self.qk_norm == "head":
            self.q_norm = norm_cls(cfg.head_dim, cfg.rms_norm_eps, opts.kernels)
            self.k_norm = norm_cls(cfg.head_dim, cfg.rms_norm_eps, opts.kernels)
        elif self.qk_norm == "all":
            kv_replicas = max(tp.size // cfg.num_kv_heads, 1)
            self.q_norm = AcrossHeadsRMSNorm(q_first, self.num_heads, cfg.num_heads, d,
                                             cfg.rms_norm_eps, tp)
            self.k_norm = AcrossHeadsRMSNorm(kv_first, self.num_kv_heads, cfg.num_kv_heads, d,
                                             cfg.rms_norm_eps, tp, kv_replicas)
        self.clip = cfg.clip_qkv
        self.perm, self._perm_args = None, None
        if cfg.rope_dim != d:
            self._perm_args = (d, cfg.rope_dim)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, opts.attention,
                              cfg.attention_of(layer), cfg.query_scale, q_first, cfg.num_heads)

    def init_buffers(self, device) -> None:
        if self._perm_args is not None:
            self.perm = partial_rotary_perm(*self._perm_args).to(device)

    def forward(self, x: torch.Tensor, rope, cache: torch.Tensor, meta) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "all":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip:
            q, k, v = (z.clamp(-self.clip, self.clip) for z in (q, k, v))
        q = q.view(t, self.num_heads, self.head_dim)                     # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)                  # [T, KVH, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)                  # [T, KVH, D]
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.perm is not None:
            q, k = q.index_select(-1, self.perm), k.index_select(-1, self.perm)
        return self.o_proj(self.attn(q, k, v, rope, cache, meta))        # [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, opts: LayerOptions, mlp: nn.Module, layer: int = 0
                 ) -> None:
        super().__init__()
        self.self_attn = GQAAttention(cfg, opts, layer)
        self.mlp = mlp
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


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, opts: LayerOptions, make_mlp, layer_cls=DecoderLayer,
                 norm_cls=RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, opts.tp)
        self.layers = nn.ModuleList(layer_cls(cfg, opts, make_mlp(cfg, opts, i), i)
                                    for i in range(cfg.num_layers))
        self.norm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps, opts.kernels)


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                "down_proj": "down", "w2": "down"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DecoderLM(nn.Module):
    """forward(input_ids [T], positions [T], kv [L, 2, N, bs, KVH, D], meta) -> hidden [T, hidden].

    Parameter names mirror the HF checkpoints (q/k/v and gate/up merged at load: PACKED;
    experts stacked: engine.layers.moe), so most tensors load without renaming. A family
    overrides `make_mlp` (which layers are MoE) and may add `RENAMES` (checkpoint prefix ->
    ours)."""

    # checkpoint module name -> (our merged module, shard index)
    PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    RENAMES: dict[str, str] = {}     # substring of a checkpoint name -> ours
    LAYER = DecoderLayer             # the decoder layer (a family may arrange its norms)
    NORM = RMSNorm                   # the final norm
    EXTRA_LAYERS = False             # the checkpoint has next-token-prediction layers past the
    #                                  decoder's (unused here)

    def __init__(self, cfg: ModelConfig, opts: LayerOptions) -> None:
        super().__init__()
        self.config = cfg
        cls = type(self)
        self.model = DecoderModel(cfg, opts, cls.make_mlp, cls.LAYER, cls.NORM)
        self.rotary = RotaryEmbedding(cfg)
        # layers with a rotary of their own (a base or scaling other than the model's): each
        # distinct one computed once per forward pass
        own = [(a.rope_theta, a.rope_scaling) for a in map(cfg.attention_of, range(cfg.num_layers))]
        distinct = sorted({k for k in own if k != (0.0, None)}, key=repr)
        self.rotaries = nn.ModuleList(RotaryEmbedding(cfg, *k) for k in distinct)
        self._rope_of = [0 if k == (0.0, None) else 1 + distinct.index(k) for k in own]
        # (KV group, pool plane) of each layer (engine.kv_groups; set by the runner): None,
        # layer i in plane i of group 0
        self.kv_placement: list[tuple[int, int]] | None = None
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, False,
                                            opts.head_linear, opts.tp)

    @staticmethod
    def make_mlp(cfg: ModelConfig, opts: LayerOptions, layer: int) -> nn.Module:
        """Layer `layer`'s feed-forward: an MoE layer where the config says so, else dense."""
        if cfg.is_moe_layer(layer):
            return MoE(cfg, opts)
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, opts, act=cfg.hidden_act)

    def checkpoint_target(self, name: str) -> tuple[str | None, object]:
        """Checkpoint tensor name -> (our parameter name, shard), or (None, None) for a tensor
        this model does not use (rotary caches, multi-token-prediction layers)."""
        cls = type(self)
        for old, new in cls.RENAMES.items():
            name = name.replace(old, new)
        if name.endswith("rotary_emb.inv_freq"):
            return None, None
        if cls.EXTRA_LAYERS:
            m = _LAYER.match(name)
            if m is not None and int(m[1]) >= self.config.num_layers:
                return None, None
        m = _EXPERT.match(name)
        if m:
            param = "gate_up_proj" if _EXPERT_PART[m[3]] != "down" else "down_proj"
            return f"{m[1]}.{param}", (int(m[2]), _EXPERT_PART[m[3]])
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in cls.PACKED:
            module, shard = cls.PACKED[parts[-2]]
            return ".".join(parts[:-2] + [module, parts[-1]]), shard
        return name, None

    def init_buffers(self, device: str | torch.device) -> None:
        """Rebuild every layer's non-persistent buffers (rotary, partial-rotary orders, MoE
        counts) after the model was built on the meta device."""
        for m in self.modules():
            if m is not self and hasattr(m, "init_buffers"):
                m.init_buffers(device)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
                meta) -> torch.Tensor:
        x = self.embed(input_ids)                                        # [T, hidden]
        ropes = [self.rotary(positions, x.dtype)]                        # cos, sin [T, 1, D]
        ropes += [r(positions, x.dtype) for r in self.rotaries]
        residual = None
        place = self.kv_placement
        for i, layer in enumerate(self.model.layers):
            g, slot = place[i] if place else (0, i)
            x, residual = layer(x, residual, ropes[self._rope_of[i]], kv[slot], meta[g])
        x, _ = self.model.norm(x, residual)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, vocab] in float32 (soft-capped where the model
        says)."""
        logits = self.lm_head.gather(self.lm_head(hidden)).float()
        cap = self.config.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
