"""A Python learner sampling a replay service (pair: actor.py): batches with ``index`` and
``priority_weight`` as TorchRL returns them, priorities sent back, tensors into numpy (or torch
with ``torch.from_dlpack``) without a copy.
"""

import sys

import numpy as np

import tensordict_rs as tdr
from tensordict_rs import RemoteReplayBuffer


def main(name, updates=100, batch_size=256):
    rb = RemoteReplayBuffer(name, batch_size=batch_size)
    seen = set()
    for _ in range(updates):
        try:
            batch = rb.sample(timeout=30.0)
        except tdr.TensorDictError as e:  # writes ended and the limiter holds samples back
            print(f"learner: stopping ({e})")
            break
        obs = np.from_dlpack(batch["obs"])  # the sample's memory, no copy
        td_error = np.abs(obs.sum(axis=1)) + 1e-3  # a stand-in for a learner's TD errors
        if "priority_weight" in batch.keys():
            rb.update_priority(batch["index"], td_error)
        seen.update(np.from_dlpack(batch["index"]).tolist())
    print(f"learner: sampled {len(seen)} distinct rows")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "demo")
