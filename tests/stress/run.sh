#!/usr/bin/env bash
# Runs every test file that uses several processes, a service or real kills ROUNDS times
# (default 20) while the CPUs are kept busy, and prints how many rounds each file passed; exits
# 1 if any round of any file failed. Not part of CI (20 rounds take about 25 minutes on 2 cores).
#
#   tests/stress/run.sh [ROUNDS]
#
# The load is `stress-ng --cpu N` with N twice the cores (installed from Debian when missing and
# this runs as root), else one busy loop per core. A failed round's output is kept in
# $STRESS_LOGS (default target/stress-logs).
set -euo pipefail
cd "$(dirname "$0")/../.."

ROUNDS=${1:-20}
LOGS=${STRESS_LOGS:-target/stress-logs}
mkdir -p "$LOGS"

# package:test-file pairs.
FILES=(
    rpc:processes rpc:crowding rpc:hostile rpc:hostile_random rpc:roundtrip rpc:store rpc:store_hostile
    rpc:store_processes rpc:store_layouts rpc:store_release rpc:worker rpc:worker_processes
    replay:remote replay:remote_processes
    tdict-cli:store_cli tdict-cli:replay_serve tdict-cli:replay_cli tdict-cli:copy_crash tdict-cli:copy
    aio:offload_crash memmap-tensor:lockfile memmap-tensor:concurrency
    integration-tests:crash_safety integration-tests:shm_crash integration-tests:two_processes
    integration-tests:two_processes_dict
)

args() { echo "-p ${1%%:*} --test ${1#*:}"; }

echo "building the test binaries"
for file in "${FILES[@]}"; do
    # shellcheck disable=SC2046
    cargo test --quiet $(args "$file") --no-run
done

cores=$(nproc)
load_pids=()
stop_load() {
    for pid in "${load_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap stop_load EXIT
if ! command -v stress-ng >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq stress-ng >/dev/null 2>&1 || true
fi
if command -v stress-ng >/dev/null; then
    stress-ng --cpu $((2 * cores)) --timeout 0 --quiet &
    load_pids+=($!)
    echo "load: stress-ng --cpu $((2 * cores))"
else
    for _ in $(seq "$cores"); do
        (while :; do :; done) &
        load_pids+=($!)
    done
    echo "load: $cores busy loops"
fi

declare -A passed
failed=0
for round in $(seq "$ROUNDS"); do
    for file in "${FILES[@]}"; do
        log="$LOGS/${file/:/-}-round-$round.log"
        # shellcheck disable=SC2046
        if cargo test --quiet $(args "$file") >"$log" 2>&1; then
            passed[$file]=$((${passed[$file]:-0} + 1))
            rm -f "$log"
        else
            failed=1
            echo "round $round: $file FAILED (log: $log)"
        fi
    done
    echo "round $round of $ROUNDS done"
done

echo
for file in "${FILES[@]}"; do
    echo "$file: ${passed[$file]:-0} of $ROUNDS rounds passed"
done
exit "$failed"
