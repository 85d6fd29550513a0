"""PyTorch's side of `tdict bench cuda --json`: host-to-GPU paths from a memory-mapped file.

Measures, on one NVIDIA GPU (GB/s = bytes / 1e9 / seconds):

- pinned_limit_gbps: a 1 GiB pinned host tensor copied (non_blocking) into a preallocated GPU
  tensor, then synchronize; best of PINNED_REPS. The ceiling of the link.
- A file `data.memmap` of GIB GiB of uint8 in DIR, written with np.memmap and opened as
  `torch.from_file(path, shared=True, size=n, dtype=torch.uint8)`, the way tensordict's
  MemoryMappedTensor maps a file. The page cache is warm (read once before timing). Median of REPS:
  to_gbps: `t.to("cuda")` (what tensordict does); pin_to_gbps: `t.pin_memory().to("cuda",
  non_blocking=True)`.
- Gathers of random 697-byte rows (a replay row) from a [rows, 697] view of the same mapping,
  batches of 256 and 1024, BATCHES batches each (indices drawn beforehand on the CPU), each timed
  with perf_counter_ns including synchronize; p50 and p99 in µs:
  gather_N_default_us: `t[idx].pin_memory().to("cuda", non_blocking=True)`;
  gather_N_us: `index_select(t, 0, idx, out=pinned)` then `gpu.copy_(pinned, non_blocking=True)`,
  both buffers reused (torch's best path).
- managed_prefetch_gbps: always null (see below).
- offload_gbps / restore_gbps: a GPU tensor of OFFLOAD_GIB GiB written with
  `t.cpu().numpy().tofile(f)` + fsync, and read back with
  `torch.from_numpy(np.fromfile(path, dtype=np.uint8)).to("cuda")` + synchronize; median of REPS.
  The page cache is dropped before each read only when run as root with a writable
  /proc/sys/vm/drop_caches; `restore_cold` says whether it was.

Each operation is warmed up before timing. Prints one JSON object. Compare only with figures
taken in the same run on the same machine (`tdict bench cuda --json` right before or after).

Usage: python tools/python/bench_torch_cuda.py [--gib 4] [--reps 3] [--batches 2000]
           [--offload-gib 1] [--dir DIR]
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

try:
    import numpy as np
    import torch
except ImportError as err:
    print(f"bench_torch_cuda.py: needs torch and numpy ({err})", file=sys.stderr)
    sys.exit(2)

GIB = 1 << 30
ROW_BYTES = 697
BATCH_SIZES = (256, 1024)
PINNED_REPS = 10
WARMUP_BATCHES = 20
FILL_CHUNK = 64 << 20
DATA_NAME = "data.memmap"
OFFLOAD_NAME = "offload.bin"


def sync():
    torch.cuda.synchronize()


def seconds(call):
    sync()
    started = time.perf_counter()
    call()
    sync()
    return time.perf_counter() - started


def median_gbps(nbytes, reps, call):
    seconds(call)  # warm-up
    return nbytes / 1e9 / float(np.median([seconds(call) for _ in range(reps)]))


def pinned_limit_gbps():
    src = torch.empty(GIB, dtype=torch.uint8, pin_memory=True).fill_(7)
    dst = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    call = lambda: dst.copy_(src, non_blocking=True)
    for _ in range(3):
        seconds(call)
    return GIB / 1e9 / min(seconds(call) for _ in range(PINNED_REPS))


def make_file(path, n):
    pattern = (np.arange(FILL_CHUNK, dtype=np.uint32) % 251).astype(np.uint8)
    mm = np.memmap(path, dtype=np.uint8, mode="w+", shape=(n,))
    for start in range(0, n, FILL_CHUNK):
        end = min(start + FILL_CHUNK, n)
        mm[start:end] = pattern[: end - start]
    mm.flush()
    del mm
    with open(path, "rb") as f:  # warm the page cache
        buf = bytearray(FILL_CHUNK)
        while f.readinto(buf):
            pass


def gather_us(indices, call):
    for idx in indices[:WARMUP_BATCHES]:
        call(idx)
    times = []
    for idx in indices:
        started = time.perf_counter_ns()
        call(idx)  # ends with synchronize
        times.append((time.perf_counter_ns() - started) / 1e3)
    return {f"p{q}": round(float(np.percentile(times, q)), 2) for q in (50, 99)}


def gathers(t, rows, batches, out):
    view = t[: rows * ROW_BYTES].view(rows, ROW_BYTES)
    for bs in BATCH_SIZES:
        indices = torch.randint(0, rows, (batches, bs), dtype=torch.int64)

        def default(idx):
            view[idx].pin_memory().to("cuda", non_blocking=True)
            sync()

        pinned = torch.empty((bs, ROW_BYTES), dtype=torch.uint8, pin_memory=True)
        gpu = torch.empty((bs, ROW_BYTES), dtype=torch.uint8, device="cuda")

        def best(idx):
            torch.index_select(view, 0, idx, out=pinned)
            gpu.copy_(pinned, non_blocking=True)
            sync()

        out[f"gather_{bs}_default_us"] = gather_us(indices, default)
        out[f"gather_{bs}_us"] = gather_us(indices, best)


def drop_caches():
    """Drop the page cache if allowed; True when it was dropped."""
    knob = "/proc/sys/vm/drop_caches"
    if os.geteuid() != 0 or not os.access(knob, os.W_OK):
        return False
    os.sync()
    try:
        with open(knob, "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def offload_restore(path, nbytes, reps, out):
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")

    def offload():
        with open(path, "wb") as f:
            src.cpu().numpy().tofile(f)
            f.flush()
            os.fsync(f.fileno())

    def restore():
        torch.from_numpy(np.fromfile(path, dtype=np.uint8)).to("cuda")

    seconds(offload)  # warm-up
    seconds(restore)
    writes, reads, cold = [], [], True
    for _ in range(reps):
        writes.append(seconds(offload))
        cold = drop_caches() and cold
        reads.append(seconds(restore))
    out["offload_gbps"] = nbytes / 1e9 / float(np.median(writes))
    out["restore_gbps"] = nbytes / 1e9 / float(np.median(reads))
    out["restore_cold"] = cold


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0, help="size of the memmap file")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--offload-gib", type=float, default=1.0)
    parser.add_argument("--dir", help="folder for the files (default: a fresh one under /tmp)")
    args = parser.parse_args()
    n = int(args.gib * GIB)
    offload_n = int(args.offload_gib * GIB)
    if n < ROW_BYTES * max(BATCH_SIZES) or offload_n < 1 or args.reps < 1 or args.batches < 1:
        parser.error("--gib too small, or --offload-gib, --reps or --batches not positive")
    if not torch.cuda.is_available():
        print("bench_torch_cuda.py: torch has no CUDA device (torch.cuda.is_available() is False)",
              file=sys.stderr)
        sys.exit(2)

    folder = args.dir or tempfile.mkdtemp(prefix="bench_torch_cuda.", dir="/tmp")
    data_path = os.path.join(folder, DATA_NAME)
    offload_path = os.path.join(folder, OFFLOAD_NAME)
    out = {}
    try:
        out["pinned_limit_gbps"] = pinned_limit_gbps()
        make_file(data_path, n)
        t = torch.from_file(data_path, shared=True, size=n, dtype=torch.uint8)
        out["to_gbps"] = median_gbps(n, args.reps, lambda: t.to("cuda"))
        out["pin_to_gbps"] = median_gbps(
            n, args.reps, lambda: t.pin_memory().to("cuda", non_blocking=True))
        gathers(t, n // ROW_BYTES, args.batches, out)
        del t
        # torch has no managed (cudaMallocManaged) allocator in its public API, so the peer has
        # no prefetch figure; the key stays for a like-for-like JSON with the Rust side.
        out["managed_prefetch_gbps"] = None
        offload_restore(offload_path, offload_n, args.reps, out)
    finally:
        if args.dir:
            for path in (data_path, offload_path):
                if os.path.exists(path):
                    os.remove(path)
        else:
            shutil.rmtree(folder, ignore_errors=True)

    out = {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}
    out.update(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        gib=args.gib,
        row_bytes=ROW_BYTES,
        batches=args.batches,
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
