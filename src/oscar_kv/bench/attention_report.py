"""The attention benchmark's report: its tables (the K2V2 kernel against the BF16 baselines, then one row per timed
(key bits, value bits) pair and the whole-model estimate) and its plot."""

from __future__ import annotations

import math


def _fmt_row(r: dict) -> str:
    def f(k):
        v = r.get(k)
        return f"{v * 1e3:9.1f}" if v else "        -"
    return (f"{r['context']:>7} {r['batch']:>4} {f('sdpa_flash_ms')} {f('sdpa_cudnn_ms')} {f('sdpa_efficient_ms')} "
            f"{f('bf16_paged_ms')} {f('int2_triton_ms')} {f('int2_ms')} {f('int2_rope_ms')} {r['speedup']:7.2f}x {100 * r['int2_bw_fraction']:6.1f}% "
            f"{100 * r['bf16_best_bw_fraction']:6.1f}%" +
            (f" | rope {r['rope_speedup']:5.2f}x bf16, {r['rope_over_constant']:5.2f}x const"
             if r.get("rope_speedup") else "") +
            (f" | kernels {r['best_bf16_kernel_ms'] * 1e3:8.1f} {r['int2_kernel_ms'] * 1e3:7.1f} {r['kernel_speedup']:6.2f}x"
             if r.get("kernel_speedup") else ""))


def widths_line(result: dict) -> str:
    """Which widths the run timed, in words (every table carries it)."""
    w = result.get("widths") or {}
    if not w:
        return "widths: K2 / V2 (INT2 columns)"
    return (f"widths: {w['label']} ({w['rule']}; {w['bits_per_element']:.3f} bits/element at {w['context']} tokens); "
            f"the INT2 columns time K2V2")


def _fmt_width(ctx: int, bs: int, w: dict) -> str:
    def num(key, fmt, scale=1.0, suffix=""):
        v = w.get(key)
        if v is None:
            return format("-", f">{len(format(1.0, fmt)) + len(suffix)}")
        return format(v * scale, fmt) + suffix
    layers = "ref" if w.get("reference") and not w["layers"] else str(w["layers"])
    return (f"{ctx:>7} {bs:>4} {w['widths']:<6} {layers:>6} {w.get('kernel', '-'):<7} {num('ms', '9.1f', 1e3)} "
            f"{w['bytes'] / 1e6:9.2f} {num('GBps', '7.0f')} {num('copy_fraction', '6.1f', 100, '%')} "
            f"{num('over_k2v2', '6.2f', 1, 'x')} {num('speedup_vs_bf16', '7.2f', 1, 'x')}")


def print_widths(result: dict) -> None:
    """One row per (context, batch, timed pair), the K2V2 reference first, then the whole-model estimate."""
    rows = [r for r in result["rows"] if r.get("by_width")]
    if not rows or all(len(r["by_width"]) == 1 and r["by_width"][0]["widths"] == "K2V2" for r in rows):
        return
    print(f"\nper (key, value) width pair, one layer each; {widths_line(result)}")
    print("read = codes + scales/zero points + BF16 window + q/out; %copy = GB/s over the copy bandwidth; /K2V2 = time over "
          "the K2V2 kernel's (same shape, same centering); BF16/x = best BF16 time over this one; model = the layers x "
          "their pair's time")
    print(f"{'ctx':>7} {'bs':>4} {'pair':<6} {'layers':>6} {'kernel':<7} {'us':>9} {'read MB':>9} {'GB/s':>7} "
          f"{'%copy':>7} {'/K2V2':>7} {'BF16/x':>8}")
    notes = {}
    for r in rows:
        for w in r["by_width"] + ([r["model_estimate"]] if r.get("model_estimate") else []):
            print(_fmt_width(r["context"], r["batch"], w))
            if w.get("kernel_note"):
                notes[(w["widths"], w["kernel"])] = w["kernel_note"]
    for (pair, kernel), why in sorted(notes.items()):
        print(f"{pair} on {kernel}: {why}")


def print_table(result: dict) -> None:
    print(f"\n{result['device']}  copy bandwidth {result['copy_bandwidth_GBps']:.0f} GB/s; times in us per call "
          f"(median, L2 flushed; an empty kernel: {result.get('launch_floor_ms', 0) * 1e3:.1f} us); speedup = best BF16 / INT2")
    print(widths_line(result))
    print(f"{'ctx':>7} {'bs':>4} {'sdpa-fa':>9} {'sdpa-cudnn':>9} {'sdpa-eff':>9} {'bf16-pg':>9} {'int2-tri':>9} {'int2':>9} {'int2+rope':>9} "
          f"{'speedup':>8} {'int2-bw':>7} {'bf16-bw':>7} | {'GPU kernel time only: best BF16, INT2, speedup'}")
    for r in result["rows"]:
        print(_fmt_row(r))
    print_widths(result)
    for s in result["skipped"]:
        print("skipped:", s)
    for k, v in result.get("write_path", {}).items():
        print(f"{k}: {v:.4g}")


def _plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print("matplotlib is not importable: no PNG written")
        return
    rows = result["rows"]
    if not rows:
        return
    bss = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(bss), figsize=(5 * len(bss), 4), squeeze=False)
    for ax, bs in zip(axes[0], bss):
        rr = sorted((r for r in rows if r["batch"] == bs), key=lambda r: r["context"])
        x = [r["context"] // 1024 for r in rr]
        for key, label in (("best_bf16_ms", "best BF16"), ("bf16_paged_ms", "BF16 paged (ours)"),
                           ("int2_ms", "INT2 paged (ours)"), ("int2_floor_ms", "INT2 bandwidth floor")):
            ax.plot(x, [r.get(key) or math.nan for r in rr], marker="o", label=label)
        pairs = sorted({w["widths"] for r in rr for w in r.get("by_width", []) if w["widths"] != "K2V2"})
        for pair in pairs:  # the other widths' kernels, one layer each
            ms = [next((w.get("ms") for w in r.get("by_width", []) if w["widths"] == pair), None) for r in rr]
            ax.plot(x, [v or math.nan for v in ms], marker="s", linestyle=":", label=f"{pair} paged (ours)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (K tokens)")
        ax.set_ylabel("ms per decode call (one layer)")
        ax.set_title(f"batch {bs}")
        ax.legend(fontsize=8)
    widths = (result.get("widths") or {}).get("label", "K2 / V2")
    fig.suptitle(f"Decode attention, {result['geometry']['num_q_heads']}/{result['geometry']['num_kv_heads']} heads of "
                 f"{result['geometry']['head_dim']}, widths {widths}, {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
