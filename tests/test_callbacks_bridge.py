"""MegapipeBridgeCallback driven with Megatron-Bridge's documented event sequence (2 gloo ranks, real megatron-core).

Bridge's training loop (``megatron/bridge/training/train.py``) fires
``on_train_start`` once, then per iteration ``on_train_step_start``, the step,
``train_state.step += 1`` and ``on_train_step_end`` (with ``loss_dict``,
``grad_norm``, ``skipped_iter``), then ``on_train_end``; each with a
``CallbackContext`` holding ``state`` (``cfg``, ``train_state``,
``tensorboard_logger``...), ``model`` (the chunk list) and ``user_state``.
megatron.bridge is not installed here, so the context is built with the same
fields; the step is megatron-core's real 1F1B schedule.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

import _megatron_cpu as mc

pytestmark = pytest.mark.engine

STEPS, MICROBATCHES, SEQ, MBS = 3, 4, 16, 2


@dataclass
class CallbackContext:
    """The fields of megatron.bridge.training.callbacks.CallbackContext."""

    state: Any
    model: list
    user_state: dict = field(default_factory=dict)
    optimizer: Any = None
    scheduler: Any = None
    loss_dict: dict | None = None
    grad_norm: float | None = None
    skipped_iter: bool | None = None
    total_loss_dict: dict | None = None


class ScalarWriter:
    """What the callback needs of a SummaryWriter: add_scalar(tag, value, step)."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))


def _bridge_run(rank, world_size, root):
    from megapipe.monitor.bridge import MegapipeBridgeCallback

    assert "megatron.bridge" not in sys.modules
    with mc.megatron_cpu():
        mc.init_model_parallel(pipeline_model_parallel_size=2)
        models = mc.build_gpt_chunks(layout="Et*2|t*2L", num_layers=4, delays_ms=mc.UnitDelays(decoder=(2.0, 4.0)))
        cfg = SimpleNamespace(train=SimpleNamespace(global_batch_size=MICROBATCHES * MBS),
                              model=SimpleNamespace(seq_length=SEQ), checkpoint=SimpleNamespace(save=root))
        state = SimpleNamespace(cfg=cfg, train_state=SimpleNamespace(step=0), tensorboard_logger=ScalarWriter(),
                                wandb_logger=None)
        callback = MegapipeBridgeCallback(topology_check=False, log_every=1)
        user_state: dict = {}
        callback.on_train_start(CallbackContext(state=state, model=models, user_state=user_state))
        seen = []
        for _ in range(STEPS):
            callback.on_train_step_start(CallbackContext(state=state, model=models, user_state=user_state))
            run = mc.train_steps(models, num_steps=1, num_microbatches=MICROBATCHES, micro_batch_size=MBS,
                                 seq_length=SEQ)
            state.train_state.step += 1
            losses = run.losses[0]
            callback.on_train_step_end(CallbackContext(
                state=state, model=models, user_state=user_state, loss_dict={"lm loss": sum(losses) / max(1, len(losses))},
                grad_norm=1.0, skipped_iter=False))
            seen.append(dict(user_state.get("megapipe", {})))
        callback.on_train_end(CallbackContext(state=state, model=models, user_state=user_state))
    return {"scalars": state.tensorboard_logger.scalars, "seen": seen, "bridge_imported": "megatron.bridge" in sys.modules}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("bridge"))
    return mc.run_ranks(_bridge_run, world_size=2, args=(root,), timeout_s=180), root


def test_bridge_events_log_to_writer_user_state_and_jsonl(ranks):
    from megapipe.monitor.jsonl import read_monitor

    results, root = ranks
    rank0 = results[0]
    steps = sorted({step for tag, _, step in rank0["scalars"] if tag == "megapipe/bubble_fraction"})
    assert steps == [1, 2, 3]  # train_state.step after each iteration
    bubble = [v for tag, v, _ in rank0["scalars"] if tag == "megapipe/bubble_fraction"]
    assert all(0.0 < b < 1.0 for b in bubble)
    tokens = {step: v for tag, v, step in rank0["scalars"] if tag == "megapipe/tokens_per_s"}
    times = {step: v for tag, v, step in rank0["scalars"] if tag == "megapipe/step_time_ms"}
    for step in (2, 3):  # step 1 is warm-up (no step time yet)
        assert tokens[step] == pytest.approx(MICROBATCHES * MBS * SEQ / (times[step] / 1e3))
    assert rank0["seen"][-1]["megapipe/bubble_fraction"] == bubble[-1]
    assert "megapipe/bubble_fraction" not in results[1]["seen"][-1] and results[1]["seen"][-1]["megapipe/step_time_ms"] > 0
    assert not any(r["bridge_imported"] for r in results)
    records = read_monitor(f"{root}/monitor")
    assert sum(r["kind"] == "pipeline" for r in records) == STEPS
    assert {r["rank"] for r in records if r["kind"] == "rank"} == {0, 1}
