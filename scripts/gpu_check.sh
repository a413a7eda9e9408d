#!/usr/bin/env bash
# One GPU run for issue 14: the gpu-marked tests, then its benchmarks, with the bare-matmul
# roofline measured in the same run and HF transformers `generate` as the peer. On one H200
# (2026-12-04) the steps took: tests 35-62 s, smollm2 20, qwen3-nano-vllm 35, llama3-8b 34,
# smollm2-async 12, host-profile 21, hf-peer-llama3 23, hf-peer-smollm2 ~35; hf-peer-qwen3
# ran past 170 s (its limit is now 300). Past the device tool's 10 minutes a command, so split
# it with GPU_CHECK_STEPS: all but hf-peer-qwen3 (~4-5 min), then hf-peer-qwen3 alone. Every result lands under $OUT (the device tool's output folder; else
# bench-results/gpu), at most 8 files:
#   gpu_check.log                  every command and its output, and each step's time and rc
#   pytest.log                     tests marked gpu (test_gpu, test_cuda_graphs, and
#                                  test_gpu_attention: the Triton kernel compiled, FlashInfer)
#   offline-smollm2.json           reference workload, SmolLM2-135M shape, bf16, graphs vs
#                                  enforce_eager (--against); roofline at batch 1, 16, 64
#   offline-smollm2-async.json     the same with async_scheduling against without it
#   offline-qwen3-nano-vllm.json   nano-vllm's 256 requests (100-1024 in and out), Qwen3-0.6B
#   offline-llama3-8b.json         Llama-3-8B shape: decode step at batch 256 and one stream
#                                  (Qwen3 and Llama-3: async scheduling against synchronous)
#   hf-peer.json                   transformers generate on the same shapes and workloads
#
# Before it, once, here (the GPU image lacks two of the engine's packages; nothing can be
# downloaded there):   scripts/gpu_wheels.sh      (wheels into .whl/, ignored by git)
# Then, with the device tool:  run(command="bash scripts/gpu_check.sh", carry=[".whl"],
# timeout_s=600). GPU_CHECK_SIZE=tiny runs every command on the CPU with tiny sizes and the
# SmolLM2 shape for all three models (to check that they parse and run before spending GPU
# time): GPU_CHECK_SIZE=tiny GPU_CHECK_LIMIT_SCALE=4 OUT=/tmp/gpu-check bash scripts/gpu_check.sh
# (the limits are the GPU's: on a loaded 2-core CPU each tiny bench step takes minutes).
# GPU_CHECK_STEPS="tests smollm2" runs only the steps named (default: all, in the order of
# ALL_STEPS below), to split the run where one lease's time would not hold it all;
# GPU_CHECK_TEST_FILES replaces the tests step's list of files.
set -uo pipefail
OUT=${OUT:-bench-results/gpu}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
SIZE=${GPU_CHECK_SIZE:-full}
ALL_STEPS="tests smollm2 qwen3-nano-vllm llama3-8b smollm2-async"
ALL_STEPS+=" host-profile hf-peer-llama3 hf-peer-smollm2 hf-peer-qwen3"
for name in ${GPU_CHECK_STEPS:-}; do
    case " $ALL_STEPS " in *" $name "*) ;; *) echo "GPU_CHECK_STEPS: no step $name (steps: $ALL_STEPS)"; exit 2 ;; esac
done
PY=${PYTHON:-python3}

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# step NAME SECONDS COMMAND...: run it with a time limit, output into the log; a failed or
# timed-out step is logged and the run goes on to the next.
wants() { case " ${GPU_CHECK_STEPS:-$ALL_STEPS} " in *" $1 "*) return 0 ;; esac; return 1; }
rm -f /tmp/peer-smollm2.json /tmp/peer-qwen3.json /tmp/peer-llama3.json  # no stale peers
step() {
    wants "$1" || return 0
    local name=$1 limit=$(($2 * ${GPU_CHECK_LIMIT_SCALE:-1})) start rc
    shift 2
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    echo "=== $name: rc=$rc in $(($(date +%s) - start))s" | tee -a "$LOG"
}

if [ "$SIZE" = tiny ]; then
    DEVICE=cpu DTYPE=float32 SMALL=smollm2-135m QWEN=smollm2-135m LLAMA=smollm2-135m
    REQS=(--num-requests 2 --no-warmup) NANO=(--workload reference --num-requests 2)
    BIG=(--workload reference --num-requests 2) PEER_NANO=reference
    KV_SMALL=256MiB KV=256MiB LEN=512 SEQS=2 ROOF_SMALL=(1) ROOF_QWEN=(1) ROOF_LLAMA=(2)
    PEER_BATCH=4 PROFILE_STEPS=5 TESTS="-k test_buckets"  # (not gpu-marked: this checks the command runs)
