"""The decode benchmark's report: INT2 and mixed-width / BF16 ratios (and mixed / INT2), the tables it prints, and
its plot."""

from __future__ import annotations

QUANTIZED = ("int2", "mixed")  # the schemes compared with bf16; mixed with int2 as well
STYLES = (("bf16", "--"), ("int2", "-"), ("mixed", ":"))


def _ratio(base: dict, r: dict) -> dict:
    """Tokens/s of ``r`` over ``base``'s (the inverse ratio of step times), engine step and forward."""
    if r.get("measured") and base.get("measured"):
        return dict(engine_step=round(base["step_ms"] / r["step_ms"], 3),
                    forward=round(base["forward_ms"] / r["forward_ms"], 3))
    return dict(engine_step=None, forward=None,
                note="; ".join(x.get("reason") or x.get("error") or f"{x['scheme']}: not measured"
                               for x in (base, r) if not x.get("measured")))


def speedups(result: dict) -> None:
    """Per (quantized scheme, context, batch): tokens/s over BF16's (``engine_step``, ``forward``), and for the mixed
    widths over INT2's (``engine_step_over_int2``, ``forward_over_int2``)."""
    rows = {(r["scheme"], r["context"], r["batch"]): r for r in result["decode"]}
    for (scheme, ctx, b), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        if scheme not in QUANTIZED:
            continue
        base, int2 = rows.get(("bf16", ctx, b)), rows.get(("int2", ctx, b))
        if base is None and (scheme == "int2" or int2 is None):
            continue
        entry = dict(scheme=scheme, context=ctx, batch=b, widths=r.get("widths"))
        entry.update(_ratio(base, r) if base is not None else dict(engine_step=None, forward=None, note="no bf16 row"))
        if scheme != "int2" and int2 is not None:
            over = _ratio(int2, r)
            entry.update(engine_step_over_int2=over["engine_step"], forward_over_int2=over["forward"])
        result["speedup"].append(entry)


def finish_throughput(tp: dict | None) -> None:
    if not tp:
        return
    s = tp["schemes"]
    a = s.get("bf16", {})
    for scheme in QUANTIZED:
        b = s.get(scheme, {})
        if a.get("max_batch") is not None and b.get("max_batch") is not None:
            tp[f"max_batch_ratio_{scheme}_over_bf16"] = (round(b["max_batch"] / a["max_batch"], 2) if a["max_batch"]
                                                         else None)
        if a.get("tokens_per_s") and b.get("tokens_per_s"):
            tp[f"tokens_per_s_ratio_{scheme}_over_bf16"] = round(b["tokens_per_s"] / a["tokens_per_s"], 2)


# ---------------------------------------------------------------------------------------------- output
def fmt_row(r: dict) -> str:
    floor = f"{r['floor_ms']:9.2f} {100 * r['of_floor']:6.1f}%" if "floor_ms" in r else f"{'-':>9} {'-':>7}"
    kv = f"{r['kv_read_bytes'] / 1e6:9.1f}" if "kv_read_bytes" in r else f"{'-':>9}"
    return (f"{r['scheme']:>5} {r['context']:>7} {r['batch']:>4} {r['step_ms']:9.2f} {r['runner_ms']:9.2f} "
            f"{r['plan_ms']:8.2f} {r['forward_ms']:9.2f} {kv} {floor} {r['tokens_per_s_per_seq']:9.1f} "
            f"{r['forward_tokens_per_s_per_seq']:9.1f} {r['tokens_per_s']:9.1f}")


def widths_line(result: dict) -> str:
    """Which widths each scheme ran, in words (every table carries it)."""
    s = result["settings"]
    line = "widths: " + "; ".join(f"{k} {v}" for k, v in (s.get("widths") or {}).items())
    a = s.get("allocation")
    if a and "mixed" in (s.get("widths") or {}):
        line += f" (mixed: {a['rule']}; {a['bits_per_element']:.3f} bits/element at {a['context']} tokens)"
    return line


def fmt_breakdown(bd: dict) -> str:
    parts = ", ".join(f"{k} {v:.2f}" for k, v in bd["regions_ms"].items())
    line = f"breakdown {bd['scheme']} ctx={bd['context']} bs={bd['batch']}: step {bd['step_ms']:.2f} ms = {parts}"
    g = bd.get("gpu_kernels")
    if g and "kernel_ms_per_step" in g:
        line += f"; GPU kernels {g['kernel_ms_per_step']:.2f} ms/step (busy {g['busy_fraction']}), {g['groups_ms']}"
        if g.get("pdl"):  # (benchmarks/NOTES.md, run H1: the norm read 8.3 us a launch with PDL, 2.3 without)
            line += (" [PDL on: each kernel's time includes its wait for the one before; OSCAR_KV_PDL=off for each "
                     "kernel's own]")
    return line


