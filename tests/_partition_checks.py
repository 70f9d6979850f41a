"""The check the partition's property tests share: the solver against brute force's least bottleneck."""

from __future__ import annotations

import pytest

from megapipe.errors import InfeasibleError
from megapipe.partition import solve


def solve_like_brute(layers, stages, best: float | None, *, memory_rel: float = 0.0, **call):
    """The solver's split of ``layers`` over ``stages`` (``call``: solve's keyword arguments) against brute force's
    least bottleneck ``best``: both find none (None), or the same bottleneck with every rank within its memory (up
    to ``memory_rel``); the split."""
    if best is None:
        with pytest.raises(InfeasibleError):
            solve(layers, stages, **call)
        return None
    part = solve(layers, stages, **call)
    assert part.bottleneck_ms == pytest.approx(best, rel=1e-9)
    assert all(used <= stage.memory_bytes * (1 + memory_rel) for used, stage in zip(part.rank_memory_bytes, stages))
    return part
