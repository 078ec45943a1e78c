#!/usr/bin/env bash
# The long-context accuracy runs on the GPU machine (benchmarks/NOTES.md, "Long context").  Run from the
# repository root there, after scripts/model_parts.py has brought the GGUF over (see NOTES for the recipe):
#   bash benchmarks/longctx_gpu.sh setup            # join + check the parts, convert the GGUF once, calibrate (defaults)
#   bash benchmarks/longctx_gpu.sh needle [ARGS]    # benchmarks/needle_analysis.py at 8K/16K/32K
#   bash benchmarks/longctx_gpu.sh eval CTXS [ARGS] # oscar-kv eval --device cuda, the standard schemes
# Outputs go to $OUT (the device tool's folder) or ./runs/longctx.
set -euo pipefail
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 OSCAR_KV_HOME=${OSCAR_KV_HOME:-/tmp/okv}
out=${OUT:-runs/longctx}
model=${MODEL:-qwen2.5-coder-1.5b}
art=${ART:-/tmp/art/qwen}
mkdir -p "$out"
case "${1:-}" in
  setup)
    if [ -d /tmp/parts ]; then
      python3 scripts/model_parts.py join /tmp/parts --manifest /tmp/parts/manifest.json \
        --output "$OSCAR_KV_HOME/gguf/$(python3 -c 'import json; print(json.load(open("/tmp/parts/manifest.json"))["file"])')"
      rm -rf /tmp/parts
    fi
    python3 -c "from oscar_kv.models import resolve_model; print(resolve_model('$model'))"
    python3 -m oscar_kv.cli calibrate --model "$model" --device cuda --output-dir "$art" | tail -4
    mkdir -p "$out/artifact" && cp "$art"/* "$out/artifact/"
    ;;
  needle)
    shift
    python3 benchmarks/needle_analysis.py --model "$model" --rotations "$art" --device cuda \
      --contexts 8192,16384,32768 --output "$out" "$@" 2>&1 | grep -v -i "warn\|loading weights"
    ;;
  eval)
    ctxs=$2; shift 2
    python3 -m oscar_kv.cli eval --model "$model" --rotations "$art" --device cuda --tasks kl,niah,niah_multikey \
      --context-lengths "$ctxs" --niah-samples 20 --no-ablations --output "$out" "$@" 2>&1 \
      | grep -v -i "warn\|loading weights"
    ;;
  *)
    echo "usage: $0 setup | needle [ARGS] | eval CONTEXTS [ARGS]" >&2
    exit 2
    ;;
esac
