"""Where a kernel's warps wait, from an Nsight Compute source page: stall reasons in all, by opcode, and the top
instructions.  No GPU needed (it reads the CSV).

    ncu --clock-control none -k regex:oscar_int2_decode --launch-skip 3 --launch-count 1 --set full -o REP \\
        python3 benchmarks/cuda_int2_ab.py --profile-calls 5 --contexts 131072 --batch-sizes 8
    ncu -i REP.ncu-rep --page source --csv --print-source sass | gzip > REP.source.csv.gz
    python3 benchmarks/ncu_stalls.py REP.source.csv.gz [--top 20]

Samples are ncu's warp-state sampling: a warp is sampled every so many cycles and its state counted against the
instruction it is at ("selected" = issuing; "wait" = a fixed-latency dependency; "short_sb" / "long_sb" = waiting on
shared-memory, shuffle or MUFU results / on global memory; "math" = its pipe is busy; benchmarks/NOTES.md, "the history
loop's stalls").
"""

import argparse
import collections
import csv
import gzip
import re


def _num(x: str) -> float:
    try:
        return float(x)
    except ValueError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output (gzip or plain)")
    ap.add_argument("--top", type=int, default=20, help="instructions to list")
    a = ap.parse_args()
    opener = gzip.open if a.csv.endswith(".gz") else open
    with opener(a.csv, "rt") as f:
        rows = [r for r in csv.reader(f)]
    head = next(i for i, r in enumerate(rows) if "Source" in r and "Address" in r)
    cols = {h: i for i, h in enumerate(rows[head])}
    data = [r for r in rows[head + 1:] if len(r) == len(rows[head])]
    reasons = [h for h in rows[head] if h.startswith("stall_") and "(Not" not in h]
    total = collections.Counter()
    by_op = collections.defaultdict(collections.Counter)
    executed = collections.Counter()
    for r in data:
        words = re.sub(r"^@!?U?P\w+\s+", "", r[cols["Source"]].strip()).split()
        op = words[0].split(".")[0] if words else "?"
        executed[op] += _num(r[cols["Instructions Executed"]])
        for s in reasons:
            total[s[6:]] += _num(r[cols[s]])
            by_op[op][s[6:]] += _num(r[cols[s]])
    n = sum(total.values()) or 1
    ex = sum(executed.values()) or 1
    print(f"{int(n)} samples, {int(ex)} warp instructions executed")
    print("stall reasons: " + ", ".join(f"{k} {100 * v / n:.1f}%" for k, v in total.most_common() if v))
    print(f"{'opcode':10s} {'samples':>8s} {'executed':>9s}  top reasons (% of all samples)")
    for op, c in sorted(by_op.items(), key=lambda kv: -sum(kv[1].values()))[:20]:
        print(f"{op:10s} {100 * sum(c.values()) / n:7.1f}% {100 * executed[op] / ex:8.1f}%  "
              + " ".join(f"{k}:{100 * v / n:.1f}" for k, v in c.most_common(4) if v))
    samples = cols["Warp Stall Sampling (All Samples)"]
    print(f"top {a.top} instructions by samples:")
    for r in sorted(data, key=lambda r: -_num(r[samples]))[:a.top]:
        top = sorted(((_num(r[cols[s]]), s[6:]) for s in reasons), reverse=True)[:3]
        print(f"  {r[cols['Address']][-6:]} {100 * _num(r[samples]) / n:4.1f}% {r[cols['Source']].strip()[:56]:56s} "
              + " ".join(f"{k}:{v:.0f}" for v, k in top if v))


if __name__ == "__main__":
    main()
