"""Move a large file (a model) to the GPU machine in parts small enough for one device call each.

    python3 scripts/model_parts.py split FILE --parts-dir .model-parts      # here: parts + manifest.json
    python3 scripts/model_parts.py stage 3 --parts-dir .model-parts --to .xfer   # here: only part 3 in .xfer
    python3 scripts/model_parts.py join DIR --manifest manifest.json --output FILE  # there: check and join

A device call carries at most 64 MiB of working tree, and a warm machine keeps its files between calls
(benchmarks/NOTES.md, "A real model on the GPU"): stage part i into a git-ignored folder, carry it in call i,
copy it to /tmp there; the last call joins the parts and checks the size and sha256 of the whole.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

PART_BYTES = 55 * 1000 * 1000  # under the 64 MiB a call carries, with room for the source tree


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def split(path: Path, parts_dir: Path, part_bytes: int = PART_BYTES) -> dict:
    parts_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(path, "rb") as f:
        for i, block in enumerate(iter(lambda: f.read(part_bytes), b"")):
            name = f"part{i:03d}"
            (parts_dir / name).write_bytes(block)
            parts.append({"name": name, "size": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    manifest = {"file": path.name, "size": path.stat().st_size, "sha256": sha256(path), "parts": parts}
    (parts_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def stage(index: int, parts_dir: Path, to: Path) -> Path:
    """Leave only part ``index`` (and the manifest) in ``to``."""
    manifest = json.loads((parts_dir / "manifest.json").read_text())
    shutil.rmtree(to, ignore_errors=True)
    to.mkdir(parents=True)
    shutil.copy(parts_dir / "manifest.json", to / "manifest.json")
    name = manifest["parts"][index]["name"]
    shutil.copy(parts_dir / name, to / name)
    return to / name


def join(directory: Path, manifest_path: Path, output: Path) -> None:
    manifest = json.loads(manifest_path.read_text())
    missing = [p["name"] for p in manifest["parts"] if not (directory / p["name"]).is_file()]
    if missing:
        raise SystemExit(f"missing parts: {', '.join(missing)}")
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "wb") as out:
        for p in manifest["parts"]:
            data = (directory / p["name"]).read_bytes()
            if len(data) != p["size"] or hashlib.sha256(data).hexdigest() != p["sha256"]:
                raise SystemExit(f"part {p['name']} is corrupt (size or sha256 differs)")
            out.write(data)
    if output.stat().st_size != manifest["size"] or sha256(output) != manifest["sha256"]:
        output.unlink()
        raise SystemExit("the joined file's size or sha256 differs from the manifest")
    print(f"{output}: {manifest['size']} bytes, sha256 ok")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    a = sub.add_parser("split")
    a.add_argument("file", type=Path)
    a.add_argument("--parts-dir", type=Path, required=True)
    a.add_argument("--part-bytes", type=int, default=PART_BYTES)
    b = sub.add_parser("stage")
    b.add_argument("index", type=int)
    b.add_argument("--parts-dir", type=Path, required=True)
    b.add_argument("--to", type=Path, required=True)
    c = sub.add_parser("join")
    c.add_argument("directory", type=Path)
    c.add_argument("--manifest", type=Path, required=True)
    c.add_argument("--output", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.command == "split":
        m = split(args.file, args.parts_dir, args.part_bytes)
        print(f"{len(m['parts'])} parts of {args.file} in {args.parts_dir}")
    elif args.command == "stage":
        print(stage(args.index, args.parts_dir, args.to))
    else:
        join(args.directory, args.manifest, args.output)


if __name__ == "__main__":
    sys.exit(main())
