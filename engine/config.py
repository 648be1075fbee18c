"""Frozen, validated configuration. Unknown keys are errors; messages say what to change."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from pdkernels import cpu_build

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# --quantization: none (a pre-quantized checkpoint's own scheme, else full precision), int8
# (weight-only, quantized at load), a pre-quantized format (must be the checkpoint's), or the
# layers of a scheme with random weights (benchmarks). See engine.layers.quant_formats.
QUANTIZATION_CHOICES = ("none", "int8", "gptq", "awq", "compressed-tensors", "w4a16", "w8a8")

# CPU flags that make a 16-bit matmul faster than fp32 (oneDNN uses them).
_NATIVE_CPU_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


def _cpu_flags() -> set[str]:
    return cpu_build.cpu_flags() or set()


def resolve_compute_dtype(dtype: str, compute_dtype: str, device: str) -> str:
    """The dtype the engine computes in (and keeps its KV cache in).

    "auto" means `dtype`, except for 16-bit dtypes on a CPU without native 16-bit matmul
    instructions: there torch's bf16/fp16 GEMMs run several times slower than fp32, so the
    weights are rounded to `dtype` (the same values a 16-bit model has) and computed in fp32.
    """
    if compute_dtype != "auto":
        if compute_dtype not in DTYPES:
            raise ValueError(f"compute_dtype must be 'auto' or one of {sorted(DTYPES)}, "
                             f"got {compute_dtype!r}")
        return compute_dtype
    if dtype == "float32" or not device.startswith("cpu"):
        return dtype
    return dtype if _cpu_flags() & set(_NATIVE_CPU_FLAGS[dtype]) else "float32"

def parse_speculative(spec: str) -> tuple[str, str | None]:
    """--speculative: "off" | "ngram" | "draft:PATH" -> (kind, path or None)."""
    if spec in ("off", "ngram"):
        return spec, None
    if spec.startswith("draft:") and len(spec) > len("draft:"):
        return "draft", spec[len("draft:"):]
    raise ValueError(f"speculative must be 'off', 'ngram' or 'draft:PATH', got {spec!r}")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward (engine.layers.moe): the router and the experts."""

    num_experts: int
    top_k: int
    intermediate_size: int            # each expert's
    layers: tuple[int, ...]           # the decoder layers that are MoE; the rest are dense MLPs
    scoring: str = "softmax"          # "softmax" | "sigmoid" (DeepSeek-style)
    norm_topk_prob: bool = False      # renormalize the k chosen weights to sum to 1
    correction_bias: bool = False     # e_score_correction_bias: added for the choice only
    n_group: int = 1                  # group-limited top-k: experts in n_group groups, the
    topk_group: int = 1               # best topk_group groups (by their top-2 sum) eligible
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0   # shared experts (one MLP) run for every token
    shared_gate: bool = False         # sigmoid(x @ shared_expert_gate) scales them (Qwen2-MoE)
    router_bias: bool = False         # the router's linear has a bias (gpt-oss)
    expert_bias: bool = False         # the experts' gate/up and down have biases (gpt-oss)
    # the experts' activation: "silu" (SwiGLU), or "swiglu_limit" (gpt-oss: gate and up
    # clamped to swiglu_limit, (up + 1) * gate * sigmoid(swiglu_alpha * gate))
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # fused 3-D expert tensors as saved: "stacked" ([E, 2I, H] gate rows then up rows, [E, H, I])
    # or "transposed_interleaved" (gpt-oss: [E, H, 2I] gate and up columns alternating, [E, I, H])
    fused_layout: str = "stacked"

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"MoE scoring must be softmax or sigmoid, got {self.scoring!r}")
        if self.activation not in ("silu", "swiglu_limit"):
            raise ValueError(f"MoE activation must be silu or swiglu_limit, got "
                             f"{self.activation!r}")
        if self.fused_layout not in ("stacked", "transposed_interleaved"):
            raise ValueError(f"unknown fused expert layout {self.fused_layout!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be in [1, "
                             f"num_experts ({self.num_experts})]")
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide the {self.num_experts} "
                             f"experts and topk_group ({self.topk_group}) be in [1, n_group]")
        if self.n_group > 1 and self.top_k > self.topk_group * self.num_experts // self.n_group:
            raise ValueError(f"top-{self.top_k} of {self.topk_group} groups of "
                             f"{self.num_experts // self.n_group} experts is impossible")


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention adds to causal GQA (0 / False: nothing)."""

    window: int = 0           # sliding: a query sees itself and the window - 1 positions before
    softcap: float = 0.0      # scores -> softcap * tanh(scores / softcap) (Gemma 2)
    sinks: bool = False       # a learned logit per head joins each softmax (gpt-oss)
    rope_theta: float = 0.0   # this layer's rotary base (0: the model's)
    rope_scaling: tuple | None = None   # this layer's rotary scaling (None: the model's)


FULL = LayerAttention()
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")     # the gated MLP's activation


@dataclass(frozen=True)
class ModelConfig:
    """What the model code needs from an HF config.json."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: tuple = ()          # sorted (key, value) pairs of HF's rope scaling dict
    eos_token_ids: tuple[int, ...] = ()
    qk_norm_across_heads: bool = False  # q/k RMSNorm over all heads at once (OLMoE, MiniMax-M2)
    o_proj_bias: bool = False
    clip_qkv: float = 0.0             # > 0: q, k, v clamped to [-clip, clip] (OLMoE)
    rotary_dim: int = 0               # partial rotary: the first rotary_dim of each head; 0: all
    moe: MoEConfig | None = None      # the MoE layers; None: a dense model
    layer_attention: tuple[LayerAttention, ...] = ()   # per layer; () every layer FULL
    query_scale: float = 0.0          # scores' scale (0: head_dim ** -0.5)
    final_logit_softcap: float = 0.0  # logits -> cap * tanh(logits / cap) (Gemma 2)
    hidden_act: str = "silu"          # ACTIVATIONS

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary dims must be even and at most head_dim ({self.head_dim}), "
                             f"got {self.rotary_dim}")
        if self.layer_attention and len(self.layer_attention) != self.num_layers:
            raise ValueError(f"{len(self.layer_attention)} layers' attention for "
                             f"{self.num_layers} layers")
        allowed = ACTIVATIONS if self.moe is None else ("silu",)   # MoE experts: SwiGLU
        if self.hidden_act not in allowed:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported for {self.family} "
                             f"({', '.join(allowed)} is)")

    def attention_of(self, layer: int) -> LayerAttention:
        return self.layer_attention[layer] if self.layer_attention else FULL

    @property
    def long_rope_after(self) -> int:
        """LongRoPE: the original context (original_max_position_embeddings) past which its
        long factors apply (engine.layers.rotary); 0: not LongRoPE."""
        scaling = dict(self.rope_scaling)
        if scaling.get("rope_type") != "longrope":
            return 0
        return int(scaling["original_max_position_embeddings"])

    @property
    def rope_dim(self) -> int:
        """Dims of each head that rotary embeddings rotate."""
        return self.rotary_dim or self.head_dim

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and i in self.moe.layers

    @classmethod
    def from_hf(cls, hf: dict, generation: dict | None = None) -> "ModelConfig":
        """The fields every family shares, then the family's own (its `config` function in
        engine.models, the registry from HF `architectures`)."""
        from engine.models import family_for

        family = family_for(hf.get("architectures") or [])
        act = hf.get("hidden_act") or hf.get("hidden_activation") or "silu"
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        if "full_attention" in rope:          # per layer type (Gemma 3): the global layers'
            rope = dict(rope["full_attention"])
        theta = hf.get("rope_theta", rope.pop("rope_theta", 10000.0))
        rope.pop("rope_theta", None)
        partial = rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        rope_scaling = rope_scaling_of(rope, hf.get("original_max_position_embeddings")
                                       or hf.get("max_position_embeddings", 2048))
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        eos = []
        for src in (generation or {}, hf):
            ids = src.get("eos_token_id")
            for i in ([ids] if isinstance(ids, int) else ids or []):
                if i not in eos:
                    eos.append(int(i))
        common = dict(
            family=family.name,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf.get("intermediate_size") or 0,
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            rope_scaling=rope_scaling,
            eos_token_ids=tuple(eos),
            rotary_dim=0 if partial == 1.0 else int(head_dim * partial),
            hidden_act=act,
        )
        return cls(**dict(common, **family.config(hf)))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        d = Path(model_dir)
        hf = json.loads((d / "config.json").read_text())
        gen_path = d / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
        return cls.from_hf(hf, gen)


