"""`pdserve model quantize`: a full-precision checkpoint written as a pre-quantized one, by
round-to-nearest, in a published layout the engine serves (engine.layers.quant_formats):
GPTQ (v1 or v2 zeros), AWQ GEMM, compressed-tensors pack-quantized W4A16 (symmetric or with
zero points) and int-quantized W8A8. Every q/k/v/o/gate/up/down projection is quantized; the
embedding, norms and lm_head stay as they are (the usual `ignore: [lm_head]`).

Round-to-nearest is not GPTQ's or AWQ's calibrated algorithm: the files have those tools'
layouts, not their accuracy. It is what tests and measurements here need (a checkpoint of any
model in any format, and `--dequantized`, the same weights as a plain fp32 folder to compare
against), and a quick way to try a format on a model no one has published quantized.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FORMATS = ("gptq", "gptq-v2", "awq", "w4a16", "w4a16-asym", "w8a8")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack_int32(values: torch.Tensor, bits: int, dim: int, fields=None) -> torch.Tensor:
    """Unsigned `bits`-bit values of a 2-D tensor packed 32 / bits per int32 along `dim`, value
    j of a word in field fields[j] (default j), field i at bits [bits * i, bits * (i + 1))."""
    import torch

    per = 32 // bits
    v = values.to(torch.int64) if dim == 1 else values.t().to(torch.int64)
    r, c = v.shape
    v = v.reshape(r, c // per, per)
    words = torch.zeros(r, c // per, dtype=torch.int64)
    for j in range(per):
        words |= v[:, :, j] << (bits * (fields[j] if fields is not None else j))
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words if dim == 1 else words.t().contiguous()


def round_to_nearest(w: torch.Tensor, bits: int, group: int, sym: bool,
                     scale_dtype: torch.dtype | None = None):
    """w [N, K] -> unsigned values u [N, K], unsigned zeros z [N, K / group] and scales s
    [N, K / group] (rounded to `scale_dtype`, as stored: float16 unless given) with
    w ~= (u - z) * s."""
    import torch

    scale_dtype = torch.float16 if scale_dtype is None else scale_dtype

    n, k = w.shape
    if k % group:
        raise ValueError(f"{k} input features are not whole groups of {group}")
    g = w.float().view(n, k // group, group)
    top = (1 << bits) - 1
    if sym:
        s = g.abs().amax(-1) / ((top + 1) // 2 - 0.5)
        z = torch.full_like(s, (top + 1) // 2)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        s = (hi - lo) / top
        z = torch.round(-lo / s.clamp_min(1e-12)).clamp(0, top)
    s = s.clamp_min(1e-8).to(scale_dtype).float()
    u = torch.round(g / s[..., None] + z[..., None]).clamp(0, top)
    return u.view(n, k).long(), z.long(), s


def _dequant(u, z, s, group):
    return (u - z.repeat_interleave(group, 1)).float() * s.repeat_interleave(group, 1)


def quantize_tensor(name: str, w: torch.Tensor, fmt: str, group: int
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One projection `name` (its weight w [N, K]) in format `fmt` -> (its tensors by
    checkpoint name, the dequantized weight)."""
    import torch

    from engine.layers.quant_formats import AWQ_FIELD

    if fmt in ("gptq", "gptq-v2"):
        u, z, s = round_to_nearest(w, 4, group, sym=False)
        stored = pack_int32(z.t(), 4, 1).to(torch.int64)
        if fmt == "gptq":                        # v1: zeros minus 1, whole words
            stored = stored - 0x11111111
            stored = torch.where(stored < -(1 << 31), stored + (1 << 32), stored)
        k = w.shape[1]
        return ({f"{name}.qweight": pack_int32(u.t(), 4, 0),
                 f"{name}.qzeros": stored.to(torch.int32),
                 f"{name}.scales": s.t().contiguous().half(),
                 f"{name}.g_idx": (torch.arange(k) // group).to(torch.int32)},
                _dequant(u, z, s, group))
    if fmt == "awq":
        u, z, s = round_to_nearest(w, 4, group, sym=False)
        return ({f"{name}.qweight": pack_int32(u.t(), 4, 1, AWQ_FIELD),
                 f"{name}.qzeros": pack_int32(z.t(), 4, 1, AWQ_FIELD),
                 f"{name}.scales": s.t().contiguous().half()}, _dequant(u, z, s, group))
    if fmt in ("w4a16", "w4a16-asym"):
        sym = fmt == "w4a16"
        u, z, s = round_to_nearest(w, 4, group, sym=sym, scale_dtype=torch.bfloat16)
        out = {f"{name}.weight_packed": pack_int32(u, 4, 1),    # signed + 8: unsigned here
               f"{name}.weight_scale": s.bfloat16(),
               f"{name}.weight_shape": torch.tensor(list(w.shape))}
        if not sym:
            out[f"{name}.weight_zero_point"] = pack_int32(z.t(), 4, 1).t().contiguous()
        return out, _dequant(u, z, s, group)
    if fmt == "w8a8":
        s = (w.float().abs().amax(1, keepdim=True) / 127).clamp_min(1e-8)
        q = torch.round(w.float() / s).clamp(-127, 127)
        return {f"{name}.weight": q.to(torch.int8), f"{name}.weight_scale": s}, q * s
    raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


def quantization_config(fmt: str, group: int) -> dict:
    """config.json's quantization_config for `fmt`, as the tools that write it say it."""
    if fmt in ("gptq", "gptq-v2"):
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                "sym": False, "checkpoint_format": "gptq_v2" if fmt == "gptq-v2" else "gptq"}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm",
                "zero_point": True}
    if fmt == "w8a8":
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
        acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                "dynamic": True}
        cfg_format = "int-quantized"
    else:
        weights = {"num_bits": 4, "type": "int", "symmetric": fmt == "w4a16",
                   "strategy": "group", "group_size": group}
        acts, cfg_format = None, "pack-quantized"
    return {"quant_method": "compressed-tensors", "format": cfg_format, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts}}}


