"""The config tree (config.py): every setting declared once, validated by field name, cut into levels."""

import math
from dataclasses import fields

import pytest

from oscar_kv.config import (CacheConfig, EngineConfig, HTTPConfig, ModelConfig, SchedulerConfig, ServeConfig, choices,
                             type_hints)
from oscar_kv.errors import ConfigError


def _bad_values(config_class):
    """(field, a value its declared choices or range refuse) for every field that has either."""
    hints = type_hints(config_class)
    for f in fields(config_class):
        allowed, m = choices(hints[f.name]), f.metadata
        if allowed is not None:
            yield f.name, "nonsense"
        if m.get("at_least") is not None:
            yield f.name, m["at_least"] - 1
        if m.get("above") is not None:
            yield f.name, m["above"]
            yield f.name, math.nan
        if m.get("at_most") is not None:
            yield f.name, m["at_most"] + 1


@pytest.mark.parametrize("name,value", list(_bad_values(ServeConfig)))
def test_a_value_out_of_range_names_its_field(name, value):
    with pytest.raises(ConfigError) as info:
        ServeConfig(**{name: value})
    assert info.value.fields == (name,)
    assert str(info.value).startswith(f"{name} must ")


def test_every_level_validates_its_own_fields():
    with pytest.raises(ConfigError, match="max_num_seqs must be at least 1, got 0"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ConfigError, match="kv_cache_dtype must be 'bf16', 'int2', 'int4' or 'int8', got 'int3'"):
        CacheConfig("int3")
    assert CacheConfig("int4").bits == 4  # the generate() cache stores what the engine does not serve
    with pytest.raises(ConfigError, match="kv_cache_dtype must be 'bf16' or 'int2', got 'int4'"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="port must lie in 0..65535, got 65536"):
        HTTPConfig(port=65536)
    with pytest.raises(ConfigError, match="max_model_len must be a number, got '4k'"):
        EngineConfig(max_model_len="4k")


def test_fields_that_must_agree():
    with pytest.raises(ConfigError) as info:
        EngineConfig(sink_size=24, page_size=16)
    assert info.value.fields == ("sink_size", "page_size")
    EngineConfig(kv_cache_dtype="bf16", sink_size=24)  # a BF16 pool has no sink pages
    CacheConfig(sink_size=24)  # nor does the generate() cache need whole pages
    with pytest.raises(ConfigError) as info:
        ModelConfig(tp=2, calibrate=True)
    assert info.value.with_flags().startswith("--calibrate does not run under --tp 2; make the artifact first "
                                              "(`oscar-kv calibrate --model smollm2-135m --output-dir DIR`, with "
                                              "`--tp 2` if")  # a command line in backticks stays as written
    assert info.value.with_flags().endswith("and pass --rotations DIR")


def test_the_levels_build_on_each_other():
    """One declaration per field: the engine's config is the cache's and the scheduler's, the server's all of them."""
    assert issubclass(EngineConfig, CacheConfig) and issubclass(EngineConfig, SchedulerConfig)
    for level in (ModelConfig, EngineConfig, HTTPConfig):
        assert issubclass(ServeConfig, level)
    names = [f.name for f in fields(ServeConfig)]
    assert len(names) == len(set(names))
    assert all(f.metadata.get("help") for f in fields(ServeConfig)), "every flag needs its help text"
    config = ServeConfig(kv_cache_dtype="bf16", max_model_len=1024, enable_prefix_caching=False, port=0)
    engine = config.engine
    assert type(engine) is EngineConfig
    assert engine == EngineConfig(kv_cache_dtype="bf16", max_model_len=1024, enable_prefix_caching=False)
    assert engine.part(CacheConfig) == CacheConfig("bf16")


def test_the_generate_cache_settings_are_a_cache_config():
    pytest.importorskip("torch")
    from oscar_kv.cache import CacheSettings

    assert issubclass(CacheSettings, CacheConfig)
    with pytest.raises(ConfigError) as info:
        CacheSettings(recent_size=-1)
    assert info.value.fields == ("recent_size",)
