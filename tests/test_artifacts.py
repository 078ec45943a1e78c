import hashlib
import json

import pytest
import torch

from oscar_kv.artifacts import ArtifactError, Rotations, import_reference_checkpoint
from oscar_kv.models import AttentionGeometry
from oscar_kv.rotation import compose

GEOM = AttentionGeometry("llama", num_layers=3, num_attention_heads=4, num_kv_heads=2, head_dim=16)


def per_head_artifact(geometry=GEOM):
    rot = Rotations.data_free(geometry, "hadamard", 16)
    g = torch.Generator().manual_seed(0)
    rs = []
    for _ in range(geometry.num_layers * geometry.num_kv_heads):
        a = torch.randn(16, 16, generator=g, dtype=torch.float64)
        rs.append(compose(a @ a.T, 16, 8, "oscar")[0].float())
    rot.k_rotation = torch.stack(rs).reshape(3, 2, 16, 16)
    rot.k_mean = torch.randn(3, 2, 16, generator=g)
    rot.manifest = {"model": "test", "calibration": {"note": "synthetic"}}
    return rot


def test_save_load_round_trip(tmp_path):
    rot = per_head_artifact()
    rot.save(tmp_path)
    back = Rotations.load(tmp_path, GEOM)
    for name in Rotations.TENSORS:
        assert torch.equal(getattr(back, name), getattr(rot, name)), name
    assert back.scope == "per-head" and back.group_size == 16
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["geometry"]["num_kv_heads"] == 2 and len(manifest["sha256"]) == 64


def test_rescale_strengths_round_trip_and_are_validated(tmp_path):
    rot = per_head_artifact()
    assert rot.k_rescale == rot.v_rescale == 0  # artifacts written before the strengths existed: no rescale
    rot.k_rescale = 0.5
    rot.save(tmp_path)
    back = Rotations.load(tmp_path, GEOM)
    assert back.k_rescale == 0.5 and back.v_rescale == 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    del manifest["rescale"]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert Rotations.load(tmp_path).k_rescale == 0
    for bad in ({"keys": "yes"}, {"keys": 1.5}, {"values": -0.1}, [0.5]):
        manifest["rescale"] = bad
        (tmp_path / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ArtifactError, match="'rescale' must be"):
            Rotations.load(tmp_path)
    manifest["rescale"] = {"keys": "yes"}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="'rescale' must be"):
        Rotations.load(tmp_path)


def test_rope_layout_round_trips_and_is_validated(tmp_path):
    """Partial rotary: the artifact records the RoPE layout its k_rope_mean is for; artifacts without one are
    rotate-half over the whole head; a mean on the pass-through channels, or a malformed layout, is refused."""
    from oscar_kv.rope import RotaryLayout

    rot = per_head_artifact()
    layout = RotaryLayout(16, 8, interleaved=True)
    rot.k_rope_mean = torch.zeros(3, 2, 16)
    rot.k_rope_mean[..., :8] = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(1))
    rot.rope_layout = RotaryLayout(16, 4)
    with pytest.raises(ArtifactError, match="nonzero past the 4 rotated channels"):
        rot.validate()
    rot.rope_layout = layout
    rot.save(tmp_path)
    back = Rotations.load(tmp_path, GEOM)
    assert back.rope_layout == layout and back.key_centering == "rope"
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["rope_layout"] == {"rotary_dim": 8, "interleaved": True}
    del manifest["rope_layout"]  # as written before partial rotary
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert Rotations.load(tmp_path).rotary_layout == RotaryLayout(16, 16)
    for bad in ({"rotary_dim": 7, "interleaved": False}, {"rotary_dim": 32, "interleaved": False}, {"rotary_dim": 8}):
        manifest["rope_layout"] = bad
        (tmp_path / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ArtifactError, match="'rope_layout' must be"):
            Rotations.load(tmp_path)


def test_truncated_tensor_file_is_rejected(tmp_path):
    per_head_artifact().save(tmp_path)
    path = tmp_path / "rotations.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ArtifactError, match="truncated or modified"):
        Rotations.load(tmp_path)


def test_artifact_for_another_model_is_rejected(tmp_path):
    per_head_artifact().save(tmp_path)
    other = AttentionGeometry("llama", num_layers=3, num_attention_heads=4, num_kv_heads=2, head_dim=32)
    with pytest.raises(ArtifactError, match="another model.*head_dim is 16 in the artifact but 32"):
        Rotations.load(tmp_path, other)


