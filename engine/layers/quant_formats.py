"""Pre-quantized checkpoint formats, read into one form: integer weights q [N, K] (the stored
value minus its zero point: W = q * scale) and scales [N, K / group], with a torch reference of
the grouped matmul. Engine layers load this form (see the loader seam in engine.layers.linear);
each function names the published layout it reads.

Packing shared by the formats: an int32 holds 32 / bits values, the first in the lowest bits.
- GPTQ (AutoGPTQ / GPTQModel): qweight I32 [K * bits / 32, N] packed along K, qzeros I32
  [K / G, N * bits / 32] packed along N, scales [K / G, N], g_idx [K]. Version 1
  (checkpoint_format "gptq") stores each zero minus 1, word by word (a zero of 0 borrows from
  the next field): adding 0x11..1 to the whole word (mod 2^32) gives the zeros back exactly.
- AWQ (GEMM): qweight I32 [K, N / 8] packed along N in the order [0, 2, 4, 6, 1, 3, 5, 7]
  (column 8c + j sits in field [0, 4, 1, 5, 2, 6, 3, 7][j]), qzeros [K / G, N / 8] likewise,
  stored as they are, scales [K / G, N].
- compressed-tensors pack-quantized (W4A16): weight_packed I32 [N, K * bits / 32] packed along
  K, signed values stored plus 2^(bits - 1); weight_scale [N, K / G]; weight_shape [N, K];
  weight_zero_point (asymmetric) packed along N, [N * bits / 32, K / G]. int-quantized (W8A8):
  weight int8 [N, K], weight_scale [N, 1]; activations quantized per token when they are used.

`QuantScheme.from_hf` reads a checkpoint's quantization_config (what the layers are built
with); `canonical_tensors` turns a checkpoint's tensors into the names the layers load:
`<proj>.weight` (int8 q) and `<proj>.weight_scale` (float32), one projection at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

AWQ_FIELD = (0, 4, 1, 5, 2, 6, 3, 7)      # field of column 8c + j in an AWQ word


def unpack_int32(packed: torch.Tensor, bits: int, dim: int,
                 fields: tuple[int, ...] | None = None) -> torch.Tensor:
    """The unsigned values of int32 words, 32 / bits per word, unpacked along `dim` (0 or 1 of a
    2-D tensor): value j of a word is field fields[j] (default j), field i at bits
    [bits * i, bits * (i + 1))."""
    per = 32 // bits
    order = torch.tensor(fields if fields is not None else range(per), dtype=torch.int64)
    order = order.to(torch.int32)
    words = packed.to(torch.int32)             # an arithmetic shift: the mask drops the sign
    values = (words.unsqueeze(-1) >> (order * bits)) & ((1 << bits) - 1)   # [R, C, per]
    r, c = packed.shape
    if dim == 1:
        return values.reshape(r, c * per)
    return values.permute(0, 2, 1).reshape(r * per, c)


def _signed(q: torch.Tensor, bits: int) -> torch.Tensor:
    return q.to(torch.int8 if bits <= 7 else torch.int16)


def _check_groups(g_idx: torch.Tensor | None, k: int, group: int) -> None:
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64),
                                             torch.arange(k) // group):
        raise ValueError("act-order checkpoints (desc_act: a g_idx that is not k // group_size) "
                         "are not supported yet")


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              bits: int, group: int, g_idx: torch.Tensor | None = None, version: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ tensors -> (q [N, K], scale [N, K / G])."""
    if bits not in (2, 4, 8):
        raise ValueError(f"GPTQ with {bits} bits is not supported (2, 4, 8)")
    q = unpack_int32(qweight, bits, 0)                               # [K, N]
    k = q.shape[0]
    group = k if group in (-1, 0) else group
    _check_groups(g_idx, k, group)
    words = qzeros.to(torch.int64)
    if version == 1:                     # stored z - 1, word by word
        words = (words + sum(1 << (bits * i) for i in range(32 // bits))) & 0xFFFFFFFF
        words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    z = unpack_int32(words, bits, 1)                                 # [G, N]
    zk = z.repeat_interleave(group, dim=0)[:k]
    return _signed((q - zk).t().contiguous(), bits), scales.t().contiguous()


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ GEMM tensors (4 bits) -> (q [N, K], scale [N, K / G])."""
    q = unpack_int32(qweight, 4, 1, AWQ_FIELD)                       # [K, N]
    k = q.shape[0]
    group = k if group in (-1, 0) else group
    z = unpack_int32(qzeros, 4, 1, AWQ_FIELD)                        # [G, N]
    zk = z.repeat_interleave(group, dim=0)[:k]
    return _signed((q - zk).t().contiguous(), 4), scales.t().contiguous()


def from_compressed_tensors(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                            weight_shape: torch.Tensor, bits: int,
                            weight_zero_point: torch.Tensor | None = None,
                            g_idx: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors pack-quantized tensors -> (q [N, K], scale [N, K / G] or [N, 1])."""
    n, k = (int(v) for v in weight_shape.tolist())
    offset = 1 << (bits - 1)
    q = unpack_int32(weight_packed, bits, 1)[:, :k] - offset        # [N, K] signed
    groups = weight_scale.shape[1]
    group = -(-k // groups)
    _check_groups(g_idx, k, group)
    if weight_zero_point is not None:
        zp = weight_zero_point
        if zp.dtype == torch.int32 and tuple(zp.shape) == (-(-n * bits // 32), groups):
            z = unpack_int32(zp, bits, 0)[:n] - offset               # packed along N
        elif zp.dtype == torch.int8 and tuple(zp.shape) == (n, groups):
            z = zp.to(torch.int64)                                   # older files: as is
        else:
            raise ValueError(f"weight_zero_point {zp.dtype} {tuple(zp.shape)} is neither "
                             f"packed int32 [{-(-n * bits // 32)}, {groups}] nor int8 "
                             f"[{n}, {groups}]")
        q = q - z.repeat_interleave(group, dim=1)[:, :k]
    return _signed(q, bits), weight_scale.contiguous()


def from_int_quantized(weight: torch.Tensor, weight_scale: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors int-quantized (W8A8, per channel) -> (q [N, K] int8, scale [N, 1])."""
    if weight.dtype != torch.int8:
        raise ValueError(f"int-quantized weights are int8, this one is {weight.dtype}")
    return weight, weight_scale.reshape(weight.shape[0], -1).contiguous()


def grouped_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize, then matmul: W[n, k] = q[n, k] * scale[n, k // G], G = ceil(K / groups)."""
    k = q.shape[1]
    group = -(-k // scale.shape[1])
    w = q.to(x.dtype) * scale.to(x.dtype).repeat_interleave(group, dim=1)[:, :k]
    return F.linear(x, w, bias)


# ------------------------------------------------------------------------ schemes and loading

FORMATS = ("gptq", "awq", "compressed-tensors")
RANDOM_SCHEMES = ("w4a16", "w8a8")    # the layers of those schemes with random weights (benches)


@dataclass(frozen=True)
class QuantScheme:
    """How a pre-quantized checkpoint's linear layers are stored and computed: `bits`-bit
    integer weights with a scale per `group` input features (0: per output channel), and with
    `act_bits` 8, activations quantized per token at run time (W8A8)."""

    format: str                 # gptq, awq, compressed-tensors (or a random scheme)
    bits: int
    group: int                  # 0: one scale per output channel
    act_bits: int = 16
    version: int = 1            # GPTQ: 1 stores zeros minus 1, 2 as they are
    packed: bool = True         # compressed-tensors: pack-quantized (False: int-quantized)
    zero_points: bool = True    # compressed-tensors: asymmetric (zero points stored)
    act_order: bool = False     # GPTQ desc_act: a g_idx must be present (and trivial)

    @property
    def name(self) -> str:
        group = f"-g{self.group}" if self.group else ""
        return f"{self.format}-w{self.bits}a{self.act_bits}{group}"

    @classmethod
    def random(cls, name: str) -> "QuantScheme":
        """The layers of `name` (w4a16: 4-bit weights in groups of 128; w8a8: 8-bit weights per
        channel, activations per token) for random-weight benchmarks."""
        if name == "w4a16":
            return cls(name, 4, 128)
        if name == "w8a8":
            return cls(name, 8, 0, act_bits=8, packed=False)
        raise ValueError(f"random quantized layers are one of {RANDOM_SCHEMES}, got {name!r}")

    @classmethod
    def from_hf(cls, qc: dict) -> "QuantScheme":
        """A config.json's quantization_config; what cannot be served is refused by name."""
        method = qc.get("quant_method")
        if method == "gptq":
            return cls._gptq(qc)
        if method == "awq":
            return cls._awq(qc)
        if method == "compressed-tensors":
            return cls._compressed(qc)
        raise ValueError(f"checkpoint quantization {method!r} is not supported (supported: "
                         f"{', '.join(FORMATS)}; or --quantization int8 on a full-precision "
                         "checkpoint)")

    @classmethod
    def _gptq(cls, qc: dict) -> "QuantScheme":
        bits = int(qc.get("bits", 4))
        if bits not in (4, 8):
            raise ValueError(f"GPTQ with {bits} bits is not supported (4, 8)")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2") or qc.get("is_marlin_format"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        if qc.get("dynamic"):
            raise ValueError("GPTQ with per-module overrides (dynamic) is not supported")
        if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
            raise ValueError(f"GPTQ pack_dtype {qc.get('pack_dtype')!r} is not supported (int32)")
        return cls("gptq", bits, _group(qc.get("group_size", 128)),
                   version=2 if fmt == "gptq_v2" else 1, act_order=bool(qc.get("desc_act")))

    @classmethod
    def _awq(cls, qc: dict) -> "QuantScheme":
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm":
            raise ValueError(f"AWQ {bits}-bit {version!r} is not supported (4-bit GEMM)")
        if not qc.get("zero_point", True):
            raise ValueError("AWQ without zero points is not supported")
        if qc.get("modules_to_not_convert"):
            raise ValueError(f"AWQ modules_to_not_convert {qc['modules_to_not_convert']} is not "
                             "supported (every projection quantized)")
        return cls("awq", 4, _group(qc.get("group_size", qc.get("q_group_size", 128))))

    @classmethod
    def _compressed(cls, qc: dict) -> "QuantScheme":
        groups = qc.get("config_groups") or {}
        if len(groups) != 1:
            raise ValueError(f"compressed-tensors with {len(groups)} config groups is not "
                             "supported (one)")
        g = next(iter(groups.values()))
        fmt = g.get("format") or qc.get("format")
        w = g.get("weights") or {}
        a = g.get("input_activations")
        if fmt not in ("pack-quantized", "int-quantized") or w.get("type", "int") != "int":
            raise ValueError(f"compressed-tensors format {fmt!r} with {w.get('type')} weights "
                             "is not supported (pack-quantized W4A16, int-quantized W8A8)")
        bits = int(w.get("num_bits", 0))
        strategy = w.get("strategy")
        if strategy not in ("group", "channel") or w.get("actorder"):
            raise ValueError(f"compressed-tensors weight strategy {strategy!r} (actorder "
                             f"{w.get('actorder')!r}) is not supported (group, channel)")
        group = _group(w.get("group_size")) if strategy == "group" else 0
        _check_ignore(qc.get("ignore") or [])
        for key in ("output_activations",):
            if g.get(key) is not None:
                raise ValueError(f"compressed-tensors {key} is not supported")
        if qc.get("kv_cache_scheme") is not None:
            raise ValueError("compressed-tensors kv_cache_scheme (a quantized KV cache) is not "
                             "supported")
        sparsity = qc.get("sparsity_config") or {}
        if sparsity.get("format", "dense") != "dense":
            raise ValueError(f"compressed-tensors sparsity {sparsity.get('format')!r} is not "
                             "supported")
        if fmt == "int-quantized":
            if bits != 8 or not w.get("symmetric", True):
                raise ValueError("compressed-tensors int-quantized: only symmetric 8-bit "
                                 "weights are supported")
            if a is not None and (a.get("num_bits") != 8 or not a.get("dynamic")
                                  or a.get("strategy") != "token" or a.get("type", "int") != "int"
                                  or not a.get("symmetric", True)):
                raise ValueError("compressed-tensors activations: only dynamic symmetric int8 "
                                 f"per token are supported, got {a}")
            return cls("compressed-tensors", 8, group, act_bits=8 if a else 16, packed=False)
        if a is not None:
            raise ValueError("compressed-tensors pack-quantized with quantized activations is "
                             "not supported")
        if bits not in (4, 8):
            raise ValueError(f"compressed-tensors pack-quantized with {bits} bits is not "
                             "supported (4, 8)")
        return cls("compressed-tensors", bits, group, zero_points=not w.get("symmetric", True))

    def convert(self, read: Callable[[str], torch.Tensor | None]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One projection's tensors (read(suffix): the tensor, None if absent) -> (q int8
        [N, K], scale float32 [N, groups])."""
        if self.format == "gptq":
            if self.act_order and read("g_idx") is None:
                raise ValueError("desc_act is set but the checkpoint has no g_idx")
            q, s = from_gptq(read("qweight"), read("qzeros"), read("scales"), self.bits,
                             self.group or -1, read("g_idx"), self.version)
        elif self.format == "awq":
            q, s = from_awq(read("qweight"), read("qzeros"), read("scales"), self.group or -1)
        elif self.packed:
            if self.zero_points and read("weight_zero_point") is None:
                raise ValueError("asymmetric weights without weight_zero_point")
            q, s = from_compressed_tensors(read("weight_packed"), read("weight_scale"),
                                           read("weight_shape"), self.bits,
                                           read("weight_zero_point"), read("weight_g_idx"))
        else:
            if read("weight_zero_point") is not None and bool(read("weight_zero_point").any()):
                raise ValueError("asymmetric int-quantized weights are not supported")
            q, s = from_int_quantized(read("weight"), read("weight_scale"))
        if q.dtype != torch.int8:
            lo, hi = int(q.min()), int(q.max())
            if lo < -128 or hi > 127:              # 8-bit values minus far-off zero points
                raise ValueError(f"values minus zero points span [{lo}, {hi}], beyond int8: "
                                 "asymmetric 8-bit weights are not supported")
        return q.to(torch.int8), s.float().contiguous()


def _group(size) -> int:
    size = int(size if size is not None else -1)
    return 0 if size <= 0 else size


def _check_ignore(ignore: list[str]) -> None:
    """Layers a compressed-tensors checkpoint left unquantized: lm_head only."""
    for entry in ignore:
        if entry.startswith("re:"):
            ok = entry[3:].removeprefix("^").removeprefix(".*").removesuffix("$") == "lm_head"
        else:
            ok = entry == "lm_head" or entry.endswith(".lm_head")
        if not ok:
            raise ValueError(f"compressed-tensors ignore lists {entry!r}: only lm_head may be "
                             "left unquantized")


# Checkpoint tensor suffixes of one quantized projection, by format; the first marks one.
_PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"),
          "awq": ("qweight", "qzeros", "scales"),
          "pack": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
                   "weight_g_idx"),
          "int": ("weight_scale", "weight", "weight_zero_point", "input_scale")}


def canonical_tensors(scheme: QuantScheme, names: Iterable[str],
                      read: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, object | None]]:
    """(name, tensor) in the layers' names: each quantized projection's checkpoint tensors
    become `<proj>.weight` (q) and `<proj>.weight_scale`, converted one projection at a time;
    every other name is passed on with None (the caller reads it lazily). Static activation
    scales (input_scale) are refused."""
    key = (scheme.format if scheme.format in ("gptq", "awq")
           else "pack" if scheme.packed else "int")
    parts = _PARTS[key]
    names = list(names)
    present = set(names)
    marked = {n.rpartition(".")[0] for n in names if n.rpartition(".")[2] == parts[0]}
    done: set[str] = set()
    for name in names:
        prefix, _, suffix = name.rpartition(".")
        if prefix not in marked or suffix not in parts:
            yield name, None
            continue
        if suffix == "input_scale":
            raise ValueError(f"{name}: static activation scales are not supported (dynamic "
                             "per-token activations only)")
        if prefix in done:
            continue
        done.add(prefix)

        def part(suffix: str, prefix=prefix):
            full = f"{prefix}.{suffix}"
            return read(full) if full in present else None

        try:
            q, scale = scheme.convert(part)
        except (TypeError, AttributeError) as exc:     # a part missing
            raise ValueError(f"{prefix}: incomplete {scheme.format} tensors "
                             f"({', '.join(s for s in parts if f'{prefix}.{s}' in present)} "
                             f"present): {exc}") from None
        yield f"{prefix}.weight", q
        yield f"{prefix}.weight_scale", scale


def resolve(quantization: str, model_dir=None) -> "str | QuantScheme":
    """--quantization and the checkpoint's quantization_config -> "none", "int8" or the scheme
    the layers are built with. "none" takes a pre-quantized checkpoint's own scheme; a format
    name must be the checkpoint's; w4a16 / w8a8 are random-weight layers (no checkpoint)."""
    qc = None
    if model_dir is not None:
        import json
        from pathlib import Path
        config = Path(model_dir) / "config.json"
        if config.is_file():
            qc = json.loads(config.read_text()).get("quantization_config")
    if quantization in RANDOM_SCHEMES:
        if model_dir is not None:
            raise ValueError(f"--quantization {quantization} is for random weights; a "
                             "checkpoint's own quantization is found from its config.json")
        return QuantScheme.random(quantization)
    if qc is None:
        if quantization in FORMATS:
            raise ValueError(f"--quantization {quantization}: the checkpoint in {model_dir} is "
                             "not pre-quantized (no quantization_config in its config.json); "
                             "--quantization int8 quantizes one at load")
        return quantization
    scheme = QuantScheme.from_hf(qc)
    if quantization == "int8":
        raise ValueError(f"--quantization int8 quantizes a full-precision checkpoint; the one "
                         f"in {model_dir} is already quantized ({scheme.format})")
    if quantization in FORMATS and quantization != scheme.format:
        raise ValueError(f"--quantization {quantization}, but the checkpoint in {model_dir} is "
                         f"quantized as {scheme.format}")
    return scheme
