#!/usr/bin/env bash
# Issue 13's quiet comparison: plain serve, --replicas 1, --replicas 2 (same bench), then
# TP=1 and TP=2 (their own bench). One after the other, each server alone on the machine.
set -u
cd "$(dirname "$0")/../.."
OUT=${1:?usage: scale_quiet.sh OUT_DIR}; mkdir -p "$OUT"
PORT=8311
wait_up() { for i in $(seq 1 300); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && return 0; sleep 1; done; return 1; }
run() {  # name, bench args..., -- serve args...
  local name=$1; shift
  local bench=(); while [ "$1" != "--" ]; do bench+=("$1"); shift; done; shift
  echo "== $name $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $OUT/log
  conveyor serve --port $PORT --dtype float32 "$@" > $OUT/$name.server.log 2>&1 &
  local pid=$!
  wait_up || { echo "server $name did not start" | tee -a $OUT/log; kill $pid; return; }
  conveyor bench serve --url http://127.0.0.1:$PORT "${bench[@]}" --result-file $OUT/$name.json > $OUT/$name.bench.txt 2>&1
  echo "   bench rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $OUT/log
  kill -INT $pid; wait $pid
  grep -E "Output token throughput|Median TTFT|Median TPOT|Successful" $OUT/$name.bench.txt | tee -a $OUT/log
}
REP=(--dataset random --input-len 256 --output-len 64 --num-prompts 32 --seed 0 --ignore-eos)
ENG=(--max-model-len 512 --kv-cache-memory 64MiB)
run plain "${REP[@]}" -- "${ENG[@]}"
run replicas1 "${REP[@]}" -- "${ENG[@]}" --replicas 1
run replicas2 "${REP[@]}" -- "${ENG[@]}" --replicas 2
TPB=(--dataset random --input-len 128 --output-len 32 --num-prompts 16 --max-concurrency 4 --seed 0 --ignore-eos)
run tp1 "${TPB[@]}" -- --kv-cache-memory 1GiB
run tp2 "${TPB[@]}" -- --kv-cache-memory 1GiB --tensor-parallel-size 2
OMP_NUM_THREADS=1 run tp1_1thread "${TPB[@]}" -- --kv-cache-memory 1GiB
