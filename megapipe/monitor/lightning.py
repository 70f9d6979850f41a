"""Lightning / NeMo 2 adapter: a ``lightning.pytorch.Callback`` driving :class:`TrainingMonitor`.

``trainer = Trainer(..., callbacks=[MegapipeCallback(plan="plan.yaml", tokens_per_step=gbs * seq)])``.
At ``on_train_start`` it finds the Megatron model chunks (``models=`` given,
else NeMo 2's ``trainer.strategy.megatron_parallel``, else
``pl_module.model_chunks`` / ``pl_module.chunks`` / ``pl_module.module``),
attaches the monitor and checks the links; each ``on_train_batch_end`` closes a
step, and the metrics go to the trainer's loggers through
``pl_module.log_dict`` (TensorBoard, CSV, W&B...) and to
``<log_dir>/rank-*.jsonl`` (default: ``<trainer.log_dir or default_root_dir>/monitor``).
NeMo 2's MegatronParallel events ``on_megatron_step_start`` and
``on_megatron_microbatch_start/end`` are handled when the strategy calls them.
Nothing here can stop training: a failure while attaching leaves the run
unmonitored with one logged error.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Callback

from megapipe.monitor.monitor import TrainingMonitor, attach_monitor

__all__ = ["MegapipeCallback"]

logger = logging.getLogger("megapipe.monitor")


def _chunks(trainer: Any, pl_module: Any, models: Any) -> Any:
    if callable(models):
        return models(trainer, pl_module)
    if models is not None:
        return models
    parallel = getattr(trainer.strategy, "megatron_parallel", None)
    if parallel is not None:
        return list(parallel)
    for name in ("model_chunks", "chunks", "module"):
        found = getattr(pl_module, name, None)
        if found is not None:
            return list(found) if not hasattr(found, "config") and hasattr(found, "__iter__") else found
    return None


class MegapipeCallback(Callback):
    """Keyword arguments as :func:`~megapipe.monitor.monitor.attach_monitor`; plus ``models``
    (chunks or ``fn(trainer, pl_module) -> chunks``) and ``log_to_trainer`` (default True)."""

    def __init__(self, *, models: Any | Callable[[Any, Any], Any] = None, log_dir: str | None = None,
                 log_to_trainer: bool = True, **monitor_kwargs: Any) -> None:
        super().__init__()
        attach_monitor(**{k: v for k, v in monitor_kwargs.items() if k in ("log_every", "warmup_steps",
                          "drift_threshold", "topology_threshold", "topology_budget_s")})  # validate now
        self._models, self._log_dir, self._log_to_trainer = models, log_dir, log_to_trainer
        self._kwargs = monitor_kwargs
        self.monitor: TrainingMonitor | None = None
        self.microbatches = 0
        self._pl_module: Any = None

    def _default_log_dir(self, trainer: Any) -> str:
        base = getattr(trainer, "log_dir", None) or trainer.default_root_dir
        return os.path.join(base, "monitor")

    def _sink(self, metrics: dict, step: int) -> None:
        if self._log_to_trainer and self._pl_module is not None and metrics:
            self._pl_module.log_dict({k: float(v) for k, v in metrics.items()}, on_step=True, on_epoch=False,
                                     sync_dist=False)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._pl_module = pl_module
        try:
            kwargs = dict(self._kwargs)
            if kwargs.get("tokens_per_step") is None:
                kwargs["tokens_per_step"] = getattr(pl_module, "tokens_per_step", None)
            self.monitor = attach_monitor(
                _chunks(trainer, pl_module, self._models), log_dir=self._log_dir or self._default_log_dir(trainer),
                sinks=[self._sink], run_dir=kwargs.pop("run_dir", None) or trainer.default_root_dir, **kwargs)
            self.monitor.train_start()
        except Exception:
            logger.exception("megapipe monitor: could not attach; training continues unmonitored")
            self.monitor = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.monitor is not None:
            self.monitor.step_start()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.monitor is not None:
            self.monitor.step_end(trainer.global_step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.monitor is not None:
            self.monitor.train_end()

    # NeMo 2 MegatronParallel events (called with the step object when the strategy forwards them)
    def on_megatron_step_start(self, *args: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.step_start()

    def on_megatron_microbatch_start(self, *args: Any, **kwargs: Any) -> None:
        pass

    def on_megatron_microbatch_end(self, *args: Any, **kwargs: Any) -> None:
        self.microbatches += 1
