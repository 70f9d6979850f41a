"""Megatron-Bridge adapter: a callback with Bridge's ``Callback`` interface driving :class:`TrainingMonitor`.

``pretrain(config, forward_step, callbacks=[MegapipeBridgeCallback(plan="plan.yaml")])``.
Bridge's ``CallbackManager.add`` registers every event method a callback defines
(``megatron/bridge/training/callbacks.py``); this class defines
``on_train_start``, ``on_train_step_start``, ``on_train_step_end`` and
``on_train_end``, each taking Bridge's ``CallbackContext`` (``state``, ``model``,
``user_state``, ``optimizer``, ``scheduler``, ``loss_dict``, ``grad_norm``,
``skipped_iter``). megatron.bridge is never imported: the class only reads the
context's attributes. Metrics go to ``state.tensorboard_logger.add_scalar``,
``state.wandb_logger.log`` (when present), ``context.user_state["megapipe"]`` and
``<log_dir>/rank-*.jsonl``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from megapipe.monitor.monitor import TrainingMonitor, attach_monitor

__all__ = ["MegapipeBridgeCallback"]

logger = logging.getLogger("megapipe.monitor")


def _get(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


class MegapipeBridgeCallback:
    """Keyword arguments as :func:`~megapipe.monitor.monitor.attach_monitor` (``log_dir`` defaults
    to ``<checkpoint.save or cwd>/monitor``; ``tokens_per_step`` to global batch size x seq length)."""

    def __init__(self, *, log_dir: str | None = None, **monitor_kwargs: Any) -> None:
        self._log_dir, self._kwargs = log_dir, monitor_kwargs
        self.monitor: TrainingMonitor | None = None
        self._state: Any = None

    def _sink(self, metrics: dict, step: int) -> None:
        writer = _get(self._state, "tensorboard_logger")
        if writer is not None:
            for name, value in metrics.items():
                writer.add_scalar(name, value, step)
        wandb = _get(self._state, "wandb_logger")
        if wandb is not None:
            wandb.log(metrics, step)

    def on_train_start(self, context: Any) -> None:
        self._state = context.state
        try:
            kwargs = dict(self._kwargs)
            if kwargs.get("tokens_per_step") is None:
                gbs, seq = _get(context.state, "cfg.train.global_batch_size"), _get(context.state, "cfg.model.seq_length")
                kwargs["tokens_per_step"] = gbs * seq if gbs and seq else None
            base = _get(context.state, "cfg.checkpoint.save") or os.getcwd()
            log_dir = self._log_dir or os.path.join(base, "monitor")
            self.monitor = attach_monitor(context.model, log_dir=log_dir, sinks=[self._sink],
                                          run_dir=kwargs.pop("run_dir", None) or base, **kwargs)
            self.monitor.train_start()
        except Exception:
            logger.exception("megapipe monitor: could not attach; training continues unmonitored")
            self.monitor = None

    def on_train_step_start(self, context: Any) -> None:
        if self.monitor is not None:
            self.monitor.step_start()

    def on_train_step_end(self, context: Any) -> None:
        if self.monitor is None:
            return
        metrics = self.monitor.step_end(_get(context.state, "train_state.step"))
        if metrics:
            context.user_state["megapipe"] = metrics

    def on_train_end(self, context: Any) -> None:
        if self.monitor is not None:
            self.monitor.train_end()
