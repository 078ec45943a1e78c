"""scripts/model_parts.py: a file split into parts, staged one at a time, joined and checked."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("model_parts", Path(__file__).parents[1] / "scripts" / "model_parts.py")
model_parts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(model_parts)


def test_split_stage_join_round_trip_and_corruption(tmp_path):
    data = bytes(range(256)) * 4000 + b"tail"
    src = tmp_path / "model.gguf"
    src.write_bytes(data)
    manifest = model_parts.split(src, tmp_path / "parts", part_bytes=300_000)
    assert len(manifest["parts"]) == 4 and manifest["size"] == len(data)
    there = tmp_path / "there"
    there.mkdir()
    for i in range(4):  # one part per call: the staging folder holds only part i
        staged = model_parts.stage(i, tmp_path / "parts", tmp_path / "xfer")
        assert sorted(p.name for p in (tmp_path / "xfer").iterdir()) == ["manifest.json", staged.name]
        (there / staged.name).write_bytes(staged.read_bytes())
    model_parts.join(there, tmp_path / "parts" / "manifest.json", tmp_path / "out.gguf")
    assert (tmp_path / "out.gguf").read_bytes() == data
    (there / "part002").write_bytes(b"x" + (there / "part002").read_bytes()[1:])
    with pytest.raises(SystemExit, match="part002 is corrupt"):
        model_parts.join(there, tmp_path / "parts" / "manifest.json", tmp_path / "bad.gguf")
    (there / "part003").unlink()
    with pytest.raises(SystemExit, match="missing parts: part003"):
        model_parts.join(there, tmp_path / "parts" / "manifest.json", tmp_path / "bad.gguf")
