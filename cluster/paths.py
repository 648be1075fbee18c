"""Where pdserve keeps things outside the checkout."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """PDSERVE_CACHE, else $XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve."""
    env = os.environ.get("PDSERVE_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pdserve"


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def resolve_model(path: str | None) -> Path:
    """The model folder to serve, with a message that says how to get it when it is missing."""
    p = Path(path).expanduser() if path else default_model_dir()
    if not (p / "config.json").is_file():
        hint = "run `pdserve model fetch`" if path is None else "pass an HF-format model folder"
        raise SystemExit(f"no model at {p} (config.json missing): {hint}")
    return p
