"""megapipe: pipeline-parallel planning, partitioning and monitoring for Megatron-core."""

__version__ = "0.1.0"
