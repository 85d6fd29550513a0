#!/usr/bin/env bash
# Builds everything the GPU check (tools/cuda/gpu-check.sh) runs, for a GPU machine that has no
# Rust and no network, into one folder the repository ignores: target/gpu-bundle/ (or $1).
#
#   tests/   every test binary with GPU tests (release, no debug info, stripped)
#   tdict    the CLI, for `tdict bench cuda --json`
#   wheels/  the tensordict-rs wheel built with the `cuda` feature (abi3: any CPython >= 3.11),
#            and pytest's wheels, installed there with `pip install --no-deps --target`;
#            wheels/numpy/ numpy's for CPython 3.12, installed only where python3 lacks numpy;
#            wheels/torchrl/ TorchRL's and tensordict's (and what they import) for CPython 3.12
#            and torch 2.11, for the replay comparison, used only where python3 lacks TorchRL
#
# Needs: cargo; python3 with pip (maturin is installed into target/bundle-venv if it is not on
# PATH; pytest's wheels are downloaded from PyPI). Prints the folder's size at the end: it
# travels to the GPU machine, so it should stay a few tens of MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-target/gpu-bundle}
rm -rf "$out"
mkdir -p "$out/tests" "$out/wheels"
export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols

# The test binaries, one cargo call per package (a --test name must exist in every package
# named with it). Cargo says where each binary is in its JSON messages.
test_binaries() {
    local package=$1
    shift
    cargo test --release --features cuda --no-run --message-format=json -p "$package" "$@" \
        | python3 -c '
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("reason") == "compiler-artifact" and msg.get("executable") and msg["profile"]["test"]:
        print(msg["target"]["name"], msg["executable"])
'
}
while read -r package tests; do
    # shellcheck disable=SC2086
    test_binaries "$package" $tests | while read -r name path; do
        cp "$path" "$out/tests/$package-$name"
    done
done <<'LIST'
memmap-tensor --test cuda --test offload
tensordict --test device
tensordict-replay --test device
LIST

cargo build --release --features cuda -p tdict-cli
cp target/release/tdict "$out/tdict"

maturin=$(command -v maturin || true)
if [ -z "$maturin" ]; then
    [ -x target/bundle-venv/bin/maturin ] || {
        python3 -m venv target/bundle-venv
        target/bundle-venv/bin/pip install --quiet --disable-pip-version-check maturin
    }
    maturin=target/bundle-venv/bin/maturin
fi
maturin=$(realpath "$maturin")
wheels=$(realpath "$out/wheels")
(cd crates/python && "$maturin" build --release --quiet --features cuda --out "$wheels")
python3 -m pip download --quiet --disable-pip-version-check --only-binary=:all: --dest "$out/wheels" pytest
# numpy for the GPU machine's python3 (3.12), in case torch came without it.
python3 -m pip download --quiet --disable-pip-version-check --only-binary=:all: --no-deps \
    --python-version 3.12 --platform manylinux2014_x86_64 --dest "$out/wheels/numpy" numpy

# TorchRL and tensordict for the replay comparison, for the GPU machine's python3 (3.12) and
# torch (2.11: TorchRL 0.12 and tensordict 0.12 are the releases made for it; checked to import
# and run tools/python/bench_replay_cuda.py with torch 2.11 on CPython 3.12), with what they
# import that torch and pytest's wheels do not bring.
python3 -m pip download --quiet --disable-pip-version-check --only-binary=:all: --no-deps \
    --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --dest "$out/wheels/torchrl" torchrl==0.12.0 tensordict==0.12.4 cloudpickle pyvers orjson importlib_metadata zipp

echo "bundle: $out ($(du -sh "$out" | cut -f1))"
ls -l "$out" "$out/tests" "$out/wheels"
