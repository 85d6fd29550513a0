"""Tensorclasses of the format fixtures (``make_format_fixtures.py``).

A tensorclass folder names its class by module (``<class 'fixture_classes.Point'>``), and
Python's ``load_memmap`` gives the instance back only where that module can be imported: the
fixture script and the Python tests import it from here.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import tensorclass


@tensorclass
class Point:
    """A point with a label: a tensor field and a string field."""

    x: torch.Tensor
    label: str


@tensorclass
class Step:
    """A step with a nested point and a field that is not JSON (a set), which Python pickles."""

    obs: torch.Tensor
    point: Point
    tags: Any = None
