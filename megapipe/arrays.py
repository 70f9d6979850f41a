"""Sorted distinct values of an array, as ``np.unique`` gives them, without its first call's import of
``numpy.ma`` (about 10 ms, paid inside the first search of every ``megapipe plan``)."""

from __future__ import annotations

import numpy as np

__all__ = ["sorted_unique", "unique_counts"]


def _firsts(ordered: np.ndarray) -> np.ndarray:
    keep = np.empty(ordered.size, dtype=bool)
    if ordered.size:
        keep[0] = True
        np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return keep


def sorted_unique(values) -> np.ndarray:
    """The distinct values of ``values`` (flattened), ascending: ``np.unique(values)`` for values without NaN."""
    ordered = np.sort(np.asarray(values), axis=None)
    return ordered[_firsts(ordered)]


def unique_counts(values) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_counts=True)`` for values without NaN."""
    ordered = np.sort(np.asarray(values), axis=None)
    starts = np.flatnonzero(_firsts(ordered))
    return ordered[starts], np.diff(np.append(starts, ordered.size))
