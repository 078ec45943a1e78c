"""Text for calibration and evaluation: the shipped corpus, or the user's .txt / .jsonl files.

The shipped corpus (data/python_docs.txt) is English prose from the Python standard library's
documentation strings, © Python Software Foundation, PSF License (see data/ATTRIBUTION.md).
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from .errors import OscarKVError

DATA_DIR = Path(__file__).parent / "data"
DEFAULT_CORPUS = DATA_DIR / "python_docs.txt"
# Where a text file is named, this names the running interpreter's standard library source instead: real text of
# any length that every machine has (~1.3M tokens in CPython 3.11), for contexts longer than the shipped corpus.
STDLIB_SOURCE = "stdlib:"


class CorpusError(OscarKVError, ValueError):
    """A calibration or evaluation text cannot be read, or holds too few tokens for what was asked."""


def read_text_file(path: str | Path) -> list[str]:
    """Documents of one .txt (the whole file) or .jsonl file (field text, prompt+completion, or messages), or
    STDLIB_SOURCE's modules."""
    if str(path) == STDLIB_SOURCE:
        return stdlib_source()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration data {path} does not exist")
    if path.suffix == ".txt":
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            raise CorpusError(f"{path} is empty")
        return [text]
    if path.suffix == ".jsonl":
        docs = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{path}:{n} is not valid JSON: {exc.msg}") from exc
            docs.append(_document(row, f"{path}:{n}"))
        if not docs:
            raise CorpusError(f"{path} holds no documents")
        return docs
    raise CorpusError(f"calibration data must be .txt or .jsonl, got {path.name}")


def stdlib_source() -> list[str]:
    """The source of the standard library's top-level modules, one document each in name order (the same text on
    every machine with the same Python version)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(root.glob("*.py"))]
    if not docs:
        raise CorpusError(f"no standard library source under {root} (a Python installed without its .py files)")
    return docs


def _document(row, where: str) -> str:
    if isinstance(row, dict):
        if isinstance(row.get("text"), str):
            return row["text"]
        if isinstance(row.get("prompt"), str):
            return row["prompt"] + str(row.get("completion", ""))
        if isinstance(row.get("messages"), list):
            return "\n".join(str(m.get("content", "")) for m in row["messages"] if isinstance(m, dict))
    raise CorpusError(f"{where}: expected an object with 'text', 'prompt' or 'messages'")


def load_calibration_text(paths: list[str] | None = None) -> tuple[list[str], str]:
    """(documents, a description of the source)."""
    if not paths:
        return read_text_file(DEFAULT_CORPUS), f"builtin:{DEFAULT_CORPUS.name}"
    docs = []
    for p in paths:
        docs.extend(read_text_file(p))
    return docs, ",".join(str(p) for p in paths)
