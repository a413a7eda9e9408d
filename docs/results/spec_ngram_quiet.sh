#!/usr/bin/env bash
# The n-gram speculation runs at the sizes (64 requests), both engines in one
# run each, warm-ups included (issue 11):
#   bash docs/results/spec_ngram_quiet.sh OUT_DIR
set -euo pipefail
out=${1:?OUT_DIR}
mkdir -p "$out"
spec='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
run() {  # NAME ARGS...
  local name=$1; shift
  conveyor bench offline "$@" --max-model-len 1024 --roofline-batches \
    --speculative-config "$spec" --against speculative_config=none \
    --result-file "$out/spec-quiet-$name.json" 2>/dev/null \
    | grep -E "Output token throughput|This engine|Spec decode|Engine steps|Duration"
}
run grounded-64-batch1 --workload grounded --num-requests 64 --max-num-seqs 1 --kv-cache-memory 64MiB
run grounded-64 --workload grounded --num-requests 64 --kv-cache-memory 256MiB
run reference-64 --workload reference --num-requests 64 --kv-cache-memory 256MiB
