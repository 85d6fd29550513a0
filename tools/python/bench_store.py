"""`Store.save` from Python against a bare copy of the same bytes into fresh shared memory.

A state dict of torch tensors (``--leaves`` leaves, ``--size`` bytes in all) is saved into a
store served by this process (``Store.start``, shared memory), and, in alternating rounds, the
same bytes are copied by numpy into a new ``/dev/shm`` object of the same size (create,
``ftruncate``, ``mmap``, ``np.copyto`` per tensor): what any save into new shared memory has to
do. Both are timed from the call to its return; each round removes what it wrote before the
next. Prints JSON: the times of every round, their medians and the ratio.

    python tools/python/bench_store.py --size 512MiB --rounds 3
"""

import argparse
import json
import mmap
import os
import re
import statistics
import tempfile
import time
import uuid

import numpy as np
import torch

import tensordict_rs as tdr


def parse_size(text):
    """Bytes from `512MiB`, `1GiB`, `4096`."""
    m = re.fullmatch(r"(\d+)\s*([KMG]i?B?)?", text.strip(), re.IGNORECASE)
    if not m:
        raise SystemExit(f"--size {text!r}: expected a number of bytes such as 512MiB")
    unit = (m.group(2) or "").upper()[:1]
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[unit]


def state_dict(size, leaves):
    """`leaves` f32 tensors of about `size / leaves` bytes each, every page written."""
    per = size // leaves // 4
    return {f"layer{i}.weight": torch.full((per,), float(i) + 0.5) for i in range(leaves)}


def bare_copy(sd):
    """Copies every tensor into one new shared-memory object, 64-byte aligned places."""
    offsets, end = [], 0
    for t in sd.values():
        end = (end + 63) // 64 * 64
        offsets.append(end)
        end += t.numel() * t.element_size()
    path = f"/dev/shm/bench-store-bare-{uuid.uuid4().hex}"
    started = time.perf_counter()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, end)
        with mmap.mmap(fd, end) as m:
            for at, t in zip(offsets, sd.values()):
                src = t.numpy().view(np.uint8)
                dst = np.frombuffer(m, dtype=np.uint8, count=src.size, offset=at)
                np.copyto(dst, src)
                del dst
        elapsed = time.perf_counter() - started
    finally:
        os.close(fd)
        os.unlink(path)
    return elapsed


def store_save(store, sd, key):
    started = time.perf_counter()
    store.save(key, sd)
    elapsed = time.perf_counter() - started
    loaded = store.load(key)
    last = list(sd)[-1]
    assert float(loaded[last].numpy()[-1]) == float(sd[last][-1]), "the entry did not load as saved"
    del loaded
    store.remove(key)
    return elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="512MiB")
    parser.add_argument("--leaves", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    size = parse_size(args.size)
    sd = state_dict(size, args.leaves)
    with tempfile.TemporaryDirectory() as run:
        store = tdr.Store.start(f"bench-{os.getpid()}", runtime_dir=run)
        saves, bares = [], []
        for r in range(args.rounds):
            bares.append(bare_copy(sd))
            saves.append(store_save(store, sd, f"sd{r}"))
        del store
    save, bare = statistics.median(saves), statistics.median(bares)
    print(json.dumps({
        "bytes": sum(t.numel() * t.element_size() for t in sd.values()),
        "leaves": args.leaves,
        "save_s": saves,
        "bare_copy_s": bares,
        "save_median_s": save,
        "bare_copy_median_s": bare,
        "save_over_bare": save / bare,
    }, indent=2))


if __name__ == "__main__":
    main()
