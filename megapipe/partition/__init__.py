"""Partition profile entries into pipeline stages: the exact min-max solver and baselines.

```python
from megapipe.partition import solve, StageSpec
from megapipe.units import GIB
part = solve(profile, [StageSpec(memory_bytes=80 * GIB)] * 8, num_microbatches=32, schedule="1f1b")
part.layout, part.bottleneck_ms
```
"""

from megapipe.partition.baselines import equal_bounds, parameters_bounds
from megapipe.partition.memory import chunk_memory_caps, in_flight_counts
from megapipe.partition.solver import METHODS, free_split, given_split, solve
from megapipe.records import Partition, StageSpec

__all__ = [
    "METHODS",
    "Partition",
    "StageSpec",
    "chunk_memory_caps",
    "equal_bounds",
    "free_split",
    "given_split",
    "in_flight_counts",
    "parameters_bounds",
    "solve",
]
