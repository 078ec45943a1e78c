"""bench attention / bench decode at per-layer key and value widths, on the CPU: the width options, the synthetic
``--kv-bits`` allocation rule, the bytes each width reads against memory.py, and that every table and JSON says which
widths it timed.  The GPU timing paths run only with CUDA."""

import argparse
import json

import pytest
import torch

from oscar_kv.bench import attention, decode
from oscar_kv.bench.attention_report import print_table
from oscar_kv.bench.floors import decode_floor, query_output_bytes, read_bytes
from oscar_kv.bench.synthetic import GEOMETRY, kv_bits_allocation, layer_geometry, spread, width_pairs, widths_label
from oscar_kv.kernels.layout import PoolGeometry
from oscar_kv.memory import bits_per_element, kv_bytes

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU timing path")
QWEN = dict(num_layers=36, context=131072, head_dim=128, group_size=128)


def bits(k_bits, v_bits, context=131072):
    return bits_per_element(context, 128, 128, k_bits=k_bits, v_bits=v_bits)


def widths(**kw):
    return argparse.Namespace(**{"key_bits": None, "value_bits": None, "kv_bits": None, **kw})


# ---------------------------------------------------------------------------------------------- options
@pytest.mark.parametrize("argv, want", [
    ([], (None, None, None)),
    (["--key-bits", "4", "--value-bits", "2"], (4, 2, None)),
    (["--key-bits", "3"], (3, None, None)),
    (["--kv-bits", "3.0"], (None, None, 3.0)),
    (["--kv-bits", "2.9", "--value-bits", "3"], (None, 3, 2.9)),
    (["--key-bits", "5"], (5, None, None)),
])
def test_attention_parses_the_width_options(argv, want):
    ap = attention.parser()
    a = ap.parse_args(argv)
    attention.check_width_arguments(ap, a)
    assert (a.key_bits, a.value_bits, a.kv_bits) == want
    assert a.rotations == "synthetic" and a.layer == 0