ROPE_TYPES = ("default", "llama3", "linear", "yarn", "longrope")


def rope_scaling_of(rope: dict, max_position_embeddings: int = 0) -> tuple:
    """HF rope parameters (without rope_theta) -> ModelConfig.rope_scaling: () for the default
    rotary, else sorted (key, value) pairs; a type not implemented is refused by name. Scaled
    types without original_max_position_embeddings take max_position_embeddings (as HF does)."""
    rope = {k: tuple(v) if isinstance(v, list) else v for k, v in rope.items()
            if k not in ("rope_theta", "partial_rotary_factor")}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "su":                   # LongRoPE's first name (early Phi-3 configs)
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
    if rope_type == "default":
        return ()
    if rope_type in ("llama3", "yarn", "longrope") and max_position_embeddings:
        rope.setdefault("original_max_position_embeddings", max_position_embeddings)
    return tuple(sorted((k, v) for k, v in dict(rope, rope_type=rope_type).items()
                        if k != "type"))


def sliding_layers(hf: dict) -> list[bool]:
    """Which layers slide: HF's `layer_types` where the config lists them; else Gemma 3's
    `sliding_window_pattern` (every pattern-th layer global), or, when sliding_window is set
    and use_sliding_window does not turn it off, the layers from max_window_layers on (Qwen2;
    every layer for Mistral)."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types:
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"layer types {sorted(unknown)} are not supported")
        return [t == "sliding_attention" for t in types[:n]]
    if not hf.get("sliding_window") or not hf.get("use_sliding_window", True):
        return [False] * n
    if hf.get("sliding_window_pattern"):
        return [bool((i + 1) % hf["sliding_window_pattern"]) for i in range(n)]
    first = hf.get("max_window_layers", 0) if "use_sliding_window" in hf else 0
    return [i >= first for i in range(n)]


def sliding_config(hf: dict, **per_layer) -> dict:
    """ModelConfig fields for a checkpoint whose layers may slide: layer_attention with each
    sliding layer's window (and `per_layer` LayerAttention fields for every layer, and
    `local_rope` (theta, scaling) for the sliding ones); {} when nothing differs by layer."""
    local_rope = per_layer.pop("local_rope", None)
    slide = sliding_layers(hf)
    if not any(slide) and not per_layer:
        return {}
    window = int(hf.get("sliding_window") or 0)
    specs = []
    for s in slide:
        extra = dict(per_layer)
        if s and local_rope is not None:
            extra["rope_theta"], extra["rope_scaling"] = local_rope
        specs.append(LayerAttention(window=window if s else 0, **extra))
    return dict(layer_attention=tuple(specs))


# CPU paths a worker can be forced onto (auto: what measured fastest on the host's kind):
# the linear layers' (engine.layers.linear.linear_method_for) and the torch attention backend's
# for decodes and short queries (engine.attention.torch_backend.use_cpu_kernel).
LINEAR_METHODS = ("auto", "avx2", "avx512", "amx", "onednn", "torch")
CPU_ATTENTION = ("auto", "avx2", "sdpa")
MOE_BACKENDS = ("auto", "reference", "grouped", "triton")   # engine.layers.moe


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs. `num_blocks` 0: on CUDA, sized from gpu_memory_utilization when the
    engine starts; elsewhere it must be given."""

    role: str = "decode"                 # "prefill": finish after the first token, keep blocks
    dtype: str = "float32"               # the model's weights are rounded to this
    compute_dtype: str = "auto"          # activations and KV cache; see resolve_compute_dtype
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int = 0
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 0               # 0: the model's max_position_embeddings
    long_prefill_tokens: int = 0         # chunk cap while others wait; 0: a quarter of the budget
    enable_prefix_caching: bool = True
    hash_seed: int = 0                   # block hash seed; the same on every worker
    speculative: str = "off"             # "off", "ngram" or "draft:PATH" (engine.spec)
    num_speculative_tokens: int = 16     # most proposals verified per sequence and step
    spec_ngram_min: int = 1              # n-gram prompt lookup: shortest and longest match
    spec_ngram_max: int = 4
    spec_disable_batch_size: int = 0     # > 0: no speculation while more sequences decode
    spec_max_step_growth: float = 0.1    # a step's expected time grows by at most this share
    attention_backend: str = "auto"      # "torch", "triton"; auto: triton on CUDA, else torch
    cpu_attention: str = "auto"          # CPU_ATTENTION: the torch backend's CPU path
    linear_method: str = "auto"          # LINEAR_METHODS: force a CPU linear path
    enforce_eager: bool = False          # no CUDA graphs for decode-only steps
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory this engine may use
    max_request_kv_share: float = 1.0    # most of the KV pool one request (all choices) may need
    quantization: str = "none"           # QUANTIZATION_CHOICES; none: the checkpoint's own
    tensor_parallel_size: int = 1        # ranks the model is split over (engine.parallel)
    expert_parallel: bool = False        # MoE experts split whole over those ranks
    moe_backend: str = "auto"            # engine.layers.moe.MOE_BACKENDS
    kv_offload_gib: float = 0.0          # host-memory tier below the pool (engine.kv_offload)
    kv_offload_dir: str = ""             # local-disk tier's folder (with kv_offload_disk_gib)
    kv_offload_disk_gib: float = 0.0
    kv_offload_min_seen: int = 1         # a block is kept in a tier once seen this many times
    enable_lora: bool = False            # serve LoRA adapters (engine.lora)
    max_loras: int = 4                   # adapters one step may use (device slots)
    max_lora_rank: int = 16              # the highest adapter rank the slots hold

    def __post_init__(self) -> None:
        if self.enable_lora and (self.max_loras < 1 or self.max_lora_rank < 1):
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {self.role!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        object.__setattr__(self, "compute_dtype",
                           resolve_compute_dtype(self.dtype, self.compute_dtype, self.device))
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.num_blocks < 0 or self.max_model_len < 0 or self.long_prefill_tokens < 0:
            raise ValueError("num_blocks, max_model_len and long_prefill_tokens must be >= 0")
        parse_speculative(self.speculative)
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError("num_speculative_tokens must be in [1, 32], got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.spec_ngram_min <= self.spec_ngram_max:
            raise ValueError(f"n-gram sizes need 1 <= spec_ngram_min <= spec_ngram_max, got "
                             f"{self.spec_ngram_min}, {self.spec_ngram_max}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {self.quantization!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.moe_backend not in MOE_BACKENDS:
            raise ValueError(f"moe_backend must be one of {', '.join(MOE_BACKENDS)}, got "
                             f"{self.moe_backend!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError("attention_backend must be 'auto', 'torch' or 'triton', got "
                             f"{self.attention_backend!r}")
        if self.cpu_attention not in CPU_ATTENTION:
            raise ValueError(f"cpu_attention must be one of {', '.join(CPU_ATTENTION)}, got "
                             f"{self.cpu_attention!r}")
        if self.linear_method not in LINEAR_METHODS:
            raise ValueError(f"linear_method must be one of {', '.join(LINEAR_METHODS)}, got "
                             f"{self.linear_method!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.spec_disable_batch_size < 0:
            raise ValueError("spec_disable_batch_size must be >= 0 (0: decided by cost)")
        if self.spec_max_step_growth < 0:
            raise ValueError("spec_max_step_growth must be >= 0 (0: no bound), got "
                             f"{self.spec_max_step_growth}")
        self._check_offload()
        if not 0 < self.max_request_kv_share <= 1:
            raise ValueError("max_request_kv_share must be in (0, 1], got "
                             f"{self.max_request_kv_share}")

    def _check_offload(self) -> None:
        if self.kv_offload_gib < 0 or self.kv_offload_disk_gib < 0:
            raise ValueError("kv_offload_gib and kv_offload_disk_gib must be >= 0")
        if bool(self.kv_offload_dir) != (self.kv_offload_disk_gib > 0):
            raise ValueError("the disk tier needs both kv_offload_dir and kv_offload_disk_gib")
        if self.kv_offload_min_seen < 1:
            raise ValueError("kv_offload_min_seen must be >= 1")
        if self.offload_enabled and not self.enable_prefix_caching:
            raise ValueError("the KV offload tiers need the prefix cache (they are keyed by its "
                             "block hashes): drop --no-prefix-cache or the offload flags")
        if self.offload_enabled and self.tensor_parallel_size > 1:
            raise ValueError("the KV offload tiers are not implemented with tensor parallelism "
                             "yet: drop --kv-offload-gib / --kv-offload-dir or use "
                             "--tensor-parallel-size 1")

    @property
    def offload_enabled(self) -> bool:
        return self.kv_offload_gib > 0 or self.kv_offload_disk_gib > 0

    @property
    def long_prefill_cap(self) -> int:
        return self.long_prefill_tokens or max(self.max_num_batched_tokens // 4, 1)

    @property
    def torch_dtype(self) -> torch.dtype:
        """What the engine computes in and stores KV as."""
        return DTYPES[self.compute_dtype]

    @property
    def weight_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown engine config keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)


def kv_bytes_per_block(model: ModelConfig, engine: EngineConfig) -> int:
    """Bytes one block takes across its layer planes (K and V) on one rank: its own KV heads
    under tensor parallelism (engine.parallel.head_range)."""
    from engine.parallel import head_range

    elem = torch.empty((), dtype=engine.torch_dtype).element_size()
    from engine.kv_groups import of_engine

    heads = head_range(model.num_kv_heads, engine.tensor_parallel_size, 0)[1]
    slots = of_engine(model, engine).slots         # layer planes of a block (engine.kv_groups)
    return 2 * slots * engine.block_size * heads * model.head_dim * elem


def blocks_for_gib(model: ModelConfig, engine: EngineConfig, gib: float) -> int:
    n = int(gib * (1 << 30)) // kv_bytes_per_block(model, engine)
    if n < 1:
        raise ValueError(f"{gib} GiB holds no KV block of {kv_bytes_per_block(model, engine)} "
                         "bytes; raise --kv-cache-gib")
    return n


__all__ = ["MoEConfig", "DTYPES", "LINEAR_METHODS", "CPU_ATTENTION", "resolve_compute_dtype", "parse_speculative", "ModelConfig", "EngineConfig", "kv_bytes_per_block", "blocks_for_gib"]
