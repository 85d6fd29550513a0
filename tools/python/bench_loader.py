"""An epoch of random batches of a dataset on disk, ours against torch's `DataLoader`, TorchRL's
replay buffer and fio, in the same run: samples/s.

The dataset is what a vision or offline-RL user has: `image` u8 [3, 64, 64] (random bytes, so
that no file is sparse), `label` i64, `features` f32 [64] (12,552 bytes a row), ROWS rows,
written by Python tensordict (`TensorDict.memmap`), so that every reader reads the same folder.
Measures, each over an epoch of random batches of 256:

- `rust_files`, `rust_blocks`, `rust_mapping`: `tdict bench loader` (the Rust loader), when
  `target/release/tdict` is built, with file reads in a shuffled order and in shuffled runs of
  `--block-rows` rows, and through the mapping;
- `ours_files`, `ours_blocks`, `ours_mapping`: `tensordict_rs.DataLoader(shuffle=True,
  prefetch=4)` from Python, the same three ways;
- `torch_workers_N`: torch's `DataLoader` over `tensordict.TensorDict.load_memmap(folder)` with a
  `BatchSampler(RandomSampler)` and a collate that indexes the dict once per batch
  (`__getitems__`), `num_workers` N in 0, 1, 2, `pin_memory` on where CUDA is;
- `torchrl_prefetch_4`: TorchRL's `ReplayBuffer(TensorStorage(TensorDict.load_memmap(folder)),
  SamplerWithoutReplacement(), batch_size=256, prefetch=4)`, the storage TorchRL's own dataset
  classes (D4RL, OpenX) put over such a folder (a `LazyMemmapStorage` once filled is the same);
- `fio_blocks_per_s`, `fio_1m_mb_per_s`: fio's random reads of row-sized blocks (12 KiB) of the
  image file, and of 1 MiB blocks, `O_DIRECT`, io_uring, queue depth 32 (with `--cold`, when fio
  is installed, run first, before anything maps the folder): the disk's limits for the shuffled
  order and for the page-aware one (whose reads are long);
- `consumer_epoch_s`, `longer_alone_s`, `overlap_ratio`: ours from Python again with a consumer
  that waits (sleeps, as a training step waiting on its GPU does) as long per batch as a batch
  takes to read, against the longer of the reads alone and the consumer alone (timed: a sleep
  overshoots); a ratio of 1 is a perfect overlap.

Without `--cold` the page cache is warm (the folder is read once first): the in-memory case.
With `--cold`, every measurement starts with the folder's pages dropped from the page cache;
run it with the readers in a memory cgroup smaller than the folder (see the README), so that
the page cache cannot hold it; slow peers are measured over their first `--peer-batches`
batches. Prints one JSON object.

Usage: python tools/python/bench_loader.py [--rows 20000] [--epochs 2] [--folder PATH] [--cold]
       [--block-rows 64] [--peer-batches 8]
"""

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from tensordict import TensorDict as PyTensorDict  # noqa: E402

import tensordict_rs as tdr  # noqa: E402

BATCH = 256
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make(folder, rows):
    generator = torch.Generator().manual_seed(0)
    td = PyTensorDict(
        {
            "image": torch.randint(0, 256, (rows, 3, 64, 64), dtype=torch.uint8, generator=generator),
            "label": torch.arange(rows),
            "features": torch.randn(rows, 64, generator=generator),
        },
        [rows],
    )
    td.memmap(folder, num_threads=2)


def evict(folder):
    """Drops the folder's pages from the page cache."""
    for name in os.listdir(folder):
        if name.endswith(".memmap"):
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def warm(folder):
    for name in os.listdir(folder):
        if name.endswith(".memmap"):
            with open(os.path.join(folder, name), "rb") as f:
                while f.read(1 << 24):
                    pass


class Rows(torch.utils.data.Dataset):
    """The dict, indexed once per batch (`__getitems__`)."""

    def __init__(self, folder):
        self.td = PyTensorDict.load_memmap(folder)

    def __len__(self):
        return self.td.batch_size[0]

    def __getitems__(self, indices):
        return self.td[torch.as_tensor(indices)]


def samples_per_s(batches, consume=None, limit=None):
    start = time.perf_counter()
    n = 0
    for k, batch in enumerate(batches):
        n += batch.batch_size[0]
        if consume is not None:
            consume()
        if limit is not None and k + 1 >= limit:
            break
    return n / (time.perf_counter() - start)


def rust(folder, reads, block_rows, cold, epochs):
    """`tdict bench loader`'s best epoch, or None without a release build."""
    tdict = os.path.join(ROOT, "target", "release", "tdict")
    if not os.path.exists(tdict):
        return None
    cmd = [tdict, "bench", "loader", folder, "--epochs", str(epochs), "--prefetch", "4", "--reads", reads, "--json"]
    if block_rows:
        cmd += ["--block-rows", str(block_rows)]
    if cold:
        cmd.append("--cold")
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)["best_samples_per_s"]