def quantize_checkpoint(src: str | Path, dest: str | Path, fmt: str, group: int = 128,
                        dequantized: str | Path | None = None) -> dict[str, float]:
    """Write `src` (an HF folder of safetensors) quantized as `fmt` into `dest` (and, with
    `dequantized`, its dequantized weights as a plain fp32 folder). Returns each projection's
    relative weight error |W - W_q| / |W| (Frobenius)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    src, dest = Path(src), Path(dest)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {src}")
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized")
    outs = [Path(dest)] + ([Path(dequantized)] if dequantized else [])
    for d in outs:
        d.mkdir(parents=True, exist_ok=True)
        for extra in src.iterdir():               # tokenizer, generation config, ...
            if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in (
                    "config.json", "model.safetensors.index.json"):
                shutil.copy2(extra, d / extra.name)
    errors: dict[str, float] = {}
    t0 = time.perf_counter()
    for i, f in enumerate(files):
        quant, plain = {}, {}
        with safe_open(str(f), framework="pt", device="cpu") as st:
            names = list(st.keys())
            for j, name in enumerate(names):
                t = st.get_tensor(name)
                prefix, _, leaf = name.rpartition(".")
                if leaf != "weight" or prefix.rpartition(".")[2] not in PROJECTIONS:
                    quant[name], plain[name] = t, t.float() if t.is_floating_point() else t
                    continue
                tensors, w = quantize_tensor(prefix, t, fmt, group)
                quant.update(tensors)
                plain[name] = w.contiguous()
                errors[prefix] = float((w - t.float()).norm() / t.float().norm().clamp_min(1e-30))
                if j % 50 == 0:
                    log.info("file %d/%d: tensor %d/%d (%.0f s)", i + 1, len(files), j + 1,
                             len(names), time.perf_counter() - t0)
        save_file(quant, str(dest / f.name), metadata={"format": "pt"})
        if dequantized:
            save_file(plain, str(Path(dequantized) / f.name), metadata={"format": "pt"})
    qconfig = dict(config, quantization_config=quantization_config(fmt, group))
    (dest / "config.json").write_text(json.dumps(qconfig, indent=2))
    if dequantized:
        (Path(dequantized) / "config.json").write_text(
            json.dumps(dict(config, torch_dtype="float32"), indent=2))
    return errors


def register(sub) -> None:
    """`pdserve model quantize`."""
    quant = sub.add_parser(
        "quantize", help="write a checkpoint as a pre-quantized one (round-to-nearest)",
        description="Quantize every q/k/v/o/gate/up/down projection of a full-precision HF "
                    "folder by round-to-nearest and write it in a published layout the workers "
                    "serve: gptq (v1 zeros), gptq-v2, awq (GEMM), w4a16 / w4a16-asym "
                    "(compressed-tensors pack-quantized) or w8a8 (compressed-tensors "
                    "int-quantized, activations per token at run time). The layouts of those "
                    "tools, not their calibrated accuracy.")
    quant.add_argument("src", help="full-precision HF folder (config.json + *.safetensors)")
    quant.add_argument("dest", help="folder to write")
    quant.add_argument("--format", required=True, choices=FORMATS)
    quant.add_argument("--group-size", type=int, default=128,
                       help="input features per scale for the 4-bit formats (must divide every "
                            "projection's input size)")
    quant.add_argument("--dequantized", default=None, metavar="DIR",
                       help="also write the dequantized weights here as a plain fp32 folder")
    quant.set_defaults(target="pdserve.quantize:main")


def main(args) -> int:
    errors = quantize_checkpoint(args.src, args.dest, args.format, args.group_size,
                                 args.dequantized)
    if errors:
        vals = sorted(errors.values())
        log.info("%s written to %s: %d projections, relative weight error %.2f%% to %.2f%% "
                 "(median %.2f%%)", args.format, args.dest, len(vals), 100 * vals[0],
                 100 * vals[-1], 100 * vals[len(vals) // 2])
    return 0