def test_missing_files_and_bad_manifest(tmp_path):
    with pytest.raises(ArtifactError, match="does not exist"):
        Rotations.load(tmp_path / "nope")
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(ArtifactError, match="rotations.safetensors is missing"):
        Rotations.load(tmp_path)
    per_head_artifact().save(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        Rotations.load(tmp_path)


def test_non_orthogonal_rotation_is_rejected():
    rot = per_head_artifact()
    rot.k_rotation[1, 0, 2, 3] += 1e-3
    with pytest.raises(ArtifactError, match="not orthogonal"):
        rot.validate()


def test_wrong_group_size_is_rejected(tmp_path):
    rot = per_head_artifact()
    rot.group_size = 12
    with pytest.raises(ArtifactError, match="group size 12"):
        rot.validate()
    rot.group_size = 16
    rot.save(tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["group_size"] = 5
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="group size 5"):
        Rotations.load(tmp_path)


def test_nan_in_means_is_rejected():
    rot = per_head_artifact()
    rot.k_mean[0, 0, 0] = float("nan")
    with pytest.raises(ArtifactError, match="NaN"):
        rot.validate()


def test_import_of_the_authors_checkpoint(tmp_path):
    def write(name, seed):
        g = torch.Generator().manual_seed(seed)
        layers = {}
        for i in range(GEOM.num_layers):
            a = torch.randn(16, 16, generator=g, dtype=torch.float64)
            lam, u = torch.linalg.eigh(a @ a.T)  # ascending, as the authors store them
            layers[str(i)] = {"layer_id": i, "rotation": u.float(), "eigenvalues": lam.float()}
        torch.save({"format_version": 1, "objective": "qqt_r_h_pbr", "source_grouping": "layer", "layers": layers},
                   tmp_path / name)
        return tmp_path / name

    rot = import_reference_checkpoint(write("k.pt", 1), write("v.pt", 2), GEOM)
    assert rot.k_rotation.shape == (3, 1, 16, 16) and rot.scope == "per-layer"
    assert torch.all(rot.k_eigenvalues[:, 0, :-1] >= rot.k_eigenvalues[:, 0, 1:])
    rot.save(tmp_path / "art")
    assert Rotations.load(tmp_path / "art", GEOM).k_clip.unique().tolist() == [pytest.approx(0.96)]
    (tmp_path / "bad.pt").write_bytes(b"not a pickle")
    with pytest.raises(ArtifactError, match="cannot read"):
        import_reference_checkpoint(tmp_path / "bad.pt", tmp_path / "v.pt", GEOM)
    torch.save({"format_version": 3, "layers": {}}, tmp_path / "future.pt")
    with pytest.raises(ArtifactError, match="unsupported reference checkpoint format 3"):
        import_reference_checkpoint(tmp_path / "future.pt", tmp_path / "v.pt", GEOM)
    torch.save({"layers": {"0": {}}}, tmp_path / "short.pt")
    with pytest.raises(ArtifactError, match="lacks layers"):
        import_reference_checkpoint(tmp_path / "short.pt", tmp_path / "v.pt", GEOM)


@pytest.mark.slow
def test_the_shipped_artifact_matches_the_embedded_model(model):
    """The artifact in the package was calibrated on exactly the embedded weights (serving checks the fingerprint)."""
    from oscar_kv.artifacts import load_shipped, model_fingerprint, shipped_artifact

    assert shipped_artifact("smollm2-135m") is not None and shipped_artifact("no-such-model") is None
    rot = load_shipped("smollm2-135m", model)
    assert rot is not None and rot.manifest["fingerprint"] == model_fingerprint(model)
    assert rot.key_centering == "rope" and rot.manifest["calibration"]["clip"] == "fit"
    weight = model.model.layers[0].self_attn.k_proj.weight
    saved = weight.detach().clone()
    with torch.no_grad():  # other weights: not used
        weight[0, 0] += 1.0
        try:
            assert load_shipped("smollm2-135m", model) is None
        finally:
            weight.copy_(saved)


def test_import_of_the_authors_per_head_checkpoint(tmp_path):
    """Format 2 (the authors' per-KV-head rotations): [H_kv, D, D] per layer, validated like format 1."""
    g = torch.Generator().manual_seed(3)

    def write(name, heads, version=2):
        layers = {}
        for i in range(GEOM.num_layers):
            a = torch.randn(heads, 16, 16, generator=g, dtype=torch.float64)
            lam, u = torch.linalg.eigh(a @ a.transpose(-1, -2))
            layers[i] = {"layer_id": i, "rotation": u.float(), "eigenvalues": lam.float()}
        torch.save({"format_version": version, "objective": "qqt_r_h_pbr", "source_grouping": "head",
                    "layers": layers}, tmp_path / name)
        return tmp_path / name

    rot = import_reference_checkpoint(write("k.pt", 2), write("v.pt", 2), GEOM)
    assert rot.k_rotation.shape == (3, 2, 16, 16) and rot.v_rotation.shape == (3, 2, 16, 16)
    assert rot.scope == "per-head"
    assert torch.all(rot.k_eigenvalues[..., :-1] >= rot.k_eigenvalues[..., 1:])
    rot.save(tmp_path / "art")
    assert Rotations.load(tmp_path / "art", GEOM).scope == "per-head"
    with pytest.raises(ArtifactError, match=r"needs \[2, 16, 16\].*per KV head"):
        import_reference_checkpoint(write("k3.pt", 3), tmp_path / "v.pt", GEOM)
    with pytest.raises(ArtifactError, match=r"format 1 for this model needs \[1, 16, 16\]"):
        import_reference_checkpoint(write("k1.pt", 2, version=1), tmp_path / "v.pt", GEOM)


@pytest.mark.slow
def test_obtain_prefers_the_given_then_shipped_then_cached_artifact(model, tokenizer, tmp_path, monkeypatch):
    """provision.obtain: an explicit directory is validated; the embedded model gets its shipped artifact; another
    name gets one cached under $OSCAR_KV_HOME/artifacts only for the same weights; else ArtifactMissing."""
    from oscar_kv.artifacts import load_shipped
    from oscar_kv.provision import ArtifactMissing, obtain
    from oscar_kv.home import artifact_cache_dir

    monkeypatch.setenv("OSCAR_KV_HOME", str(tmp_path / "home"))
    shipped = load_shipped("smollm2-135m", model)
    assert obtain("smollm2-135m", model).manifest["sha256"] == shipped.manifest["sha256"]
    with pytest.raises(ArtifactMissing, match="no rotation artifact for my-model"):
        obtain("my-model", model)
    shipped.save(artifact_cache_dir("/models/my-model"))  # a path's last part names the cache entry
    assert obtain("my-model", model).manifest["fingerprint"] == shipped.manifest["fingerprint"]
    with pytest.raises(ArtifactError, match="does not exist"):  # a given directory is never skipped
        obtain("my-model", model, directory=tmp_path / "nothing-here")
    weight = model.model.layers[0].self_attn.k_proj.weight
    saved = weight.detach().clone()
    with torch.no_grad():  # other weights: neither the shipped nor the cached artifact is used
        weight[0, 0] += 1.0
        try:
            with pytest.raises(ArtifactMissing):
                obtain("my-model", model)
        finally:
            weight.copy_(saved)


def test_artifacts_with_one_width_per_layer_load_it_for_keys_and_values(tmp_path):
    """Artifacts written before keys and values could differ hold one ``layer_bits``."""
    from safetensors.torch import load_file, save_file

    rot = per_head_artifact()
    rot.set_bits([4, 2, 2])
    rot.save(tmp_path)
    tensors = load_file(str(tmp_path / "rotations.safetensors"))
    tensors["layer_bits"] = tensors.pop("k_bits")
    del tensors["v_bits"]
    save_file(tensors, str(tmp_path / "rotations.safetensors"))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["sha256"] = hashlib.sha256((tmp_path / "rotations.safetensors").read_bytes()).hexdigest()
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    back = Rotations.load(tmp_path, GEOM)
    assert back.k_bits.tolist() == back.v_bits.tolist() == [4, 2, 2]


def test_key_and_value_widths_round_trip_and_are_validated(tmp_path):
    rot = per_head_artifact()
    rot.set_bits([3, 4, 2], [2, 2, 3])
    rot.save(tmp_path)
    back = Rotations.load(tmp_path, GEOM)
    assert back.k_bits.tolist() == [3, 4, 2] and back.v_bits.tolist() == [2, 2, 3]
    assert back.width_summary() == "K2V3 x 1, K3V2 x 1, K4V2 x 1"
    rot.set_bits([3, 5, 2], [2, 2, 2])  # 5-bit keys
    rot.save(tmp_path)
    assert Rotations.load(tmp_path, GEOM).width_summary() == "K2V2 x 1, K3V2 x 1, K5V2 x 1"
    rot.set_bits([3, 6, 2], [2, 2, 2])
    with pytest.raises(ArtifactError, match="k_bits must hold one of 2, 3, 4, 5, 8, 16 per layer"):
        rot.validate()
    rot.set_bits([3, 5, 2], [2, 5, 2])  # 5 bits is a key width only
    with pytest.raises(ArtifactError, match="v_bits must hold one of 2, 3, 4, 8, 16 per layer"):
        rot.validate()
    rot.set_bits([16, 2, 2], [2, 2, 2])
    with pytest.raises(ArtifactError, match="both keys and values at 16 bits or neither"):
        rot.validate()
