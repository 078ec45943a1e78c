"""results.md (a table a person can read) and PNG plots from a results dict."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

# the long-context suite's scores (suite.py), in a table of their own: a column per task
SUITE_COLUMNS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                 "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "ruler_mean",
                 "longcode_em", "longcode_es", "longcode_es_source")

COLUMNS = (("bits_per_element", "bits/elem", "{:.3f}"), ("kl", "KL vs bf16", "{:.4f}"),
           ("top1_agreement", "top-1", "{:.3f}"), ("ppl", "ppl", "{:.3f}"), ("niah", "NIAH", "{:.2f}"),
           ("niah_multikey", "multi-key NIAH", "{:.2f}"), ("niah_answer_kl", "NIAH answer KL", "{:.4f}"),
           ("niah_multikey_answer_kl", "multi-key answer KL", "{:.4f}"),
           ("niah_multikey_answer_nll", "multi-key answer NLL", "{:.3f}"),
           ("attn_error_mean", "attn err", "{:.4f}"), ("gen_kl", "gen KL vs bf16", "{:.4f}"),
           ("gen_top1", "gen top-1", "{:.3f}"),
           ("gen_first_divergence", "gen tokens before divergence", "{:d}"),
           ("gen_agreement", "gen agreement", "{:.3f}"))


def markdown_table(results: dict) -> str:
    """results.md's text: one table per context length (a column per measured quantity), then the methods."""
    lines = [f"# KV scheme evaluation: {results['model']}", ""]
    for ctx in results["context_lengths"]:
        key = str(ctx)
        present = [c for c in COLUMNS if any(key in m.get(c[0], {}) for m in results["methods"].values())]
        lines += [f"## context {ctx} tokens", "", "| method | " + " | ".join(c[1] for c in present) + " |",
                  "|---|" + "---|" * len(present)]
        for name, m in results["methods"].items():
            cells = [c[2].format(m[c[0]][key]) if key in m.get(c[0], {}) else "–" for c in present]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += suite_tables(results)
    gen_tokens = results.get("config", {}).get("gen_tokens")
    if gen_tokens and any("gen_kl" in m for m in results["methods"].values()):
        lines += [f"Long generation: {gen_tokens} greedy tokens decoded through each cache after the prompt. gen KL: "
                  "mean KL(bf16 || method) over the decode steps, teacher-forced on bf16's tokens; gen top-1: the "
                  "share of those steps whose greedy token is bf16's; tokens before "
                  "divergence: the method's own greedy tokens that equal bf16's before the first that does not "
                  "(agreement: that count over all generated tokens).", ""]
    lines += ["Methods:", ""] + [f"- `{n}`: {m.get('description', '')}" for n, m in results["methods"].items()]
    lines += ["", f"Wall time: {results.get('seconds', '?')} s."]
    return "\n".join(lines) + "\n"


def suite_tables(results: dict) -> list[str]:
    """The suite's section of results.md: per context length, a row per method and a column per task run."""
    methods = results["methods"]
    if not any(c in m for m in methods.values() for c in SUITE_COLUMNS):
        return []
    lines = ["## long-context suite (RULER tasks: recall of the expected strings; longcode: exact match / edit "
             "similarity vs bf16's output, and edit similarity vs the source)", ""]
    for ctx in results["context_lengths"]:
        key = str(ctx)
        present = [c for c in SUITE_COLUMNS if any(key in m.get(c, {}) for m in methods.values())]
        if not present:
            continue
        lines += [f"### {ctx} tokens", "", "| method | " + " | ".join(present) + " |", "|---|" + "---|" * len(present)]
        for name, m in methods.items():
            if any(key in m.get(c, {}) for c in present):
                cells = [f"{m[c][key]:.2f}" if key in m.get(c, {}) else "–" for c in present]
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _suite_plots(results: dict, output: Path, plt) -> None:
    """One PNG per suite task (score against context length, a line per method) and all of them in one grid."""
    ctxs = results["context_lengths"]
    present = [c for c in SUITE_COLUMNS if any(c in m for m in results["methods"].values())]
    if not present:
        return

    def draw(ax, metric):
        for name, m in results["methods"].items():
            if metric in m:
                ax.plot(ctxs, [m[metric].get(str(c)) for c in ctxs], marker="o", label=name)
        ax.set_title(metric, fontsize=9)
        ax.set_ylim(-0.05, 1.05)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)

    for metric in present:
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax, metric)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("score")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(output / f"suite_{metric}_vs_context.png", dpi=110)
        plt.close(fig)
    cols = 4
    rows = -(-len(present) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, metric in zip(axes.flat, present):
        draw(ax, metric)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(output / "suite_vs_context.png", dpi=110)
    plt.close(fig)


def write_report(results: dict, output: Path) -> None:
    """Write results.md and, where matplotlib is installed, the plots to ``output``."""
    (output / "results.md").write_text(markdown_table(results))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional where matplotlib is absent
        log.warning("matplotlib is not installed: no plots written")
        return
    ctxs = results["context_lengths"]
    _suite_plots(results, output, plt)
    gen_tokens = results.get("config", {}).get("gen_tokens", "the")
    for metric, ylabel, fname, logy in (("kl", "mean KL vs bf16", "kl_vs_context.png", True),
                                        ("niah", "NIAH accuracy", "niah_vs_context.png", False),
                                        ("niah_multikey", "multi-key NIAH accuracy", "niah_multikey_vs_context.png",
                                         False),
                                        ("gen_kl", f"mean KL vs bf16 over {gen_tokens} generated tokens",
                                         "gen_kl_vs_context.png", True),
                                        ("gen_agreement", f"share of {gen_tokens} greedy tokens before divergence",
                                         "gen_agreement_vs_context.png", False)):
        rows = {n: m[metric] for n, m in results["methods"].items() if metric in m}
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, values in rows.items():
            if metric in ("kl", "gen_kl") and name == "bf16":
                continue
            ax.plot(ctxs, [values.get(str(c)) for c in ctxs], marker="o", label=name)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel)
        if logy:
            ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(output / fname, dpi=120)
        plt.close(fig)
    rows = {n: m["attn_error"] for n, m in results["methods"].items() if "attn_error" in m and n != "bf16"}
    if rows:
        ctx = str(ctxs[-1])
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, values in rows.items():
            ax.plot(values[ctx], marker=".", label=name)
        ax.set_xlabel("layer")
        ax.set_ylabel(f"relative attention error @ {ctx} tokens")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(output / "attention_error_per_layer.png", dpi=120)
        plt.close(fig)
