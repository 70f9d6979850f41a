"""The planner: search TP/PP/DP/VP, micro-batch, recompute and schedule; rank by throughput or cost."""