else
    DEVICE=cuda DTYPE=bfloat16 SMALL=smollm2-135m QWEN=qwen3-0.6b LLAMA=llama-3-8b
    REQS=() NANO=(--workload nano-vllm) BIG=(--workload nano-vllm --num-requests 64)
    PEER_NANO=nano-vllm KV_SMALL=4GiB KV=48GiB LEN=2048 SEQS=256
    ROOF_SMALL=(1 16 64) ROOF_QWEN=(1 64 256) ROOF_LLAMA=(1 256)
    PEER_BATCH=256 PROFILE_STEPS=200 TESTS="-m gpu"
fi
BENCH=("$PY" -m conveyor.cli bench offline --load-format dummy --device "$DEVICE"
       --dtype "$DTYPE" --max-model-len "$LEN" --json)

{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda',
torch.cuda.is_available(), 'transformers', transformers.__version__)"; } >>"$LOG" 2>&1

# shellcheck disable=SC2086
step tests 150 "$PY" -m pytest -q -n 0 -p no:cacheprovider $TESTS ${GPU_CHECK_TEST_FILES:-tests/test_gpu.py tests/test_cuda_graphs.py tests/test_gpu_attention.py}
wants tests && { grep -E "passed|failed|skipped|error" "$LOG" | tail -1 >"$OUT/pytest.log"
    sed -n '/=== tests (limit/,/=== tests: rc=/p' "$LOG" >>"$OUT/pytest.log"; }

# The reference workload (64 requests) with CUDA graphs, and again with enforce_eager.
step smollm2 120 "${BENCH[@]}" --model "$SMALL" --kv-cache-memory "$KV_SMALL" "${REQS[@]}" \
    --roofline-batches "${ROOF_SMALL[@]}" --against enforce_eager=true \
    --result-file "$OUT/offline-smollm2.json"

# nano-vllm's benchmark on the Qwen3-0.6B shape: all 256 requests fit at once; with async
# scheduling against without it.
step qwen3-nano-vllm 150 "${BENCH[@]}" --model "$QWEN" "${NANO[@]}" \
    --max-num-seqs "$SEQS" --max-num-batched-tokens 8192 --kv-cache-memory "$KV" --no-warmup \
    --roofline-batches "${ROOF_QWEN[@]}" --async-scheduling --against async_scheduling=false \
    --result-file "$OUT/offline-qwen3-nano-vllm.json"

# Llama-3-8B shape: the same workload (64 of its requests, for time), the decode step at
# batch 256 against its bare matmuls, and one stream (weights bytes / step time); async
# against synchronous scheduling.
step llama3-8b 150 "${BENCH[@]}" --model "$LLAMA" "${BIG[@]}" \
    --max-num-seqs "$SEQS" --max-num-batched-tokens 8192 --kv-cache-memory "$KV" --no-warmup \
    --roofline-batches "${ROOF_LLAMA[@]}" --async-scheduling --against async_scheduling=false \
    --result-file "$OUT/offline-llama3-8b.json"

# Async scheduling (step N+1 launched before step N's results are taken) against the
# synchronous engine, on the reference workload.
step smollm2-async 90 "${BENCH[@]}" --model "$SMALL" --kv-cache-memory "$KV_SMALL" "${REQS[@]}" \
    --roofline-batches "${ROOF_SMALL[@]}" --async-scheduling --against async_scheduling=false \
    --result-file "$OUT/offline-smollm2-async.json"

# Where the host's share of a decode step goes (cProfile, functions by their own time), at
# batch 1 and 64: what async scheduling hides, and what bounds a small model's step.
step host-profile 60 bash -c "${PY} scripts/host_profile.py --model $SMALL --device $DEVICE \
--dtype $DTYPE --batch 1 --steps $PROFILE_STEPS && ${PY} scripts/host_profile.py --model $SMALL \
--device $DEVICE --dtype $DTYPE --batch 64 --steps $PROFILE_STEPS"

# The peer: transformers generate, same shapes and workloads, one step per shape (the
# slowest last), gathered into one file.
PEER=("$PY" scripts/hf_peer.py --device "$DEVICE" --dtype "$DTYPE")
step hf-peer-llama3 60 "${PEER[@]}" --model "$LLAMA" --result-file /tmp/peer-llama3.json
step hf-peer-smollm2 60 "${PEER[@]}" --model "$SMALL" --workload reference "${REQS[@]:0:2}" \
    --batch-size 64 --result-file /tmp/peer-smollm2.json
step hf-peer-qwen3 300 "${PEER[@]}" --model "$QWEN" --workload "$PEER_NANO" "${NANO[@]:2}" \
    --batch-size "$PEER_BATCH" --result-file /tmp/peer-qwen3.json
"$PY" - "$OUT/hf-peer.json" /tmp/peer-smollm2.json /tmp/peer-qwen3.json /tmp/peer-llama3.json \
    <<'EOF' >>"$LOG" 2>&1
import json, os, sys
peer = {os.path.basename(p)[5:-5]: json.load(open(p)) for p in sys.argv[2:] if os.path.exists(p)}
if peer:
    json.dump(peer, open(sys.argv[1], "w"), indent=2)
print("hf-peer.json:", sorted(peer))
EOF

date -u >>"$LOG"
grep "^=== .*rc=" "$LOG"
