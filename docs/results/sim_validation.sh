#!/bin/bash
# Issue 16 validation on the default model: real bench serve vs simulate, same dataset,
# the given rates x max_num_seqs 16 and 64, each rate with its own prompts (seed FIRST+1, ...).
# Usage: sim_validation.sh OUT_DIR FIRST_SEED RATE...   (needs smollm2.json from bench profile)
#   sim_validation.sh /work/simval2 0 2 8 inf ; sim_validation.sh /work/simval3 3 0.5 1
set -u
OUT=$1; S0=$2; shift 2; RATES="$*"; mkdir -p "$OUT"
W0="--dataset random --input-len 128 --output-len 64 --range-ratio 0.5 --num-prompts 48"
PORT=18700
for MNS in 16 64; do
  conveyor serve --port $PORT --max-num-seqs $MNS > "$OUT/serve_$MNS.log" 2>&1 &
  SPID=$!
  for i in $(seq 1 180); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
  S=$S0; for R in $RATES; do S=$((S+1)); W="$W0 --seed $S"
    conveyor bench serve --url http://127.0.0.1:$PORT $W --request-rate $R --ignore-eos --json --no-progress > "$OUT/real_${MNS}_${R}.json" 2>"$OUT/real_${MNS}_${R}.err"
    conveyor simulate --cost-model measured --profile smollm2.json $W --request-rate $R --ignore-eos --max-num-seqs $MNS --json > "$OUT/sim_${MNS}_${R}.json" 2>"$OUT/sim_${MNS}_${R}.err"
    echo "$(date +%T) done mns=$MNS R=$R"
  done
  kill $SPID; wait $SPID 2>/dev/null
done
python - "$OUT" $RATES <<'PY'
import json, sys
out, rates = sys.argv[1], sys.argv[2:]
keys = ["output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_ttft_ms", "p99_tpot_ms"]
print("| max_num_seqs | rate | " + " | ".join(f"{k} sim / real (ratio)" for k in keys) + " |")
for mns in (16, 64):
    for r in rates:
        s = json.load(open(f"{out}/sim_{mns}_{r}.json"))
        m = json.load(open(f"{out}/real_{mns}_{r}.json"))
        cells = [f"{s[k]:.1f} / {m[k]:.1f} ({s[k]/m[k]:.2f})" for k in keys]
        print(f"| {mns} | {r} | " + " | ".join(cells) + " |")
PY
