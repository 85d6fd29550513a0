"""A Python actor writing episodes into a replay service (pair: learner.py).

    tdict replay serve --name demo --capacity 10000 --sampler prioritized --alpha 0.6 --beta 0.4
    python examples/python/actor.py demo & python examples/python/learner.py demo

Each step's observation is a row of a numpy array; a torch tensor works the same way (anything
with ``__dlpack__``). The rows land in the service's shared memory, not in the socket.
"""

import sys

import numpy as np

from tensordict_rs import RemoteReplayBuffer


def main(name, episodes=50, steps=100):
    rb = RemoteReplayBuffer(name)
    rng = np.random.default_rng(0)
    for episode in range(episodes):
        obs = rng.standard_normal((steps, 4)).astype(np.float32)
        rb.extend(
            {
                "obs": obs,
                "action": rng.integers(0, 2, steps),
                "reward": np.ones(steps, np.float32),
                "episode": np.full(steps, episode, np.int64),
                "next": {"obs": np.roll(obs, -1, axis=0), "done": np.arange(steps) == steps - 1},
            }
        )
    rb.end_writes()
    print(f"actor: wrote {episodes * steps} steps; the service holds {len(rb)}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "demo")
