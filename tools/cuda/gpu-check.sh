#!/usr/bin/env bash
# The GPU check: runs, on a machine with an NVIDIA GPU and from the bundle alone (no Rust, no
# network; make it with tools/cuda/bundle.sh), every GPU test, `tdict bench cuda --json`,
# torch's side of the same benchmark (tools/python/bench_torch_cuda.py), the Python tests
# that use torch, and a replay sample into GPU memory from Python beside TorchRL's
# (tools/python/bench_replay_cuda.py), and writes into OUT:
#
#   gpu-check.log   everything every part printed
#   figures.json    {"parts": {part: "passed" | "failed (...)" | "skipped: why"}, "tests": {binary:
#                   summary line}, "tdict": tdict's figures, "torch": torch's figures,
#                   "replay": the replay figures, "seconds"}
#
# Where there is no GPU it prints one `skipped: why` line per part. Each part has a time limit,
# so that the whole check ends within about 6 minutes (a second run after fixes fits the GPU
# machine's time). Usage: tools/cuda/gpu-check.sh OUT [BUNDLE]   (BUNDLE: target/gpu-bundle)
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
out=${1:?usage: tools/cuda/gpu-check.sh OUT [BUNDLE]}
bundle=${2:-target/gpu-bundle}
mkdir -p "$out"
out=$(realpath "$out")
log="$out/gpu-check.log"
: >"$log"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
started=$SECONDS
# Where the GPU machines keep the driver and CUDA's libraries.
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RUST_BACKTRACE=1

say() { echo "$*" | tee -a "$log"; }
parts=()
record() { parts+=("$1=$2"); say "== $1: $2"; }

gpu=""
if ! python3 -c 'import ctypes; ctypes.CDLL("libcuda.so.1")' 2>>"$log"; then
    gpu="no CUDA driver (libcuda.so.1 cannot be loaded)"
elif command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
fi
if [ -z "$gpu" ] && { [ ! -d "$bundle/tests" ] || [ ! -x "$bundle/tdict" ]; }; then
    say "gpu-check: no bundle at $bundle (make it with tools/cuda/bundle.sh where cargo is)"
    exit 2
fi
[ -d "$bundle" ] && bundle=$(realpath "$bundle")

# 1. Every GPU test, the ignored ones included (they are the GPU tests).
if [ -n "$gpu" ]; then
    record tests "skipped: $gpu"
else
    failed=0
    for test in "$bundle"/tests/*; do
        name=$(basename "$test")
        say "-- $name"
        # One at a time: the tests size their allocations by the memory the GPU has free.
        (cd "$work" && timeout 150 "$test" --include-ignored --test-threads 1) >"$work/$name.out" 2>&1
        status=$?
        cat "$work/$name.out" >>"$log"
        summary=$(grep -E "^test result:" "$work/$name.out" | tail -1)
        [ $status -eq 0 ] || failed=$((failed + 1))
        parts+=("test:$name=${summary:-exit status $status}")
        say "   exit status $status: ${summary:-no summary}"
    done
    if [ $failed -eq 0 ]; then record tests passed; else record tests "failed ($failed binaries)"; fi
fi

# 2. tdict's figures; 3. torch's, on the same shapes, right after.
if [ -n "$gpu" ]; then
    record tdict "skipped: $gpu"
    record torch "skipped: $gpu"
else
    if timeout 150 "$bundle/tdict" bench cuda --size 4GiB --reps 3 --batches 2000 --dir "$work" --json \
        >"$work/tdict.json" 2>>"$log"; then
        cat "$work/tdict.json" >>"$log"
        record tdict passed
    else
        record tdict "failed (exit status $?)"
    fi
    rm -f "$work"/*.memmap "$work"/data* 2>/dev/null
    if ! python3 -c "import torch, numpy; assert torch.cuda.is_available()" 2>>"$log"; then
        record torch "skipped: no torch with CUDA in python3"
    elif timeout 150 python3 tools/python/bench_torch_cuda.py --gib 4 --reps 3 --batches 2000 --dir "$work/torch" \
        >"$work/torch.json" 2>>"$log"; then
        cat "$work/torch.json" >>"$log"
        record torch passed
    else
        record torch "failed (exit status $?)"
    fi
fi

# 4. The Python tests that use torch, against the wheel built with the `cuda` feature.
if ! python3 -c "import torch" 2>/dev/null; then
    record python "skipped: no torch in python3"
elif ! ls "$bundle"/wheels/tensordict_rs-*.whl >/dev/null 2>&1; then
    record python "skipped: no tensordict_rs wheel in the bundle"
else
    python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-index --target "$work/py" \
        "$bundle"/wheels/*.whl >>"$log" 2>&1
    if ! python3 -c "import numpy" 2>/dev/null; then
        python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-index --target "$work/py" \
            "$bundle"/wheels/numpy/*.whl >>"$log" 2>&1
    fi
    tests=("$root/crates/python/tests/test_torch.py")
    for extra in "$root"/crates/python/tests/test_*cuda*.py "$root"/crates/python/tests/test_*gpu*.py; do
        [ -e "$extra" ] && tests+=("$extra")
    done
    if (cd "$work" && PYTHONPATH="$work/py" timeout 90 python3 -m pytest -q -p no:cacheprovider -rs "${tests[@]}") \
        >>"$log" 2>&1; then
        record python passed
    else
        record python "failed (exit status $?)"
    fi
fi

# 5. A replay sample straight into GPU memory from Python, beside TorchRL's sample then `.to`
# (TorchRL and tensordict from the bundle, where python3 has none; without them only ours is
# measured, and the figures say why).
if [ -n "$gpu" ]; then
    record replay "skipped: $gpu"
elif ! python3 -c "import torch; assert torch.cuda.is_available()" 2>>"$log" || [ ! -d "$work/py/tensordict_rs" ]; then
    record replay "skipped: no torch with CUDA, or no tensordict_rs wheel installed above"
else
    path="$work/py"
    if ! python3 -c "import torchrl" 2>/dev/null && ls "$bundle"/wheels/torchrl/*.whl >/dev/null 2>&1; then
        python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-index --target "$work/torchrl" \
            "$bundle"/wheels/torchrl/*.whl >>"$log" 2>&1
        path="$work/py:$work/torchrl"
    fi
    if (cd "$work" && PYTHONPATH="$path" timeout 90 python3 "$root/tools/python/bench_replay_cuda.py" \
        --rows 200000 --batch 256 --iters 2000) >"$work/replay.json" 2>>"$log"; then
        cat "$work/replay.json" >>"$log"
        record replay passed
    else
        record replay "failed (exit status $?)"
    fi
fi

python3 - "$out/figures.json" "$work" "$((SECONDS - started))" "${parts[@]}" <<'PY'
import json, os, sys
path, work, seconds, *parts = sys.argv[1:]
def load(name):
    try:
        with open(os.path.join(work, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
figures = {
    "parts": {}, "tests": {}, "tdict": load("tdict.json"), "torch": load("torch.json"), "replay": load("replay.json"),
    "seconds": int(seconds),
}
for part in parts:
    key, _, value = part.partition("=")
    if key.startswith("test:"):
        figures["tests"][key[5:]] = value
    else:
        figures["parts"][key] = value
with open(path, "w") as f:
    json.dump(figures, f, indent=1)
print(json.dumps(figures["parts"]))
PY
say "gpu-check: $((SECONDS - started)) s; log $log, figures $out/figures.json"
for part in "${parts[@]}"; do
    case ${part#*=} in failed*) exit 1 ;; esac
done
