"""An epoch of random batches of a dataset on disk, ours against torch's `DataLoader`, in the
same run: samples/s.

The dataset is what a vision or offline-RL user has: `image` u8 [3, 64, 64], `label` i64,
`features` f32 [64] (12,808 bytes a row), ROWS rows, written by Python tensordict
(`TensorDict.memmap`), so that both read the same folder. Measures, each over whole epochs of
batches of 256 in a random order:

- `ours_files`, `ours_mapping`: `tensordict_rs.DataLoader(shuffle=True, prefetch=4)`, rows read
  with explicit reads of the files, or through the mapping;
- `torch_workers_N`: torch's `DataLoader` over `tensordict.TensorDict.load_memmap(folder)` with a
  `BatchSampler(RandomSampler)` and a collate that indexes the dict once per batch
  (`__getitems__`), `num_workers` N in 0, 1, 2, `pin_memory` on where CUDA is;
- `consumer_epoch_s`, `longer_alone_s`, `overlap_ratio`: ours again with a consumer that sleeps
  as long per batch as a batch takes to read, against the longer of the reads alone and the
  consumer alone (timed: a sleep overshoots); a ratio of 1 is a perfect overlap.

The page cache is warm (the folder is read once first): this is the in-memory case. Prints one
JSON object.

Usage: python tools/python/bench_loader.py [--rows 20000] [--epochs 2] [--folder PATH]
"""

import argparse
import json
import os
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict as PyTensorDict  # noqa: E402

import tensordict_rs as tdr  # noqa: E402

BATCH = 256


def make(folder, rows):
    td = PyTensorDict(
        {
            "image": torch.zeros(rows, 3, 64, 64, dtype=torch.uint8),
            "label": torch.arange(rows),
            "features": torch.zeros(rows, 64),
        },
        [rows],
    )
    td.memmap(folder, num_threads=2)


class Rows(torch.utils.data.Dataset):
    """The dict, indexed once per batch (`__getitems__`)."""

    def __init__(self, folder):
        self.td = PyTensorDict.load_memmap(folder)

    def __len__(self):
        return self.td.batch_size[0]

    def __getitems__(self, indices):
        return self.td[torch.as_tensor(indices)]


def samples_per_s(batches, consume=None):
    start = time.perf_counter()
    n = 0
    for batch in batches:
        n += batch.batch_size[0]
        if consume is not None:
            consume()
    return n / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--folder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or os.path.join(tmp, "dataset")
        if not os.path.exists(os.path.join(folder, "meta.json")):
            make(folder, args.rows)
        out = {"rows": args.rows, "row_bytes": 3 * 64 * 64 + 8 + 64 * 4, "batch": BATCH}
        data = tdr.TensorDict.load_memmap(folder)
        for reads in ("files", "mapping"):
            loader = tdr.DataLoader(data, BATCH, shuffle=True, prefetch=4, reads=reads)
            samples_per_s(loader)  # warms the page cache
            rates = [samples_per_s(loader) for _ in range(args.epochs)]
            out[f"ours_{reads}"] = round(max(rates))
        dataset = Rows(folder)
        for workers in (0, 1, 2):
            sampler = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(dataset), BATCH, drop_last=False)
            loader = torch.utils.data.DataLoader(
                dataset, batch_sampler=sampler, collate_fn=lambda b: b, num_workers=workers,
                pin_memory=torch.cuda.is_available(),
            )
            rates = [samples_per_s(loader) for _ in range(args.epochs)]
            out[f"torch_workers_{workers}"] = round(max(rates))
        best_peer = max(out[f"torch_workers_{w}"] for w in (0, 1, 2))
        out["ours_over_best_torch"] = round(max(out["ours_files"], out["ours_mapping"]) / best_peer, 1)
        # The overlap: a consumer busy as long per batch as a batch takes to read.
        per_batch = BATCH / out["ours_mapping"]
        busy = lambda: time.sleep(per_batch)  # noqa: E731
        loader = tdr.DataLoader(data, BATCH, shuffle=True, prefetch=4, reads="mapping")
        with_consumer = samples_per_s(loader, busy)
        # The consumer alone, as it really sleeps (a sleep overshoots what it asks for).
        start = time.perf_counter()
        for _ in range(len(loader)):
            busy()
        consumer_alone = time.perf_counter() - start
        out["consumer_epoch_s"] = round(args.rows / with_consumer, 3)
        out["longer_alone_s"] = round(max(args.rows / out["ours_mapping"], consumer_alone), 3)
        out["overlap_ratio"] = round(out["consumer_epoch_s"] / out["longer_alone_s"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