@pytest.mark.parametrize("argv, words", [
    (["--kv-bits", "3", "--key-bits", "4"], "not both"),
    (["--rotations", "/some/artifact", "--key-bits", "4"], "carries its own per-layer widths"),
    (["--rotations", "/some/artifact", "--kv-bits", "3"], "carries its own per-layer widths"),
    (["--key-bits", "6"], "the kernels read keys at"),  # no kernel reads 6-bit codes: nothing to time
    (["--value-bits", "5"], "invalid choice"),  # 5 bits is a key width only
])
@pytest.mark.parametrize("main", [attention.main, decode.main])
def test_contradicting_width_options_are_refused(main, argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_width_options_with_a_hadamard_artifact_are_taken():
    ap = attention.parser()
    a = ap.parse_args(["--rotations", "hadamard", "--key-bits", "3"])
    attention.check_width_arguments(ap, a)
    art, record = attention.prepare_artifact(a.rotations, a.rope_pairs, a, 131072)
    assert record["label"] == "K3 / V2" and art.key_centering == "off"


def test_attention_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        attention.main(["--contexts", "8k", "--batch-sizes", "1", "--kv-bits", "3"])


# ---------------------------------------------------------------------------------------------- the allocation rule
def test_kv_bits_allocates_k4_and_k3_within_the_budget():
    """--kv-bits 3 on Qwen3-8B's 36 layers at 128K: values at 2, keys at K3 and K4, as many K4 as the budget holds
    (one more would exceed it), spread evenly over the layers."""
    k = kv_bits_allocation(3.0, **QWEN)
    assert set(k) == {3, 4}
    n = k.count(4)
    got = bits(k, [2] * 36)
    one_more = bits([4] * (n + 1) + [3] * (35 - n), [2] * 36)
    assert got <= 3.0 < one_more
    assert got == pytest.approx(3.0, abs=0.014)  # one layer's widening: (4.2163 - 3.2188) / 2 / 36 = 0.0139
    assert n == 20
    assert [b == 4 for b in k] == spread(20, 36)
    runs = "".join("w" if b == 4 else "n" for b in k)
    assert "nn" not in runs  # evenly: never two narrow layers in a row while most are wide


def test_kv_bits_edges_of_the_rule():
    all_k3, all_k4 = bits([3] * 36, [2] * 36), bits([4] * 36, [2] * 36)
    assert kv_bits_allocation(all_k3, **QWEN) == [3] * 36
    assert kv_bits_allocation(all_k4, **QWEN) == [4] * 36
    low = kv_bits_allocation(2.5, **QWEN)  # below the all-K3 cost: K2 and K3
    assert set(low) == {2, 3} and bits(low, [2] * 36) <= 2.5
    values3 = kv_bits_allocation(3.3, value_bits=3, **QWEN)  # the values' width counts against the budget
    assert set(values3) == {3, 4} and bits(values3, [3] * 36) <= 3.3
    all_k5 = bits([5] * 36, [2] * 36)
    above_k4 = kv_bits_allocation((all_k4 + all_k5) / 2, **QWEN)  # past every key at 4: some at 5
    assert set(above_k4) == {4, 5} and bits(above_k4, [2] * 36) <= (all_k4 + all_k5) / 2
    assert kv_bits_allocation(all_k5, **QWEN) == [5] * 36
    high = kv_bits_allocation(4.5, **QWEN)  # past every key at 5: some at 8 (the widest kernel width)
    assert all_k5 < 4.5 and set(high) == {5, 8} and bits(high, [2] * 36) <= 4.5
    for x in (2.0, bits([8] * 36, [2] * 36) + 0.1):
        with pytest.raises(ValueError, match="outside"):
            kv_bits_allocation(x, **QWEN)
    assert spread(0, 4) == [False] * 4 and spread(4, 4) == [True] * 4 and sum(spread(7, 36)) == 7


def test_synthetic_artifact_takes_the_widths_asked_for():
    art, record = attention.prepare_artifact("synthetic", 8, widths(kv_bits=3.0), 131072)
    assert art.key_centering == "rope"  # still calibrated-like
    assert record["label"] == "K3x16 K4x20 / V2"
    assert record["layers"] == {"K3V2": 16, "K4V2": 20}
    assert record["bits_per_element"] == pytest.approx(bits(art.k_bits.tolist(), art.v_bits.tolist()), abs=1e-4)
    assert record["context"] == 131072 and "--kv-bits 3" in record["rule"]
    art, record = attention.prepare_artifact("synthetic", 8, widths(key_bits=4), 131072)
    assert record["label"] == "K4 / V2" and record["layers"] == {"K4V2": 36}
    art, record = attention.prepare_artifact("synthetic", 8, None, 131072)  # the default: INT2, as older results
    assert record["label"] == "K2 / V2" and record["rule"] == "the artifact's k_bits / v_bits"
    with pytest.raises(SystemExit, match="outside"):
        attention.prepare_artifact("synthetic", 8, widths(kv_bits=6.0), 131072)


def test_synthetic_split_pool_has_finite_tail_scales():
    """Random bytes in a split row's tail would make one first-part scale in 32 NaN or infinite (NaN logits)."""
    from oscar_kv.bench.synthetic import _fill_pool, _mixed_batch
    from oscar_kv.kernels.layout import PagedKVPool
    from oscar_kv.kernels.split_keys import tile_views
    from oscar_kv.quant import parse_key_width

    geom = layer_geometry(parse_key_width("4x16+2"), 2)
    _, nq, nw = _mixed_batch(geom, 2, 4096, "cpu", torch.Generator().manual_seed(0))
    pool = PagedKVPool.allocate(geom, nq, nw, device="cpu")
    _fill_pool(pool)
    tail = tile_views(pool.layer(0)["k_codes"], geom.k_split[0], geom.head_dim)[1]
    scales = tail[..., :2].contiguous().view(torch.float16).float()
    assert scales.numel() == nq * geom.num_kv_heads * geom.page_size
    assert scales.min() >= 0.01 and scales.max() <= 0.1
    assert len(tail[..., 3:].unique()) > 200  # the upper bits stay random


def test_widths_label_and_pairs():
    assert widths_label([2] * 4, [2] * 4) == "K2 / V2"
    assert widths_label([3, 4, 3, 3], [2] * 4) == "K3x3 K4x1 / V2"
    assert widths_label([3, 4], [2, 4]) == "K3x1 K4x1 / V2x1 V4x1"
    assert widths_label([16] * 2, [16] * 2) == "BF16"
    assert width_pairs([3, 4, 3, 2], [2, 2, 2, 2]) == {(2, 2): [3], (3, 2): [0, 2], (4, 2): [1]}


# ---------------------------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("k, v", [(2, 2), (3, 2), (4, 2), (2, 4), (4, 4)])
@pytest.mark.parametrize("ctx", [8192, 32768, 131072])
def test_bytes_of_a_call_at_each_width_match_memory_accounting(k, v, ctx):
    """codes + scales and zero points + BF16 window of one layer's call = memory.py's bytes at those widths (contexts whose
    history fills whole pages), the codes alone D x (k + v) / 8 per token and head."""
    g = layer_geometry(k, v)
    h, d, bs = GEOMETRY["num_kv_heads"], GEOMETRY["head_dim"], 4
    rb = read_bytes(g, bs, ctx)
    kv = rb["codes"] + rb["metadata"] + rb["window"]
    assert kv == kv_bytes(ctx, 1, h, d, batch=bs, group_size=128, k_bits=[k], v_bits=[v])
    assert kv == bs * g.layer_read_bytes(ctx)
    quant = ctx - GEOMETRY["sink_size"] - GEOMETRY["recent_size"]
    assert rb["codes"] == bs * h * quant * d * (k + v) // 8
    assert rb["metadata"] == bs * h * quant * 2 * 3  # float16 scale + uint8 zero point, keys and values, one group
    assert rb["query_output"] == query_output_bytes(g, bs) == 2 * bs * 32 * d * 2
    assert rb["total"] == attention.int2_bytes(g, bs, ctx)


def test_decode_floor_counts_each_layer_at_its_widths():
    k_bits, v_bits = (3, 4, 3, 2), (2, 2, 4, 2)
    g = PoolGeometry(num_layers=4, num_kv_heads=8, head_dim=128, group_size=128, k_bits=k_bits, v_bits=v_bits)
    ctx, batch = 32768, 3
    floor = decode_floor(g, 10**9, ctx, batch, 3e12)
    assert floor["kv_read_bytes"] == kv_bytes(ctx, 4, 8, 128, batch=batch, group_size=128, k_bits=list(k_bits),
                                              v_bits=list(v_bits))
    assert floor["floor_bytes"] == 10**9 + floor["kv_read_bytes"]
    assert floor["floor_ms"] == pytest.approx(floor["floor_bytes"] / 3e12 * 1e3, abs=1e-3)
    int2 = decode_floor(PoolGeometry(num_layers=4, num_kv_heads=8), 10**9, ctx, batch, 3e12)
    assert int2["kv_read_bytes"] < floor["kv_read_bytes"]


# ---------------------------------------------------------------------------------------------- what gets printed
def fake_result(record, art):
    """An attention result as a GPU run writes it, with made-up times (the widths table's arithmetic is real)."""
    bw = 3.0e12
    row = dict(context=131072, batch=8, int2_ms=0.28, int2_rope_ms=0.30, best_bf16_ms=1.40, speedup=5.0,
               int2_bw_fraction=0.5, bf16_best_bw_fraction=0.9)
    pairs = width_pairs(art.k_bits.tolist(), art.v_bits.tolist())
    times = {(2, 2): 0.30, (3, 2): 0.36, (4, 2): 0.40}
    entries = [attention.width_entry(p, pairs.get(p, []), times[p], None, ("cuda" if p == (2, 2) else "triton",
                                                                           None if p == (2, 2) else "why not"),
                                     layer_geometry(*p), 8, 131072, bw, 0.30, 1.40, layer=0, centering="rope",
                                     **({"reference": True} if p == (2, 2) else {}))
               for p in [(2, 2)] + [p for p in pairs if p != (2, 2)]]
    row["by_width"] = entries
    row["model_estimate"] = attention.model_estimate(entries, 36, 0.30, 1.40, bw)
    return dict(device="fake", copy_bandwidth_GBps=bw / 1e9, geometry=GEOMETRY, widths=record, skipped=[], rows=[row])


def test_attention_table_and_json_carry_the_widths(capsys):
    art, record = attention.prepare_artifact("synthetic", 8, widths(kv_bits=3.0), 131072)
    result = fake_result(record, art)
    row = result["rows"][0]
    k3 = next(w for w in row["by_width"] if w["widths"] == "K3V2")
    assert k3["layers"] == 16 and k3["over_k2v2"] == pytest.approx(0.36 / 0.30)
    assert k3["speedup_vs_bf16"] == pytest.approx(1.40 / 0.36)
    assert k3["GBps"] == pytest.approx(k3["read"]["total"] / 0.36e-3 / 1e9)
    assert k3["copy_fraction"] == pytest.approx(k3["GBps"] / 3000)
    assert row["by_width"][0]["widths"] == "K2V2" and row["by_width"][0]["reference"] and \
        row["by_width"][0]["layers"] == 0
    est = row["model_estimate"]
    assert est["ms"] == pytest.approx(16 * 0.36 + 20 * 0.40)
    assert est["over_k2v2"] == pytest.approx(est["ms"] / (36 * 0.30))
    assert est["speedup_vs_bf16"] == pytest.approx(36 * 1.40 / est["ms"])
    assert est["bytes"] == 16 * k3["bytes"] + 20 * row["by_width"][2]["bytes"]
    print_table(result)
    out = capsys.readouterr().out
    assert "widths: K3x16 K4x20 / V2" in out and "the INT2 columns time K2V2" in out
    for words in ("K3V2", "K4V2", "model", "K3V2 on triton: why not"):
        assert words in out, words
    back = json.loads(json.dumps(result))
    assert back["widths"]["label"] == "K3x16 K4x20 / V2"
    assert {w["widths"] for w in back["rows"][0]["by_width"]} == {"K2V2", "K3V2", "K4V2"}


def test_a_k2v2_run_prints_no_widths_table(capsys):
    art, record = attention.prepare_artifact("synthetic", 8, None, 131072)
    print_table(fake_result(record, art))
    out = capsys.readouterr().out
    assert "widths: K2 / V2" in out and "per (key, value) width pair" not in out


@pytest.mark.usefixtures("one_torch_thread")
def test_decode_times_the_mixed_widths_beside_bf16_and_int2(tmp_path, capsys):
    """On the CPU (torch reference path: timings not meaningful): the mixed scheme runs at the synthetic widths in
    the same run as bf16 and int2 (K2V2), every row names its widths, the step's KV bytes are counted at them."""
    args = ["--arch", "tiny", "--layers", "2", "--batch-sizes", "1", "--decode-steps", "2", "--warmup-steps", "1",
            "--device", "cpu", "--kv-cache-memory", "0.004", "--contexts", "600", "--breakdown-steps", "0",
            "--throughput-steps", "0", "--key-bits", "4", "--output", str(tmp_path)]
    assert decode.main(args) == 0
    data = json.loads((tmp_path / "decode.json").read_text())
    assert data["errors"] == []
    assert data["settings"]["schemes"] == ["bf16", "int2", "mixed"]
    assert data["settings"]["widths"] == {"bf16": "BF16", "int2": "K2 / V2", "mixed": "K4 / V2"}
    assert data["settings"]["allocation"]["layers"] == {"K4V2": 2}
    assert "K4V2 x 2" in data["schemes"]["mixed"]["describe"][0]  # the engine ran the widths
    rows = {r["scheme"]: r for r in data["decode"]}
    for scheme, w in data["settings"]["widths"].items():
        assert rows[scheme]["widths"] == w and rows[scheme]["measured"]
    assert rows["bf16"]["kv_read_bytes"] > rows["mixed"]["kv_read_bytes"] > rows["int2"]["kv_read_bytes"]
    mixed = next(s for s in data["speedup"] if s["scheme"] == "mixed")
    assert mixed["engine_step"] > 0 and mixed["engine_step_over_int2"] > 0 and mixed["widths"] == "K4 / V2"
    out = capsys.readouterr().out
    assert "widths: bf16 BF16; int2 K2 / V2; mixed K4 / V2" in out
    assert "prefill mixed / bf16 time at 600" in out


@pytest.mark.usefixtures("one_torch_thread")
def test_decode_refuses_mixed_without_other_widths(capsys):
    with pytest.raises(SystemExit, match="every layer at K2V2"):
        decode.main(["--arch", "tiny", "--layers", "2", "--device", "cpu", "--kv-cache-memory", "0.004",
                     "--contexts", "600", "--kv-cache-dtype", "bf16,mixed"])


# ---------------------------------------------------------------------------------------------- on the GPU
@cuda
def test_attention_times_one_layer_per_pair_on_the_gpu(tmp_path):
    attention.main(["--contexts", "8k", "--batch-sizes", "1", "--no-sweep", "--no-write-path", "--kv-bits", "3.4",
                    "--output", str(tmp_path)])  # at 8K tokens 3.4 bits: keys at K3 and K4
    data = json.loads((tmp_path / "attention.json").read_text())
    assert data["widths"]["label"].endswith("/ V2")
    (row,) = data["rows"]
    pairs = {w["widths"]: w for w in row["by_width"]}
    assert set(pairs) == {"K2V2", "K3V2", "K4V2"}
    for w in pairs.values():
        assert w["ms"] > 0 and w["kernel"] in ("cuda", "triton") and 0 < w["copy_fraction"] < 1.5, w
    assert row["model_estimate"]["ms"] == pytest.approx(sum(w["layers"] * w["ms"] for w in pairs.values()))


@cuda
def test_decode_runs_the_mixed_widths_on_the_gpu(tmp_path):
    args = ["--arch", "tiny", "--layers", "2", "--batch-sizes", "1", "--decode-steps", "4", "--contexts", "2048",
            "--kv-cache-memory", "0.05", "--breakdown-steps", "0", "--throughput-steps", "0", "--key-bits", "3",
            "--output", str(tmp_path)]
    assert decode.main(args) == 0
    data = json.loads((tmp_path / "decode.json").read_text())
    assert data["errors"] == [] and data["settings"]["schemes"] == ["bf16", "int2", "mixed"]
    rows = {r["scheme"]: r for r in data["decode"]}
    assert all(r["measured"] and r["floor_ms"] > 0 for r in rows.values())
    assert "decode_kernel" in data["schemes"]["mixed"]
