#!/usr/bin/env bash
# Runs the hostile Python suite RUNS times (default 20) beside two busy loops, one per core of a
# two-core machine, and prints one line per run and a summary: the suite must hold on a machine
# that is busy. Usage: tools/python/hostile_busy.sh [RUNS] [PYTHON]
# PYTHON: an interpreter with tensordict_rs, numpy and pytest installed (default: python3).
set -euo pipefail
cd "$(dirname "$0")/../.."
runs=${1:-20}
python=${2:-python3}
busy=()
stop() { kill "${busy[@]}" 2>/dev/null || true; }
trap stop EXIT
for _ in 1 2; do
    (while :; do :; done) &
    busy+=($!)
done
passed=0
for i in $(seq 1 "$runs"); do
    started=$SECONDS
    if out=$("$python" -m pytest -q -p no:cacheprovider crates/python/tests/test_hostile.py 2>&1); then
        passed=$((passed + 1))
        echo "run $i: passed ($((SECONDS - started)) s): $(tail -1 <<<"$out")"
    else
        echo "run $i: FAILED ($((SECONDS - started)) s)"
        grep -E "^(FAILED|ERROR|E  )" <<<"$out" | head -80 || tail -20 <<<"$out"
    fi
done
echo "$passed of $runs runs passed beside two busy loops"
[ "$passed" -eq "$runs" ]
