"""Checks by hand that Python tensordict reads (and writes) an entry of a folder store.

    tdict store serve --name pycheck --dir /tmp/pycheck/data
    tdict store save --name pycheck model tests/fixtures/tensordict-0.15/nested
    python tools/python/check_store_entry.py /tmp/pycheck/data tests/fixtures/tensordict-0.15/nested
    tdict store load --name pycheck model /tmp/pycheck/out    # sees reward == 7 written here
    tdict store stop --name pycheck

Needs torch and tensordict 0.15.3; CI does not run it.
"""

import json
import sys
from pathlib import Path

import torch
from tensordict import TensorDict


def main() -> None:
    store_dir, source = Path(sys.argv[1]), sys.argv[2]
    index = json.loads((store_dir / "store-index.json").read_text())
    entry = next(e for e in index["entries"] if e["key"] == "model")
    folder = store_dir / "entries" / f"v{entry['version']}"
    loaded = TensorDict.load_memmap(folder)
    expected = TensorDict.load_memmap(source)
    assert (loaded == expected).all(), "the entry differs from its source"
    loaded["reward"][:] = 7.0  # written in place: the store's next load sees it
    assert torch.all(TensorDict.load_memmap(folder)["reward"] == 7.0)
    print(f"{folder}: read by Python tensordict, equal to {source}; wrote reward = 7")


if __name__ == "__main__":
    main()
