"""What the ``oscar-kv`` commands (cli.py) do alike: fail with one red line and exit 2, quiet transformers' logging,
load a model or an artifact and turn its errors into that line, parse a whole number or a comma-separated list,
start the ranks of ``--tp N``.

Kept apart from the commands so that cli.py reads as the commands and their options, and stays under the
project's 600 lines a module.  Like cli.py, it imports neither torch nor transformers at import time (``oscar-kv
--help`` must start fast): they load inside the functions that need them."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from .errors import user_message

MODEL_HELP = ("HF model directory, .gguf file, hub id (when online), 'smollm2-135m' (embedded default), "
              "or a model fetched with `oscar-kv fetch` (e.g. 'qwen2.5-coder-1.5b').")


def _fail(message: str, code: int = 2):
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _quiet_transformers():
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def _load(model: str, device: str, dtype=None):
    from .models import load_model

    try:
        return load_model(model, device=device, dtype=dtype)
    except (FileNotFoundError, ValueError, OSError) as exc:
        _fail(user_message(exc))


def _whole_number(value: str, flag: str, alternatives: str = "") -> int:
    try:
        return int(value)
    except ValueError:
        _fail(f"{flag} takes {alternatives}a whole number, not {value!r}")


def _width_or_auto(value: str, flag: str) -> int | str:
    return value if value == "auto" else _whole_number(value, flag, "'auto' or ")


def _start_ranks(model: str, tp: int, nodes=None) -> None:
    """--tp N outside torchrun: check the model splits, then run this very command as N processes (one per rank;
    with ``nodes``, parallel.Nodes, this host's share of them) and exit with their status."""
    from .parallel import Nodes, TensorParallelError, check_model, relaunch

    try:
        check_model(model, tp)
    except (TensorParallelError, FileNotFoundError, ValueError, OSError) as exc:
        _fail(user_message(exc))
    raise typer.Exit(relaunch(tp, sys.argv[1:], nodes or Nodes()))


def _load_rotations(rotations: Optional[Path], lm, kv_cache_dtype: str, model: str = ""):
    """--rotations DIR, or the artifact shipped or cached for --model (provision.obtain); None for bf16 without one."""
    from .artifacts import ArtifactError
    from .provision import ArtifactMissing, obtain

    if rotations is None and kv_cache_dtype == "bf16":
        return None
    try:
        return obtain(model, lm, directory=rotations)
    except ArtifactMissing:
        _fail(f"--kv-cache-dtype {kv_cache_dtype} needs --rotations DIR; create one with "
              "`oscar-kv calibrate --model MODEL --output-dir DIR`")
    except ArtifactError as exc:
        _fail(user_message(exc))


def _csv(value: str, cast=str) -> list:
    try:
        return [cast(v.strip()) for v in value.split(",") if v.strip()]
    except ValueError:
        _fail(f"cannot parse {value!r} as a comma-separated list")
