"""Where oscar-kv keeps what it downloads, converts and calibrates: one root, ``$OSCAR_KV_HOME`` (default
``~/.cache/oscar-kv``), with ``gguf/`` (fetched models), ``models/`` (GGUF files converted once) and
``artifacts/<model>/`` (artifacts calibrated on first use)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    return Path(os.environ.get("OSCAR_KV_HOME", Path.home() / ".cache" / "oscar-kv"))


def artifact_cache_dir(model_name: str) -> Path:
    """Where an artifact calibrated on first use for ``model_name`` (a --model value) is kept."""
    return cache_home() / "artifacts" / (Path(model_name).name or "model")