def fio(folder, block="12k"):
    """fio's random O_DIRECT reads of `block` bytes of the image file at queue depth 32: the
    job's read stats (`iops`, `bw` in KiB/s)."""
    if shutil.which("fio") is None:
        return None
    out = subprocess.run(
        ["fio", "--name=rows", f"--filename={os.path.join(folder, 'image.memmap')}", "--rw=randread",
         f"--bs={block}", "--direct=1", "--ioengine=io_uring", "--iodepth=32", "--runtime=8", "--time_based",
         "--output-format=json"],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out)["jobs"][0]["read"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--folder")
    parser.add_argument("--cold", action="store_true")
    parser.add_argument("--block-rows", type=int, default=64)
    parser.add_argument("--peer-batches", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or os.path.join(tmp, "dataset")
        if not os.path.exists(os.path.join(folder, "meta.json")):
            make(folder, args.rows)
        rows = PyTensorDict.load_memmap(folder).batch_size[0]
        out = {"rows": rows, "row_bytes": 3 * 64 * 64 + 8 + 64 * 4, "batch": BATCH, "cold": args.cold}
        before = evict if args.cold else warm
        peer_limit = args.peer_batches if args.cold else None
        epochs = args.epochs

        if args.cold:
            # First: a cloud disk's throughput drifts over minutes of reads, and an `O_DIRECT`
            # read of a file another reader maps is slowed by the kernel's page-cache checks.
            small, large = fio(folder), fio(folder, "1m")
            out["fio_blocks_per_s"] = small and round(small["iops"])
            out["fio_1m_mb_per_s"] = large and round(large["bw"] * 1024 / 1e6)

        ways = {"files": ("files", None), "blocks": ("files", args.block_rows), "mapping": ("mapping", None)}
        for name, (reads, block_rows) in ways.items():
            if args.cold and reads == "mapping":
                continue  # page faults one at a time: the torch peers show what that costs
            before(folder)
            out[f"rust_{name}"] = rust(folder, reads, block_rows, args.cold, epochs)
            # One loader for every epoch, as a training run has (its buffers made in the first).
            data = tdr.TensorDict.load_memmap(folder)
            loader = tdr.DataLoader(data, BATCH, shuffle=True, prefetch=4, reads=reads, block_rows=block_rows)
            rates = []
            for _ in range(epochs):
                before(folder)
                rates.append(samples_per_s(loader))
            out[f"ours_{name}"] = round(max(rates))

        # The overlap, before the peers map the folder (their mapped pages would fill a small
        # memory cgroup): a consumer busy as long per batch as a batch takes to read.
        reads = "files" if args.cold else "mapping"
        per_batch = BATCH / out[f"ours_{reads}"]
        loader = tdr.DataLoader(tdr.TensorDict.load_memmap(folder), BATCH, shuffle=True, prefetch=4, reads=reads)
        if not args.cold:
            samples_per_s(loader)  # an epoch before, as in training: the loader's buffers exist
        before(folder)
        with_consumer = samples_per_s(loader, lambda: time.sleep(per_batch))
        out["consumer_epoch_s"] = round(rows / with_consumer, 3)
        start = time.perf_counter()
        for _ in range(len(loader)):
            time.sleep(per_batch)
        consumer_alone = time.perf_counter() - start
        out["longer_alone_s"] = round(max(rows / out[f"ours_{reads}"], consumer_alone), 3)
        out["overlap_ratio"] = round(out["consumer_epoch_s"] / out["longer_alone_s"], 2)

        dataset = Rows(folder)
        for workers in (0, 1, 2):
            sampler = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(dataset), BATCH, drop_last=False)
            loader = torch.utils.data.DataLoader(
                dataset, batch_sampler=sampler, collate_fn=lambda b: b, num_workers=workers,
                pin_memory=torch.cuda.is_available(),
            )
            rates = []
            for _ in range(epochs):
                before(folder)
                rates.append(samples_per_s(loader, limit=peer_limit))
            out[f"torch_workers_{workers}"] = round(max(rates))

        from torchrl.data import ReplayBuffer, SamplerWithoutReplacement, TensorStorage

        rates = []
        for _ in range(epochs):
            before(folder)
            rb = ReplayBuffer(
                storage=TensorStorage(PyTensorDict.load_memmap(folder)),
                sampler=SamplerWithoutReplacement(drop_last=False),
                batch_size=BATCH,
                prefetch=4,
            )
            batches = (rb.sample() for _ in range(-(-rows // BATCH)))
            rates.append(samples_per_s(batches, limit=peer_limit))
            del rb
        out["torchrl_prefetch_4"] = round(max(rates))

        best_peer = max(out[k] for k in ("torch_workers_0", "torch_workers_1", "torch_workers_2", "torchrl_prefetch_4"))
        ours = max(v for k, v in out.items() if k.startswith("ours_"))
        out["ours_over_best_peer"] = round(ours / best_peer, 1)
        rust_best = max((v for k, v in out.items() if k.startswith("rust_") and v), default=None)
        if rust_best:
            out["python_over_rust"] = round(ours / rust_best, 2)
        if args.cold:
            out["blocks_over_files"] = round(out["ours_blocks"] / out["ours_files"], 2)
            if out["fio_blocks_per_s"]:
                out["files_over_fio"] = round(out["ours_files"] / out["fio_blocks_per_s"], 2)
                blocks_mb_per_s = out["ours_blocks"] * out["row_bytes"] / 1e6
                out["blocks_over_fio_1m"] = round(blocks_mb_per_s / out["fio_1m_mb_per_s"], 2)

    print(json.dumps(out))


if __name__ == "__main__":
    main()
