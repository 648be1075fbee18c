"""Build a model from an HF folder (config.json + *.safetensors), or with random weights.

The model is constructed on the meta device, its parameters are then allocated on the target
device and filled tensor by tensor: each checkpoint tensor goes to the module that owns its
parameter, whose `weight_loader(param, tensor, shard)` decides where it lands (the shard of a
merged q/k/v or gate/up projection, a tensor-parallel rank's slice). Checkpoint tensors are
handed over unread (`CheckpointTensor`): a loader reads only the rows or columns its rank holds,
so no rank ever holds a full copy. Every parameter must be filled completely; then each layer's
method prepares its weights once (`process_weights_after_loading`: the CPU kernels' packed
layouts, quantization). A pre-quantized checkpoint's projections (GPTQ, AWQ, compressed-tensors)
are converted to the layers' int8 weight and scales one projection at a time, then sharded by
the same loaders.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.config import ModelConfig
from engine.layers import LayerOptions
from engine.layers.linear import materialize
from engine.layers.quant_formats import QuantScheme, canonical_tensors
from engine.models import model_class

log = logging.getLogger(__name__)


class CheckpointTensor:
    """A safetensors tensor not yet read: `shape`, `narrow(dim, start, length)` (reads that
    slice only) and `load()` (all of it), rounded to `round_to` when given."""

    def __init__(self, st, name: str, round_to: torch.dtype | None = None) -> None:
        self._st, self._name = st, name
        self._slice = st.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())
        self.round_to = round_to

    def _done(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.round_to is None else t.to(self.round_to)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * dim + [slice(start, start + length)]
        return self._done(self._slice[tuple(index)])

    def load(self) -> torch.Tensor:
        return self._done(self._st.get_tensor(self._name))


def build_empty(cfg: ModelConfig, opts: LayerOptions, dtype: torch.dtype,
                device: str | torch.device) -> nn.Module:
    """The model with uninitialized parameters of `dtype` on `device` (built on meta first)."""
    cls = model_class(cfg.family)
    with torch.device("meta"):
        model = cls(cfg, opts).to(dtype)
        for m in model.modules():             # quantization scales stay float32
            for name in getattr(m, "float32_params", ()):
                getattr(m, name).data = getattr(m, name).data.float()
    model.to_empty(device=device)
    model.init_buffers(device)   # non-persistent buffers were built on the meta device
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (packed and quantized weights too), each
    storage counted once (tied weights)."""
    seen: dict[object, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "meta":
            continue
        if t.is_mkldnn:              # oneDNN's packed layout: opaque, no storage to read
            seen[("opaque", id(t))] = t.nbytes
        else:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def finish(model: nn.Module) -> nn.Module:
    """Tie weights and let every layer prepare its loaded weights (packing, quantizing); the log
    says the weights' memory before and after."""
    model.tie_weights()
    before = weight_bytes(model)
    methods = sorted({m.method.name for m in model.modules() if hasattr(m, "method")})
    for m in list(model.modules()):          # (an MoE layer's backend adds modules)
        if hasattr(m, "process_weights_after_loading"):
            m.process_weights_after_loading()
    log.info("weights: %.1f MiB as loaded, %.1f MiB prepared (linear layers: %s)",
             before / 2**20, weight_bytes(model) / 2**20, ", ".join(methods) or "none")
    return model.eval()


def _loader(model: nn.Module, name: str):
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    loader = getattr(module, "weight_loader", None)
    param = getattr(module, attr)
    if loader is None:                       # a replicated parameter (norms)
        def loader(p, loaded, shard=None):
            if shard is not None or tuple(loaded.shape) != tuple(p.shape):
                raise ValueError(f"checkpoint gives {tuple(loaded.shape)}, model expects "
                                 f"{tuple(p.shape)}")
            p.data.copy_(materialize(loaded))
    return param, loader


def checkpoint_files(d: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, when it has one (some repos
    also ship the original trainer's `consolidated*.safetensors`, other names for the same
    weights), else every one but those."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        import json
        names = set(json.loads(index.read_text()).get("weight_map", {}).values())
        return sorted(d / n for n in names)
    return sorted(f for f in d.glob("*.safetensors") if not f.name.startswith("consolidated"))


def load_model(model_dir: str | Path, dtype: torch.dtype, device: str | torch.device,
               cfg: ModelConfig, opts: LayerOptions,
               round_to: torch.dtype | None = None,
               scheme: QuantScheme | None = None) -> nn.Module:
    """A model from `model_dir` computing in `dtype` on `device`. With `round_to` (a narrower
    dtype than `dtype`), weights are rounded to it first: a bf16 model computed in fp32. With
    `scheme` (a pre-quantized checkpoint's), each quantized projection's tensors are converted
    to the layers' int8 weight and scales first (engine.layers.quant_formats). A tied lm_head
    may be absent from the checkpoint; a checkpoint tensor with no parameter is an error, except
    the ones the model's `checkpoint_target` names unused (rotary caches some exporters add,
    next-token-prediction layers)."""
    d = Path(model_dir)
    files = checkpoint_files(d)
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {d}")
    model = build_empty(cfg, opts, dtype, device)
    params = dict(model.named_parameters())
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    filled: dict[str, set[int | None]] = {}
    with ExitStack() as stack:
        where: dict[str, tuple] = {}              # checkpoint name -> (open file, its name)
        for f in files:
            st = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            where.update((name, (st, f.name)) for name in st.keys())
        names = [n for n in where if model.checkpoint_target(n)[0] is not None]
        tensors = (canonical_tensors(scheme, names, lambda n: where[n][0].get_tensor(n))
                   if scheme is not None else ((n, None) for n in names))
        for name, tensor in tensors:
            target, shard = model.checkpoint_target(name)
            if target in tied:
                continue
            st, fname = where.get(name, (None, "checkpoint"))
            if (scheme is not None and target not in params and name.endswith(".bias")
                    and tensor is None and not st.get_tensor(name).any()):
                continue          # the zero bias some GPTQ writers store for every projection
            if target not in params:
                raise ValueError(f"{fname}: unexpected tensor {name!r} for {cfg.family}"
                                 + (f" quantized as {scheme.format}" if scheme else ""))
            param, loader = _loader(model, target)
            if tensor is None and param.dtype == torch.int8:
                raise ValueError(f"{fname}: {name!r} is stored unquantized, but {target} is a "
                                 f"{scheme.name} layer (only lm_head may stay unquantized)")
            if tensor is not None and tensor.dtype == torch.int8 and param.dtype != torch.int8:
                raise ValueError(f"{name}: {target} is quantized in this checkpoint; only "
                                 "full-precision lm_head and embeddings are supported")
            module_name, _, attr = target.rpartition(".")
            keep = attr in getattr(model.get_submodule(module_name), "float32_params", ())
            loaded = tensor if tensor is not None else CheckpointTensor(
                st, name, None if keep else round_to)   # float32 parameters are not rounded
            try:
                loader(param, loaded, shard)
            except ValueError as exc:
                raise ValueError(f"{target}: {exc}") from None
            filled.setdefault(target, set()).add(shard)
    for name, shards in filled.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if hasattr(module, "expected_shards"):
            want = module.expected_shards(attr, shards)
        else:
            want = len(getattr(module, "output_sizes", [None])) if None not in shards else 1
        if len(shards) != want:
            raise ValueError(f"{name}: {len(shards)} of {want} shards in the checkpoint "
                             "(missing shards?)")
    missing = set(params) - set(filled) - tied
    if missing:
        raise ValueError(f"checkpoint in {d} lacks {sorted(missing)[:5]}")
    return finish(model)


def random_model(cfg: ModelConfig, opts: LayerOptions, dtype: torch.dtype,
                 device: str | torch.device, seed: int = 0, std: float = 0.02) -> nn.Module:
    """A model with random weights (normal(0, std); norms 1): shapes of a real model without
    its files, for benchmarks and device checks. Tensor parallel: each rank draws its own shards
    (seed per rank), so replicated KV heads differ between ranks: a speed check, not a model."""
    model = build_empty(cfg, opts, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            module = model.get_submodule(name.rpartition(".")[0])
            qmax = getattr(module, "qmax", None)
            if "norm" in name:
                p.fill_(1.0)
            elif qmax is not None and name.endswith(".weight"):   # integer weights, uniform
                p.random_(-qmax, qmax + 1, generator=gen)
            elif qmax is not None and name.endswith(".weight_scale"):
                p.fill_(std * 3 ** 0.5 / qmax)                 # the weights' std stays `std`
            else:
                p.normal_(0.0, std, generator=gen)
    return finish(model)
