"""Obtaining a model: a converted GGUF is published in one rename, so processes converting the same file at once
(a server and a calibration started together) never see or leave a half-written directory."""

from oscar_kv.home import cache_home
from oscar_kv.models import publish_dir, resolve_model


def _finished(path, marker):
    path.mkdir()
    (path / "oscar_kv_source.json").write_text(marker)
    return path


def test_the_first_conversion_to_finish_wins_and_the_other_is_dropped(tmp_path):
    target = tmp_path / "model-abc"
    first = _finished(tmp_path / ".model-abc.partial-1", "first")
    second = _finished(tmp_path / ".model-abc.partial-2", "second")
    assert publish_dir(first, target) == target
    assert publish_dir(second, target) == target  # lost the race: uses the winner's directory
    assert (target / "oscar_kv_source.json").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-abc"]


def test_the_embedded_model_resolves_to_a_whole_directory():
    path = resolve_model("smollm2-135m")
    assert (path / "oscar_kv_source.json").is_file() and (path / "config.json").is_file()
    assert not [p for p in (cache_home() / "models").iterdir() if ".partial-" in p.name]


def test_yarn_extends_the_context_of_a_plain_rope_model_and_refuses_anything_else():
    import pytest
    from transformers import LlamaConfig

    from oscar_kv.models.loading import with_yarn

    config = LlamaConfig(max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 1e5})
    with_yarn(config, 4)
    assert config.max_position_embeddings == 32768
    assert config.rope_parameters == {"rope_type": "yarn", "rope_theta": 1e5, "factor": 4.0,
                                      "original_max_position_embeddings": 8192}
    with pytest.raises(ValueError, match="plain RoPE"):
        with_yarn(config, 2)  # already scaled
    with pytest.raises(ValueError, match="above 1"):
        with_yarn(LlamaConfig(), 1)
