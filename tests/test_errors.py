"""Errors under one base class; a setting's error names its field in Python and its flag on the command line."""

import pytest
import torch

from oscar_kv.artifacts import ArtifactError
from oscar_kv.calibration_settings import CalibrationSettings
from oscar_kv.corpus import CorpusError, read_text_file
from oscar_kv.errors import (ConfigError, ModelNotFound, NonFiniteActivations, OscarKVError, RequestError,
                             user_message)
from oscar_kv.evaluate.harness import EvalConfig
from oscar_kv.parallel import TensorParallel, TensorParallelError
from oscar_kv.quant import check_rescale, quantize_rows
from oscar_kv.rope import RopeUnsupported
from oscar_kv.server.main import ServeError, ServeConfig, build_engine


def test_setting_errors_name_fields_and_the_cli_names_flags():
    with pytest.raises(ConfigError) as info:
        TensorParallel(0, 2).heads(3)
    assert isinstance(info.value, TensorParallelError)
    assert str(info.value).startswith("tp 2 must divide the model's 3 KV heads")
    assert user_message(info.value).startswith("--tp 2 must divide the model's 3 KV heads")
    e = ConfigError("max_model_len 9 exceeds 8; raise kv_cache_memory (not max_model_len_x or my_max_model_len)",
                    "max_model_len", "kv_cache_memory")
    assert e.with_flags() == ("--max-model-len 9 exceeds 8; raise --kv-cache-memory (not max_model_len_x or "
                              "my_max_model_len)")
    assert user_message(ValueError("plain")) == "plain"


def test_the_errors_raised_on_purpose_share_a_base_class():
    for cls in (ConfigError, TensorParallelError, ArtifactError, ServeError, CorpusError, NonFiniteActivations,
                RopeUnsupported, RequestError):
        assert issubclass(cls, OscarKVError) and issubclass(cls, ValueError)  # callers catching ValueError still do
    assert issubclass(ModelNotFound, OscarKVError) and issubclass(ModelNotFound, FileNotFoundError)


def test_bad_settings_and_inputs_raise_oscar_errors(tmp_path):
    bad = tmp_path / "data.csv"
    bad.write_text("a,b\n")
    with pytest.raises(CorpusError, match=".txt or .jsonl"):
        read_text_file(bad)
    with pytest.raises(ConfigError, match="rope_pairs"):
        CalibrationSettings(rope_pairs=0)
    with pytest.raises(ConfigError, match="rescale strength"):
        check_rescale(2.0)
    with pytest.raises(NonFiniteActivations, match="non-finite"):
        quantize_rows(torch.full((1, 8), float("nan")))
    with pytest.raises(ConfigError, match="unknown tasks"):
        EvalConfig(tasks=["nope"])
    from oscar_kv.engine.sequence import SamplingParams
    from oscar_kv.models import resolve_model

    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ModelNotFound, match="GGUF file not found"):
        resolve_model(str(tmp_path / "missing.gguf"))


@pytest.mark.slow
def test_the_server_reports_an_engine_setting_as_its_flag(model, tokenizer):
    """An engine error from the library (field names) reaches `oscar-kv serve` users as flags."""
    with pytest.raises(ServeError, match=r"--max-model-len 100000 exceeds the model's context of 8192"):
        build_engine(ServeConfig(kv_cache_dtype="bf16", max_model_len=100000), model=model, tokenizer=tokenizer)


@pytest.mark.slow
def test_the_engine_refuses_a_dtype_it_does_not_serve(model, tokenizer, rotations):
    from oscar_kv.engine import EngineConfig, LLMEngine

    with pytest.raises(ConfigError, match="kv_cache_dtype must be 'bf16' or 'int2', got 'int4'"):
        LLMEngine(model, tokenizer, rotations, EngineConfig(kv_cache_dtype="int4"))
    config = EngineConfig()
    config.kv_cache_dtype = "int4"  # changed after it was validated: the engine validates again
    with pytest.raises(ConfigError, match="kv_cache_dtype must be 'bf16' or 'int2', got 'int4'"):
        LLMEngine(model, tokenizer, rotations, config)