def print_tables(result: dict) -> None:
    print(f"\n{result['device']}  {result['model']['arch']} ({result['model']['num_layers']} layers), KV budget "
          f"{result['settings']['kv_cache_memory_gb']} GB, {result['settings']['decode_steps']} decode steps "
          f"(median){'' if result['timing_meaningful'] else '  [CPU: timings not meaningful]'}")
    print(widths_line(result))
    print("step = LLMEngine.step; runner = ModelRunner.run; plan = the step plan; fwd = runner - plan; KV MB = the "
          "cache bytes a step reads (every layer at its widths); "
          f"floor = (weights + KV read) / copy bandwidth ({result.get('copy_bandwidth_GBps', '-')} GB/s), "
          f"% = floor / step; model forward: {result['settings']['model_impl']}")
    print(f"{'kv':>5} {'ctx':>7} {'bs':>4} {'step ms':>9} {'runner ms':>9} {'plan ms':>8} {'fwd ms':>9} "
          f"{'KV MB':>9} {'floor ms':>9} {'%floor':>7} {'tok/s/seq':>9} {'fwd t/s/s':>9} {'tok/s':>9}")
    for r in sorted(result["decode"], key=lambda r: (r["context"], r["batch"], r["scheme"])):
        if r.get("measured"):
            print(fmt_row(r))
        else:
            why = r.get("reason") or r.get("error") or "not measured"
            what = "does not fit" if r.get("fits") is False else "not measured"
            print(f"{r['scheme']:>5} {r['context']:>7} {r['batch']:>4}  {what}: {why}")
    if result["prefill"]:
        print("\nprefill of one prompt (chunked, through LLMEngine.step; attend = attention layers: key rotation, KV "
              "write, attention)")
        if result.get("matmul_TFLOPs"):
            print(f"floor = (2 x weight-GEMM parameters x tokens + causal attention FLOPs) / the bf16 GEMM rate "
                  f"measured in the same run ({result['matmul_TFLOPs']} TFLOP/s), % = floor / seconds")
        print(f"{'kv':>5} {'ctx':>7} {'seconds':>9} {'tok/s':>9} {'chunks':>6} {'attend s':>9} {'floor s':>8} "
              f"{'%floor':>7}")
        by = {}
        for r in sorted(result["prefill"], key=lambda r: (r["context"], r["scheme"])):
            if r["batch"] == 1:
                by[(r["scheme"], r["context"])] = r
                floor = (f" {r['floor_seconds']:8.2f} {100 * r['of_floor']:6.1f}%" if "of_floor" in r
                         else f" {'-':>8} {'-':>7}")
                print(f"{r['scheme']:>5} {r['context']:>7} {r['seconds']:9.2f} {r['tokens_per_s']:9.1f} "
                      f"{r['chunks']:>6} {r.get('attend_seconds', float('nan')):9.2f}{floor}")
        for (scheme, ctx), r in sorted(by.items(), key=lambda kv: kv[0][1]):
            if scheme in QUANTIZED and ("bf16", ctx) in by:
                print(f"prefill {scheme} / bf16 time at {ctx}: {r['seconds'] / by[('bf16', ctx)]['seconds']:.3f}x")
    if result["speedup"]:
        print("\nspeedup over bf16 (tokens/s ratio); mixed also over int2")
        print(f"{'kv':>5} {'ctx':>7} {'bs':>4} {'engine':>8} {'forward':>8} | {'/int2 eng':>9} {'/int2 fwd':>9}")
        x = lambda v: f"{v:7.2f}x" if v is not None else f"{'-':>8}"  # noqa: E731
        for s in result["speedup"]:
            over = (f" | {x(s.get('engine_step_over_int2')):>9} {x(s.get('forward_over_int2')):>9}"
                    if "engine_step_over_int2" in s else "")
            note = f"  ({s['note'][:160]})" if s.get("note") else ""
            print(f"{s.get('scheme', 'int2'):>5} {s['context']:>7} {s['batch']:>4} {x(s['engine_step'])} "
                  f"{x(s['forward'])}{over}{note}")
    tp = result.get("throughput_at_budget")
    if tp:
        print(f"\nthroughput at a {tp['kv_cache_memory_gb']} GB KV budget, context {tp['context']}")
        for scheme, e in tp["schemes"].items():
            line = f"{scheme:>5}: max batch {e.get('max_batch')}"
            if e.get("limit"):
                line += f" (limited by {e['limit']})" if e.get("max_batch") else f" ({e['limit']})"
            if e.get("measured"):
                line += f"; measured at batch {e['batch']}: {e['tokens_per_s']:.1f} tok/s ({e['step_ms']:.1f} ms/step)"
            elif e.get("note") or e.get("error"):
                line += f"; {e.get('note') or e.get('error')}"
            print(line)
        for k in [f"{r}_{s}_over_bf16" for s in QUANTIZED for r in ("max_batch_ratio", "tokens_per_s_ratio")]:
            if tp.get(k) is not None:
                print(f"{k}: {tp[k]}")
    for bd in result["breakdown"]:
        print(fmt_breakdown(bd))
    for s in result["skipped"]:
        print("skipped:", s)
    for e in result["errors"]:
        print("error:", e)


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print("matplotlib is not importable: no PNG written")
        return
    rows = [r for r in result["decode"] if r.get("measured") and not r.get("throughput_run")]
    if not rows:
        return
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), squeeze=False)
    for ax, key, title in ((axes[0][0], "tokens_per_s_per_seq", "engine step (LLMEngine.step)"),
                           (axes[0][1], "forward_tokens_per_s_per_seq", "forward (runner minus per-step plan)")):
        for scheme, style in STYLES:
            for i, b in enumerate(batches):
                rr = sorted((r for r in rows if r["scheme"] == scheme and r["batch"] == b), key=lambda r: r["context"])
                if rr:  # one colour per batch, dashed BF16 / solid INT2 / dotted mixed widths
                    ax.plot([r["context"] / 1000 for r in rr], [r[key] for r in rr], style, marker="o",
                            color=f"C{i}", label=f"{scheme} batch {b}")
        ax.set_xlabel("context (K tokens)")
        ax.set_ylabel("decode tokens/s per sequence")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    note = "" if result["timing_meaningful"] else " (CPU: not meaningful)"
    fig.suptitle(f"{result['model']['arch']} ({result['model']['num_layers']} layers), {result['device']}, KV budget "
                 f"{result['settings']['kv_cache_memory_gb']} GB{note}\n{widths_line(result)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
