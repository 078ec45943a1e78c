"""Bits per element against accuracy, per model, from the protocol's tables (benchmarks/protocol.py's protocol.json).

    python3 benchmarks/pareto_plot.py results/protocol_*/*/protocol.json --context 32768 --output pareto.png

Tables after ``--kl-only`` give bits, KL and top-1 but no retrieval (a run with fewer needle prompts than the others
must not share their NIAH axes).  Rows of the same model, length and method from later tables replace earlier ones.

One column per model (at ``--context``, or each model's longest length when it has no such row), four rows: KL
against BF16 (log scale), top-1 agreement, NIAH and multi-key NIAH.  OSCAR's candidates are joined in order of bits; KIVI-2 is a
separate marker and BF16's retrieval a dashed line, so a reader sees what each budget buys and where KIVI-2 sits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PANELS = (("kl", "KL vs BF16", True), ("top1_agreement", "top-1 agreement with BF16", False), ("niah", "NIAH", False),
          ("niah_multikey", "multi-key NIAH", False))
RETRIEVAL = ("niah", "niah_multikey")


def model_rows(rows: list[dict], context: int) -> dict[str, list[dict]]:
    """Each model's rows at ``context`` (or at its longest length)."""
    by_model: dict[str, list[dict]] = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
    picked = {}
    for model, mine in by_model.items():
        lengths = {r["context"] for r in mine}
        at = context if context in lengths else max(lengths)
        picked[model] = [r for r in mine if r["context"] == at]
    return picked


def plot(rows: list[dict], context: int, output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = model_rows(rows, context)
    fig, axes = plt.subplots(len(PANELS), len(models), figsize=(4.2 * len(models), 11), squeeze=False)
    for col, (model, mine) in enumerate(sorted(models.items())):
        oscar = sorted((r for r in mine if r["method"].startswith("oscar")), key=lambda r: r["bits_per_element"])
        kivi = [r for r in mine if r["method"] == "kivi-2"]
        bf16 = [r for r in mine if r["method"] == "bf16"]
        for row, (metric, label, log) in enumerate(PANELS):
            ax = axes[row][col]
            pts = [(r["bits_per_element"], r[metric]) for r in oscar if r.get(metric) is not None]
            if pts:
                ax.plot(*zip(*pts), "o-", label="OSCAR (calibrated widths)")
                for r in oscar:
                    if r.get(metric) is not None:
                        ax.annotate(r["method"].removeprefix("oscar-"), (r["bits_per_element"], r[metric]),
                                    fontsize=7, xytext=(3, 3), textcoords="offset points")
            for r in kivi:
                if r.get(metric) is not None:
                    ax.plot(r["bits_per_element"], r[metric], "s", color="tab:red", label="KIVI-2")
            for r in bf16:
                if r.get(metric) is not None and metric != "kl":
                    ax.axhline(r[metric], ls="--", color="gray", label="BF16")
            if not pts:
                ax.text(0.5, 0.5, "not measured at this length", ha="center", va="center", transform=ax.transAxes)
            if log:
                ax.set_yscale("log")
            ax.set_xlabel("stored bits per element")
            ax.set_ylabel(label)
            if row == 0:
                ax.set_title(f"{model} at {mine[0]['context'] // 1024}K")
            ax.grid(alpha=0.3)
            if row == 0 and col == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(output, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tables", nargs="+", type=Path, help="protocol.json files")
    parser.add_argument("--kl-only", nargs="*", type=Path, default=[], help="tables whose retrieval is left out")
    parser.add_argument("--relabel", action="append", default=[], metavar="TABLE:METHOD=NEW",
                        help="rename a method in one table (NEW empty: leave its rows out), e.g. to name what a run's "
                             "'oscar-default' was on that day")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    renames = {}
    for spec in args.relabel:
        table, _, change = spec.rpartition(":")
        old, sep, new = change.partition("=")
        if not table or not sep:
            parser.error(f"--relabel takes TABLE:METHOD=NEW, got {spec!r}")
        renames[(Path(table), old)] = new
    latest = {}
    for t in [*args.tables, *args.kl_only]:
        for r in json.loads(t.read_text()):
            method = renames.get((t, r["method"]), r["method"])
            if not method:
                continue
            r = {**r, "method": method}
            key = (r["model"], r["context"], r["method"])
            if t in args.kl_only:
                r = {**r, **{m: latest.get(key, {}).get(m) for m in RETRIEVAL}}
            latest[key] = r
    rows = list(latest.values())
    plot(rows, args.context, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
