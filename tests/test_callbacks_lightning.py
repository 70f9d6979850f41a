"""MegapipeCallback in a real Lightning Trainer: 2 CPU processes, gloo, megatron-core's 1F1B schedule.

Each spawned rank runs what ``torchrun`` would start: a Trainer whose strategy
(a DDPStrategy that skips the DDP wrap, as NeMo 2's MegatronStrategy does) sets up
megatron-core's parallel state; the LightningModule trains a megatron-core GPT
through ``get_forward_backward_func()`` with manual optimization (tests/_lightning_gpt.py). The callback
logs through ``log_dict`` to a CSVLogger; the test reads the CSV back.
"""

from __future__ import annotations

import csv
import math
import os

import pytest

import _megatron_cpu as mc
from _lightning_gpt import GPTSetup, classes

pytestmark = pytest.mark.engine

STEPS = 4
MICROBATCHES = 4
TOKENS = MICROBATCHES * 2 * 16
DELAYS = mc.UnitDelays(decoder=(3.0, 6.0), loss=(10.0, 20.0))


def _train(rank, world_size, root, with_callback):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from megapipe.monitor.lightning import MegapipeCallback

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size), NODE_RANK="0")
    setup = GPTSetup(layout="Et*2|t*2L", num_steps=STEPS, num_microbatches=MICROBATCHES, delays=DELAYS)
    strategy_cls, module_cls = classes(setup)
    callback = MegapipeCallback(log_dir=f"{root}/monitor", topology_budget_s=0.5, log_every=1) if with_callback else None
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy_cls(process_group_backend="gloo"),
        max_steps=STEPS, logger=CSVLogger(root, name="csv", version=0), log_every_n_steps=1,
        callbacks=[callback] if callback else [], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, default_root_dir=root)
    module = module_cls()
    with mc.megatron_cpu():
        trainer.fit(module)
    return {"losses": module.losses, "steps": trainer.global_step,
            "messages": list(callback.monitor.messages) if callback and callback.monitor else None}


def _both(rank, world_size, root):
    plain = _train(rank, world_size, f"{root}/plain", False)
    monitored = _train(rank, world_size, f"{root}/monitored", True)
    return {"plain": plain, "monitored": monitored}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lightning"))
    return mc.run_ranks(_both, world_size=2, args=(root,), timeout_s=300), root


def _csv_rows(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_training_completes_with_same_losses(run):
    ranks, _ = run
    for rank in ranks:
        assert rank["monitored"]["steps"] == rank["plain"]["steps"] == STEPS
    assert ranks[1]["monitored"]["losses"] == ranks[1]["plain"]["losses"]  # the loss stage
    assert all(math.isfinite(x) for x in ranks[1]["monitored"]["losses"])


def test_csv_logger_holds_bubble_memory_throughput(run):
    ranks, root = run
    rows = [r for r in _csv_rows(f"{root}/monitored/csv/version_0/metrics.csv") if r.get("megapipe/bubble_fraction")]
    assert len(rows) >= STEPS - 1
    last = rows[-1]
    bubble = float(last["megapipe/bubble_fraction"])
    assert 0.0 < bubble < 1.0
    assert float(last["megapipe/memory_spread"]) >= 0.0 and float(last["megapipe/memory_cv"]) >= 0.0
    assert float(last["megapipe/stage0_peak_bytes"]) > 2**20 and float(last["megapipe/stage1_peak_bytes"]) > 2**20
    step_s = float(last["megapipe/step_time_ms"]) / 1e3
    assert step_s >= MICROBATCHES * (2 * 3 + 10 + 2 * 6 + 20) / 1e3  # the loss stage's sleeps alone
    assert float(last["megapipe/tokens_per_s"]) == pytest.approx(TOKENS / step_s, rel=1e-6)
    assert float(last["megapipe/stage1_forward_ms"]) > float(last["megapipe/stage0_forward_ms"])
    assert not os.path.exists(f"{root}/plain/monitor")
    assert os.path.exists(f"{root}/monitored/monitor/rank-00001.jsonl")
    assert ranks[0]["monitored"]["messages"] is not None  # attached
    assert not [m for m in ranks[0]["monitored"]["messages"] if "turned off" in m]
