"""bench decode --prefill-only: prefill time of BF16 and INT2 (the synthetic calibrated-like artifact) per context,
on the CPU's torch reference path (schema and positive numbers; timings are not meaningful there)."""

import json

import pytest

from oscar_kv.bench.decode import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_prefill_only_reports_both_schemes_and_no_decode(tmp_path, capsys):
    args = ["--arch", "tiny", "--layers", "2", "--contexts", "300,600", "--device", "cpu", "--kv-cache-memory", "0.004",
            "--max-num-batched-tokens", "256", "--prefill-only", "--output", str(tmp_path)]
    assert main(args) == 0
    data = json.loads((tmp_path / "decode.json").read_text())
    assert data["errors"] == [] and data["decode"] == [] and data["breakdown"] == []
    assert data["settings"]["prefill_only"] and data["settings"]["key_centering"] == "rope"  # the shipped shape
    rows = {(r["scheme"], r["context"]): r for r in data["prefill"]}
    assert set(rows) == {(s, c) for s in ("bf16", "int2") for c in (300, 600)}
    for (scheme, ctx), r in rows.items():
        assert r["seconds"] > 0 and r["chunks"] == -(-ctx // 256) and 0 < r["attend_seconds"] < r["seconds"], r
        assert r["seconds"] == pytest.approx(ctx / r["tokens_per_s"], abs=6e-4)  # seconds are rounded to 1 ms
    out = capsys.readouterr().out
    assert "prefill int2 / bf16 time at 600:" in out
    m = data["model"]
    for (scheme, ctx), r in rows.items():  # the compute floor: weight GEMMs plus causal attention, no GEMM rate here
        attention = 4 * m["num_attention_heads"] * m["head_dim"] * ctx * (ctx + 1) / 2 * m["num_layers"]
        assert r["floor_flops"] == pytest.approx(2 * m["token_matmul_parameters"] * ctx + attention)
        assert "floor_seconds" not in r
    assert 0 < m["token_matmul_parameters"] < m["parameters"]


def test_prefill_floor_of_qwen3_8b_at_100k():
    """NOTES.md's hand count (run E7): 1.39 PFLOP of weight GEMMs and 2.95 PFLOP of causal attention."""
    from oscar_kv.bench.decode import prefill_floor

    info = dict(token_matmul_parameters=6_946_000_000, num_attention_heads=32, head_dim=128, num_layers=36)
    floor = prefill_floor(info, 100_000, 790e12)
    assert floor["floor_flops"] == pytest.approx(1.39e15 + 2.95e15, rel=0.01)
    assert floor["floor_seconds"] == pytest.approx(5.5, rel=0.01)
