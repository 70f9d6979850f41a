"""Dollars: cost per million tokens and for a whole training run.

Both follow from throughput and the cluster's hourly price: a run of T tokens at
R tokens/s on G GPUs billed P $/GPU-h costs T / R * G * P / 3600 dollars.
"""

from __future__ import annotations

from megapipe.errors import ConfigError

__all__ = ["cost_per_million_tokens", "training_cost", "gpu_hours"]


def _check(tokens_per_s: float, num_gpus: int, price_per_gpu_hour: float) -> None:
    if tokens_per_s <= 0:
        raise ConfigError(f"{tokens_per_s=} must be > 0 to price a run")
    if num_gpus <= 0:
        raise ConfigError(f"{num_gpus=} must be > 0; set cluster.num_nodes and cluster.gpus_per_node")
    if price_per_gpu_hour < 0:
        raise ConfigError(f"{price_per_gpu_hour=} must be >= 0; set cluster.price_per_gpu_hour")


def gpu_hours(*, total_tokens: float, tokens_per_s: float, num_gpus: int) -> float:
    """GPU-hours to process ``total_tokens``: wall seconds x GPUs / 3600."""
    _check(tokens_per_s, num_gpus, 0.0)
    return total_tokens / tokens_per_s * num_gpus / 3600.0


def training_cost(*, total_tokens: float, tokens_per_s: float, num_gpus: int, price_per_gpu_hour: float) -> float:
    """Dollars for ``total_tokens``: T / R * G * P / 3600."""
    _check(tokens_per_s, num_gpus, price_per_gpu_hour)
    return gpu_hours(total_tokens=total_tokens, tokens_per_s=tokens_per_s, num_gpus=num_gpus) * price_per_gpu_hour


def cost_per_million_tokens(*, tokens_per_s: float, num_gpus: int, price_per_gpu_hour: float) -> float:
    """Dollars per 10^6 tokens at the given throughput."""
    return training_cost(
        total_tokens=1e6, tokens_per_s=tokens_per_s, num_gpus=num_gpus, price_per_gpu_hour=price_per_gpu_hour
    )
