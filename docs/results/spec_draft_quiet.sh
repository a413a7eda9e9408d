#!/usr/bin/env bash
# Draft-model speculation on the grounded workload at batch 1, against speculation off,
# both engines in one run each (issue 11): drafts cut from the default model's first 12 and
# 24 layers (docs/results/make_layer_draft.py) and the default model as its own draft,
# adaptive (the default) and, for the 24-layer draft, not.
#   bash docs/results/spec_draft_quiet.sh OUT_DIR
set -euo pipefail
out=${1:?OUT_DIR}
mkdir -p "$out"
target=$(python -c "from conveyor.model.loader import default_model_path; print(default_model_path())")
for layers in 12 24; do
  [ -d "$out/draft$layers" ] || PYTHONPATH=src python docs/results/make_layer_draft.py "$out/draft$layers" $layers
done
run() {  # NAME MODEL ADAPTIVE
  conveyor bench offline --workload grounded --num-requests 8 --max-num-seqs 1 \
    --kv-cache-memory 64MiB --max-model-len 1024 --roofline-batches \
    --speculative-config "{\"method\": \"draft_model\", \"model\": \"$2\", \"num_speculative_tokens\": 4, \"adaptive\": $3}" \
    --against speculative_config=none --result-file "$out/spec-draft-$1.json" 2>/dev/null \
    | grep -E "Output token throughput|This engine|Spec decode|Engine steps"
}
run layer12 "$out/draft12" true
run layer24 "$out/draft24" true
run layer24-fixed "$out/draft24" false
run self "$target" true
