"""A fuzz target for the Python-facing index parser, run for a fixed number of cases: random
indices (ints near every edge, slices with huge bounds and steps, None, ..., lists, arrays of one
and two dims, bool lists and masks, tuples of those, tuples in tuples) applied to dicts of several
batch shapes, in a subprocess (a crash fails the test, it does not end the run). Every index gives
the batch size numpy's indexing gives an array of the batch shape, or an IndexError, TypeError,
ValueError or OverflowError where numpy raises too.

Three differences from numpy are torch's, and allowed: a negative slice step is refused (torch
refuses it; the generator makes none); a position out of range is refused even where the arrays
broadcast to no element at all (numpy looks at no position then); and an int beside index arrays
selects its dim first, as torch does (`t[0, :, [0, 1]]` of a [2, 3, 4] tensor is [3, 2] in torch,
where numpy counts the int among the arrays and gives [2, 3]): only that no crash happens is
checked then."""

import subprocess
import sys
import textwrap

import pytest

CASES = 5000

FUZZ = r"""
import random, sys
import numpy as np, tensordict_rs as tdr

EDGE = [0, 1, 2, 3, -1, -2, 4, 5, 7, -6, 2**31, 2**62, -2**63, 2**63 - 1]

def index(r, depth=0):
    k = r.randrange(12)
    if k == 0:
        return r.choice(EDGE)
    if k == 1:
        return slice(r.choice([None] + EDGE), r.choice([None] + EDGE), r.choice([None, 1, 2, 3, 2**62]))
    if k == 2:
        return None
    if k == 3:
        return Ellipsis
    if k == 4:
        return [r.choice(EDGE[:9]) for _ in range(r.randrange(0, 5))]
    if k == 5:
        return np.array([r.choice(EDGE[:9]) for _ in range(r.randrange(1, 4))])
    if k == 6:
        return np.array([[r.choice(EDGE[:6]) for _ in range(2)] for _ in range(r.randrange(1, 3))])
    if k == 7:
        return [r.random() < 0.5 for _ in range(r.randrange(1, 6))]
    if k == 8:
        return np.random.default_rng(r.randrange(1000)).random((r.randrange(1, 4), r.randrange(1, 5))) < 0.5
    if depth < 2:
        return tuple(index(r, depth + 1) for _ in range(r.randrange(0, 4)))
    return r.choice(EDGE)

def int_beside_arrays(idx):
    if not isinstance(idx, tuple):
        return False
    ints = any(isinstance(i, int) for i in idx)
    arrays = any(isinstance(i, (list, tuple, np.ndarray)) for i in idx)
    return ints and arrays

r = random.Random(SEED)
bad = []
for case in range(CASES):
    batch = r.choice([(5,), (3, 4), (2, 3, 4), (0,), (4, 0)])
    idx = index(r)
    try:
        want, numpy_raised = np.shape(np.empty(batch)[idx]), False
    except (IndexError, TypeError, ValueError, OverflowError):
        want, numpy_raised = None, True
    td = tdr.TensorDict({"x": np.zeros(batch + (2,), np.float32), "n": {"y": np.zeros(batch, np.int64)}}, batch_size=list(batch))
    try:
        got = td[idx]
    except (IndexError, TypeError, ValueError, OverflowError) as e:
        if not numpy_raised and not (want is not None and 0 in want and isinstance(e, IndexError)):
            bad.append(f"{batch}[{idx!r}]: numpy gives {want}, we raise {type(e).__name__}: {e}")
        continue
    if int_beside_arrays(idx):
        continue
    if numpy_raised:
        bad.append(f"{batch}[{idx!r}]: numpy raises, we give {got.batch_size}")
    elif got.batch_size != tuple(want) or got["x"].shape != tuple(want) + (2,) or got["n", "y"].shape != tuple(want):
        bad.append(f"{batch}[{idx!r}]: numpy gives {want}, we give {got.batch_size}")
print(len(bad), "differences")
print("\n".join(bad[:20]))
sys.exit(1 if bad else 0)
"""


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_indices_index_as_numpy_does(seed):
    code = FUZZ.replace("SEED", str(seed)).replace("CASES", str(CASES))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"exit status {p.returncode}\n{p.stdout}\n{p.stderr[-4000:]}"
    assert "panicked" not in p.stderr, p.stderr
