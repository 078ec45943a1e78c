"""Shared fixtures: the embedded SmolLM2 model (loaded once) and a small calibrated artifact."""

import os

import pytest
import torch

# Triton decides at decoration time whether a @triton.jit function is interpreted; any module may import the
# kernels first (evaluation, engine, benchmarks), so without CUDA the interpreter must be on before any import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(torch.get_num_threads(), 1))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small decode steps run faster on one thread, and much faster when other jobs share the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smol():
    from oscar_kv.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture
def model(smol):
    """The session model, restored to its original weights and exact attention after each test."""
    from oscar_kv.cache import unprepare_model

    lm, _ = smol
    yield lm
    unprepare_model(lm)


@pytest.fixture(scope="session")
def tokenizer(smol):
    return smol[1]


@pytest.fixture(scope="session")
def rotations(smol, tmp_path_factory):
    """OSCAR rotations calibrated on 2048 tokens of the shipped corpus, saved and reloaded."""
    from oscar_kv.artifacts import Rotations
    from oscar_kv.cache import unprepare_model
    from oscar_kv.calibrate import calibrate
    from oscar_kv.calibration_settings import CalibrationSettings

    lm, tok = smol
    settings = CalibrationSettings(calib_tokens=2048, probe_tokens=1024, max_kl=None, max_answer_kl=None)
    rot = calibrate(lm, tok, settings, progress=False)
    unprepare_model(lm)
    directory = tmp_path_factory.mktemp("artifact")
    rot.save(directory)
    return Rotations.load(directory)


@pytest.fixture(scope="session")
def held_out_ids(tokenizer):
    """1088 tokens of real text that calibration (which reads the corpus from its start) never sees."""
    from oscar_kv.corpus import DEFAULT_CORPUS

    text = DEFAULT_CORPUS.read_text()[200_000:260_000]
    return tokenizer(text, return_tensors="pt").input_ids[:, :1088]
