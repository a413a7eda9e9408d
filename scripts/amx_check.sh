#!/usr/bin/env bash
# The AMX check, for a session on an Intel Xeon with AMX (most sessions run on AMD Zen 4,
# without AMX: the AMX code is compiled, by tests/test_kernel_sources.py, but never run there):
# no regression on the AMX path. Issue 15's check (2026-12-05, docs/benchmarks.md) found the
# AMX kernels had not built for 29 hours; run this on the first AMX machine a session gets.
#   1. the kernel and batch-invariance tests on this CPU (tests.log);
#   2. the reference workload at this checkout against BASE, the last tree measured on an AMX
#      Xeon (c4d47e0, 2026-12-05 01:45 UTC), alternating old, new, new, old, new, old, old,
#      new in one sitting (the machine's speed drifts), each tree with its own kernel build;
#      `conveyor bench offline --max-model-len 2048`, as docs/benchmarks.md's AMX A/B did;
#   3. the mean output tok/s of each tree and new / old (the claim: about 1.0, within the
#      runs' own spread), and the decode step / bf16 matmuls ratios (summary.txt).
# About 6 minutes on 2 cores (the tests, two first kernel builds, eight bench runs).
# Results under OUT.
#   bash scripts/amx_check.sh [OUT] [BASE]
# To try the script on another CPU: AMX_CHECK_ANY_CPU=1 AMX_CHECK_ORDER="old new" (the
# figures then say nothing about AMX).
set -euo pipefail
OUT=${1:-bench-results/amx-check}
BASE=${2:-c4d47e0}
PY=${PYTHON:-python3}
ORDER=${AMX_CHECK_ORDER:-old new new old new old old new}
if [ -z "${AMX_CHECK_ANY_CPU:-}" ] && ! grep -q -w amx_tile /proc/cpuinfo; then
    echo "amx_check: this CPU has no AMX (no amx_tile in /proc/cpuinfo): nothing to check" >&2
    exit 2
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
lscpu > "$OUT/lscpu.txt"
git rev-parse HEAD > "$OUT/new_commit.txt"

TORCH_EXTENSIONS_DIR="$OUT/ext-new" "$PY" -m pytest -q -n 0 -p no:cacheprovider \
    tests/test_amx.py tests/test_ops.py tests/test_batch_invariance.py tests/test_dot_kernels.py \
    tests/test_f32_kernels.py tests/test_ops_backend.py tests/test_int8_activations.py \
    > "$OUT/tests.log" 2>&1 ||
    true  # a failure is reported in the summary; the bench runs anyway
tail -1 "$OUT/tests.log"

old_tree=$(mktemp -d)/base
git worktree add -q --detach "$old_tree" "$BASE"
trap 'git worktree remove --force "$old_tree"' EXIT

run() {  # run TREE N: one bench run of tree old or new, its JSON as OUT/TREE-N.json
    local src=$PWD/src
    [ "$1" = old ] && src=$old_tree/src
    echo "$(date -u +%H:%M:%S) $1 run $2"
    TORCH_EXTENSIONS_DIR="$OUT/ext-$1" PYTHONPATH="$src" "$PY" -m conveyor.cli bench offline \
        --max-model-len 2048 --result-file "$OUT/$1-$2.json" > "$OUT/$1-$2.log" 2>&1
}
i=0
for tree in $ORDER; do
    i=$((i + 1))
    run "$tree" "$i"
done

"$PY" - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import glob, json, statistics, sys
out = sys.argv[1]
tok = {}
for tree in ("old", "new"):
    runs = [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{tree}-*.json"))]
    if not runs:
        continue
    tok[tree] = [r["result"]["output_tokens_per_s"] for r in runs]
    ratios = [" / ".join(f"{b['ratio']:.2f}" for b in r["roofline"]) for r in runs]
    print(f"{tree}: output tok/s {', '.join(f'{t:.0f}' for t in tok[tree])}, "
          f"mean {statistics.mean(tok[tree]):.0f}; decode step / bf16 matmuls: {'; '.join(ratios)}")
if len(tok) == 2:
    print(f"new / old: {statistics.mean(tok['new']) / statistics.mean(tok['old']):.3f}")
print("tests:", open(f"{out}/tests.log").read().strip().splitlines()[-1])
EOF
