#!/usr/bin/env bash
# What a run leaves behind of ours: shared-memory objects (anything new in /dev/shm), Ray
# services' runtime folders (/tmp/tdict-ray-*), replay buffers' temporary storage folders
# (/tmp/replay-*) and what is in the runtime folders of services (/tmp/tensordict-rs-UID,
# $XDG_RUNTIME_DIR/tensordict-rs).
#
#   tools/ci/leftovers.sh snapshot FILE   # before the run: what is there already
#   tools/ci/leftovers.sh check FILE      # after it: lists what is new, exits 1 if anything is
set -euo pipefail

list() {
    local dir
    ls -A /dev/shm | sed 's|^|/dev/shm/|'
    for dir in /tmp/tdict-ray-* /tmp/replay-*; do
        [ -e "$dir" ] && echo "$dir"
    done
    for dir in "/tmp/tensordict-rs-$(id -u)" "${XDG_RUNTIME_DIR:-/nonexistent}/tensordict-rs"; do
        [ -d "$dir" ] && ls -A "$dir" | sed "s|^|$dir/|"
    done
    return 0
}

case "${1:-}" in
snapshot)
    list | sort >"$2"
    ;;
check)
    new=$(comm -13 "$2" <(list | sort))
    if [ -n "$new" ]; then
        echo "left behind by this run ($(echo "$new" | wc -l)):"
        echo "$new" | sed 's/^/  /'
        exit 1
    fi
    echo "nothing left behind: no shared memory, runtime file or Ray or replay folder of ours that this run made"
    ;;
*)
    echo "usage: $0 snapshot FILE | check FILE" >&2
    exit 2
    ;;
esac
