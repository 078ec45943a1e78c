"""Rebuild src/oscar_kv/data/python_docs.txt: English prose from the Python standard library's docstrings.

The text is © Python Software Foundation, distributed under the PSF License Agreement (permissive,
redistribution allowed with the notice kept); see src/oscar_kv/data/ATTRIBUTION.md.
Run with the interpreter whose docs you want: ``python scripts/build_corpus.py``.
"""

import importlib
import inspect
import pathlib
import re

MODULES = [
    "argparse", "asyncio", "collections", "contextlib", "dataclasses", "datetime", "decimal", "difflib",
    "email", "enum", "fractions", "functools", "heapq", "http.client", "http.server", "inspect", "io",
    "itertools", "json", "logging", "mailbox", "multiprocessing", "numbers", "os", "pathlib", "pickle",
    "random", "re", "sched", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "typing", "unittest", "urllib.request", "uuid",
    "warnings", "weakref", "zipfile",
]


def paragraphs(module):
    seen = set()
    objects = [module] + [obj for _, obj in inspect.getmembers(module)
                          if getattr(obj, "__module__", None) == module.__name__]
    for obj in objects:
        members = [obj] + ([m for _, m in inspect.getmembers(obj, inspect.isfunction)] if inspect.isclass(obj) else [])
        for member in members:
            doc = inspect.getdoc(member)
            if not doc or doc in seen or len(doc) < 200:
                continue
            seen.add(doc)
            yield re.sub(r"\n{3,}", "\n\n", doc.strip())


def main():
    out = pathlib.Path(__file__).resolve().parents[1] / "src/oscar_kv/data/python_docs.txt"
    chunks = []
    for name in MODULES:
        module = importlib.import_module(name)
        chunks.extend(paragraphs(module))
    out.write_text("\n\n".join(chunks) + "\n")
    print(f"wrote {out} ({out.stat().st_size} bytes, {len(chunks)} passages)")


if __name__ == "__main__":
    main()
