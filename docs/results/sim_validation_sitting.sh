#!/bin/bash
# Issue 16 validation in one sitting: the profile, then right after it the real runs and their
# simulations (sim_validation.sh) at five rates x max_num_seqs 16 and 64, so that the machine
# has no time to drift between the profile and what it predicts (~17 minutes on 2 cores).
# Usage: sim_validation_sitting.sh OUT_DIR   (tables at the end of OUT_DIR/low.log, high.log)
set -u
HERE=$(dirname "$(readlink -f "$0")")  # before the cd: $0 may be a relative path
OUT=$1; mkdir -p "$OUT"; cd "$OUT" || exit 1
echo "start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
conveyor bench profile --output smollm2.json --kv-cache-memory 2GiB > profile.log 2>&1
echo "profile done $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
bash "$HERE/sim_validation.sh" "$OUT/low" 3 0.5 1 > low.log 2>&1
echo "low done $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
bash "$HERE/sim_validation.sh" "$OUT/high" 0 2 8 inf > high.log 2>&1
echo "high done $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
