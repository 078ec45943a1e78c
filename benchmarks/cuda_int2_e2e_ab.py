"""End-to-end A/B of CUDA decode kernel sources: `oscar-kv bench decode` with the one-launch decode kernel compiled
from each source, one process per (round, source) in alternation, and each (scheme, context, batch) step's ms
against the first source's (best of the rounds).

Why beside cuda_int2_ab.py: that script replays one kernel call after another, so the kernel's code stays in the
SMs' instruction caches between calls; in a decode step the layer's GEMVs, norms and writes run between two
attention calls.  Run H2 (benchmarks/NOTES.md): the rolled merge took 0.990x of the old kernel's time there at 32K
batch 1, and here its step 0.946x (5.19 -> 4.91 ms, 7.8 us a layer).

    python3 benchmarks/cuda_int2_e2e_ab.py --sources OLD.cu,src/oscar_kv/kernels/int2_decode.cu [--rounds 2]
        [--output FILE.json] [-- BENCH DECODE ARGS]   # default: DEFAULT_BENCH_ARGS

``git show REV:src/oscar_kv/kernels/int2_decode.cu > OLD.cu`` gives an older source.  On a machine without CUDA the
runs use no CUDA kernel (the comparison is then of nothing; the plumbing still runs).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_BENCH_ARGS = ["--arch", "qwen3-8b", "--contexts", "32000", "--batch-sizes", "1,8", "--kv-cache-dtype", "int2",
                      "--decode-steps", "64", "--throughput-steps", "0", "--breakdown-steps", "0", "--profile-steps",
                      "0", "--kv-cache-memory", "50"]


def run_one(source: str, output: str, bench_args: list[str]) -> None:
    """bench decode in this process with the kernel compiled from ``source``, decode.json under ``output``."""
    sys.path.insert(0, str(HERE))
    from cuda_int2_sweep import _source

    from oscar_kv.bench import decode

    if not Path(source).is_file():
        raise SystemExit(f"no kernel source at {source}")
    with _source(source):
        rc = decode.main([*bench_args, "--output", output])
    if rc:
        raise SystemExit(rc)


def step_rows(path: Path) -> dict[tuple, float]:
    """{(scheme, context, batch): step ms} of the measured decode rows of a decode.json (not the throughput runs at
    the memory budget's batch)."""
    rows = json.loads(path.read_text())["decode"]
    return {(r["scheme"], r["context"], r["batch"]): r["step_ms"] for r in rows
            if r.get("measured") and not r.get("throughput_run")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sources", required=True, help="comma list of .cu files; the first is the reference")
    ap.add_argument("--rounds", type=int, default=2, help="processes per source, in alternation (default 2)")
    ap.add_argument("--output", default=None, help="a JSON file for every round's steps and the best ones")
    ap.add_argument("--run-one", default=None, help=argparse.SUPPRESS)  # child: one source, one bench decode run
    ap.add_argument("--run-output", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(ours)
    bench_args = bench_args or DEFAULT_BENCH_ARGS
    if "--output" in bench_args:
        ap.error("bench decode's --output is this script's to set")
    if a.run_one:
        run_one(a.run_one, a.run_output, bench_args)
        return 0
    sources = a.sources.split(",")
    for s in sources:
        if not Path(s).is_file():
            ap.error(f"no kernel source at {s}")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for i, s in enumerate(sources):
                out = os.path.join(tmp, f"r{r}_s{i}")
                cmd = [sys.executable, __file__, "--sources", a.sources, "--run-one", s, "--run-output", out, "--",
                       *bench_args]
                print(f"round {r + 1}/{a.rounds}: {Path(s).name}", flush=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                steps = step_rows(Path(out, "decode.json"))
                runs.append(dict(round=r, source=s, steps={"/".join(map(str, k)): v for k, v in steps.items()}))
                print("  " + ", ".join(f"{k} {v:.3f} ms" for k, v in runs[-1]["steps"].items()), flush=True)
    best = {s: {} for s in sources}
    for run in runs:
        for k, v in run["steps"].items():
            best[run["source"]][k] = min(best[run["source"]].get(k, v), v)
    ref = best[sources[0]]
    print("\nstep ms, best of the rounds (scheme/context/batch): " + ", ".join(Path(s).name for s in sources))
    for k in ref:
        print(f"{k:>20}: " + ", ".join(f"{best[s][k]:.3f} ({best[s][k] / ref[k]:.3f}x)" for s in sources
                                       if k in best[s]))
    if a.output:
        with open(a.output, "w") as f:
            json.dump(dict(bench_args=bench_args, sources=sources, runs=runs, best=best), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
