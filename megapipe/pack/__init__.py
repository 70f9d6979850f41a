"""Share a cluster between training jobs: each job's nodes, GPU type and plan (``megapipe pack``).

```python
from megapipe.pack import pack_jobs
result = pack_jobs(jobs, cluster, options)      # JobSpec records, a ClusterSpec, PackOptions
result.packed.options                           # per job: node group, node count and the planner's best plan
```
"""

from megapipe.pack.curves import CurveCache, Option, default_node_counts, job_options
from megapipe.pack.pack import PackResult, Policy, gain, pack_jobs, peak_flops
from megapipe.pack.solve import Packing, solve_brute, solve_dp, solve_milp

__all__ = ["CurveCache", "Option", "PackResult", "Packing", "Policy", "default_node_counts", "gain", "job_options",
           "pack_jobs", "peak_flops", "solve_brute", "solve_dp", "solve_milp"]
