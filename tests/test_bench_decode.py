"""The end-to-end decode benchmark on the CPU (engine's torch reference path): output schema, positive
numbers, and contexts beyond the KV budget reported as not fitting instead of crashing."""

import json

import pytest

from oscar_kv.bench.decode import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py: small steps run faster on one thread

TINY = ["--arch", "tiny", "--layers", "2", "--batch-sizes", "1,2", "--decode-steps", "2", "--warmup-steps", "1",
        "--device", "cpu", "--kv-cache-memory", "0.004"]


def rows_of(data, scheme, context):
    return {r["batch"]: r for r in data["decode"]
            if r["scheme"] == scheme and r["context"] == context and not r.get("throughput_run")}


def test_decode_benchmark_writes_json_with_positive_numbers(tmp_path):
    assert main(TINY + ["--contexts", "600", "--output", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "decode.json").read_text())
    for key in ("device", "torch", "triton", "date", "model", "settings", "schemes", "prefill", "decode", "speedup",
                "throughput_at_budget", "breakdown", "errors"):
        assert key in data
    assert data["timing_meaningful"] is False  # CPU
    assert data["errors"] == []
    assert data["model"]["arch"] == "tiny" and data["model"]["num_layers"] == 2
    # the INT2 artifact is shaped as calibrate ships it (issue 23): per-position key means by default
    assert data["settings"]["int2_rotations"] == "synthetic" and data["settings"]["key_centering"] == "rope"
    for scheme in ("bf16", "int2"):
        plan = data["schemes"][scheme]["plan"]
        assert plan["capacity_tokens"] > 0 and plan["total_bytes"] <= 0.004e9
        rows = rows_of(data, scheme, 600)
        assert set(rows) == {1, 2}
        for b, r in rows.items():
            assert r["fits"] and r["measured"], r
            assert r["steps"] == 2
            for k in ("step_ms", "runner_ms", "forward_ms", "tokens_per_s_per_seq", "tokens_per_s",
                      "forward_tokens_per_s"):
                assert r[k] > 0, (k, r)
            assert r["tokens_per_s"] == pytest.approx(b * r["tokens_per_s_per_seq"], rel=1e-3)
        assert any(p["scheme"] == scheme and p["context"] == 600 and p["seconds"] > 0 for p in data["prefill"])
    assert {(s["context"], s["batch"]) for s in data["speedup"]} == {(600, 1), (600, 2)}
    assert all(s["engine_step"] > 0 and s["forward"] > 0 for s in data["speedup"])
    tp = data["throughput_at_budget"]
    assert tp["context"] == 600
    for scheme in ("bf16", "int2"):
        e = tp["schemes"][scheme]
        assert e["max_batch"] >= 2 and e["measured"] and e["tokens_per_s"] > 0
        assert e["batch"] == min(e["max_batch"], 256)
    breakdown = {(b["scheme"], b["batch"]): b for b in data["breakdown"]}
    assert ("int2", 1) in breakdown and ("bf16", 2) in breakdown
    bd = breakdown[("int2", 1)]
    assert bd["step_ms"] > 0 and bd["context"] == 600
    assert {"attention", "key_rotation", "query_rotation", "kv_write_and_migration", "rest_of_model",
            "scheduler_and_bookkeeping"} <= set(bd["regions_ms"])
    assert bd["regions_ms"]["attention"] > 0 and bd["regions_ms"]["rest_of_model"] > 0
    assert "torch reference" in bd["attention_path"]
    assert (tmp_path / "decode.png").stat().st_size > 0


def test_context_beyond_the_budget_is_reported_not_crashed(tmp_path):
    args = TINY + ["--contexts", "600,50000", "--breakdown-steps", "0", "--output", str(tmp_path)]
    assert main(args) == 0
    data = json.loads((tmp_path / "decode.json").read_text())
    assert data["errors"] == []
    for scheme in ("bf16", "int2"):
        assert all(r["measured"] for r in rows_of(data, scheme, 600).values())
        big = rows_of(data, scheme, 50000)
        assert set(big) == {1, 2}
        for r in big.values():
            assert r["fits"] is False and "does not fit" in r["reason"] and "capacity" in r["reason"]
        e = data["throughput_at_budget"]["schemes"][scheme]
        assert e["max_batch"] == 0 and not e["measured"]
    big_speedups = [s for s in data["speedup"] if s["context"] == 50000]
    assert big_speedups and all(s["engine_step"] is None and s["note"] for s in big_speedups)


