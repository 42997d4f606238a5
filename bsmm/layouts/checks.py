"""Argument checks shared by the layout generators and by the layers that take a seed.

Every ``seed`` of bsmm (an int, None or a ``numpy.random.Generator``) goes
through :func:`as_generator`, so the same int gives the same draws, and bad
seeds raise the same errors, wherever they are passed.
"""

from __future__ import annotations

import numpy as np


def as_generator(seed) -> np.random.Generator:
    if isinstance(seed, np.random.Generator):
        return seed
    if seed is None:
        return np.random.default_rng()
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, None or numpy.random.Generator; got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0; got {seed}")
    return np.random.default_rng(int(seed))


def check_int(value, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        expected = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {expected}; got {value}")
    return int(value)


def check_unit_interval(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number; got {type(value).__name__}")
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise ValueError(f"{name} must be in [0, 1]; got {value}")
    return float(value)


def check_self_loops(self_loops) -> bool:
    if not isinstance(self_loops, (bool, np.bool_)):
        raise TypeError(f"self_loops must be a bool; got {type(self_loops).__name__}")
    return bool(self_loops)