def test_calibrated_like_artifact_has_the_shipped_shape():
    """bench.attention.calibrated_like: per-head orthogonal rotations, a constant key mean and per-position
    means live in rope.DEFAULT_PAIRS pairs per head (what calibrate keeps by default on the real models), large as
    a k_proj bias makes them; it validates as an artifact."""
    import torch

    from oscar_kv.bench.attention import calibrated_like, load_rotations
    from oscar_kv.models import AttentionGeometry
    from oscar_kv.rope import DEFAULT_PAIRS, kernel_pairs

    g = AttentionGeometry("qwen3", 3, 8, 4, 64)
    rot = calibrated_like(g)
    assert rot.key_centering == "rope" and rot.scope == "per-head"
    live = (rot.k_rope_mean[..., :32] != 0) | (rot.k_rope_mean[..., 32:] != 0)
    assert (live.sum(-1) == DEFAULT_PAIRS).all()
    assert rot.k_rope_mean.abs().max() > 20 and (rot.k_mean != 0).any()
    assert kernel_pairs(rot.k_rope_mean[0]).shape == (4, DEFAULT_PAIRS)
    every = calibrated_like(g, pairs=32)  # D/2 = 32: every pair
    assert kernel_pairs(every.k_rope_mean[0]).shape == (4, 32)
    assert not torch.equal(rot.k_rotation[0, 0], rot.k_rotation[0, 1])
    assert load_rotations("hadamard", g).key_centering == "off"


def test_breakdown_line_says_when_kernel_times_include_pdl_waits():
    """With PDL a profiled kernel's time includes its wait for the kernel before it; the breakdown line says so, and
    says nothing when the kernels were launched plainly."""
    from oscar_kv.bench.report import fmt_breakdown

    bd = dict(scheme="int2", context=32000, batch=1, step_ms=5.0, regions_ms={"attention": 1.0},
              gpu_kernels=dict(kernel_ms_per_step=6.7, busy_fraction=0.05, groups_ms={"gemm": 4.6}, pdl=True))
    assert "PDL on" in fmt_breakdown(bd) and "OSCAR_KV_PDL=off" in fmt_breakdown(bd)
    bd["gpu_kernels"]["pdl"] = False
    assert "PDL" not in fmt_breakdown(bd) and "GPU kernels 6.70 ms/step" in fmt_breakdown(bd)


def test_kernel_source_ab_runs_bench_decode_per_source_and_round(tmp_path):
    """benchmarks/cuda_int2_e2e_ab.py: one bench decode process per (round, source), every measured step recorded
    and the best per source; a missing source is refused before anything runs.  (On the CPU no CUDA kernel runs:
    this checks the plumbing, the GPU run is the measurement.)"""
    import importlib.util
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("cuda_int2_e2e_ab", root / "benchmarks" / "cuda_int2_e2e_ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    shipped = root / "src" / "oscar_kv" / "kernels" / "int2_decode.cu"
    other = shutil.copy(shipped, tmp_path / "other.cu")
    out = tmp_path / "ab.json"
    with pytest.raises(SystemExit):
        ab.main(["--sources", f"{shipped},{tmp_path / 'missing.cu'}", "--rounds", "1"])
    tiny = ["--arch", "tiny", "--layers", "2", "--batch-sizes", "1", "--decode-steps", "2", "--warmup-steps", "1",
            "--device", "cpu", "--kv-cache-memory", "0.004", "--contexts", "300", "--kv-cache-dtype", "int2"]
    args = ["--sources", f"{shipped},{other}", "--rounds", "2", "--output", str(out), "--", *tiny]
    assert ab.main(args) == 0
    data = json.loads(out.read_text())
    assert [(r["round"], Path(r["source"]).name) for r in data["runs"]] == [
        (0, "int2_decode.cu"), (0, "other.cu"), (1, "int2_decode.cu"), (1, "other.cu")]
    for run in data["runs"]:
        assert set(run["steps"]) == {"int2/300/1"} and run["steps"]["int2/300/1"] > 0
    for s in (str(shipped), str(other)):
        assert data["best"][s]["int2/300/1"] == min(r["steps"]["int2/300/1"] for r in data["runs"] if r["source"] == s)
