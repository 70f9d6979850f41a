"""Train a small megatron-core GPT on CPU under NeMo's ``hydra_runner``, monitored by megapipe.

    python scripts/train_gpt.py megapipe.plan=PLAN_DIR/plan.yaml megapipe.overrides=PLAN_DIR/nemo1_overrides.txt

NeMo 1 style config (``scripts/conf/train_gpt.yaml``, keys of NeMo's
megatron_gpt_config.yaml); ``megapipe.overrides`` applies the ``key=value`` lines
``megapipe plan`` wrote to nemo1_overrides.txt, ``megapipe.plan`` takes the layout
and checks drift/topology against plan.yaml. ``trainer.devices`` gloo ranks train
with a Lightning Trainer (DDP process group, no DDP wrap, megatron-core's
pipeline schedule through the CPU shim of tests/_megatron_cpu.py) and
:class:`megapipe.monitor.lightning.MegapipeCallback`; the run dir (Hydra's output
dir) receives ``monitor/rank-*.jsonl`` and the CSV log.
"""

from __future__ import annotations

import os
import sys

from nemo.core.config import hydra_runner
from omegaconf import DictConfig, OmegaConf

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [os.path.join(_ROOT, "tests"), _ROOT]


def apply_overrides(cfg: DictConfig, path: str) -> list[str]:
    """Merge nemo1_overrides.txt's overrides (``model.x=v``, ``++model.y=v``, shell-quoted, on one line after any
    ``#`` comment line) into cfg; returns the keys."""
    import shlex

    from megapipe.errors import ConfigError

    if not os.path.isfile(path):
        raise ConfigError(f"megapipe.overrides={path!r} does not exist; pass the nemo1_overrides.txt of a plan dir")
    with open(path, encoding="utf-8") as handle:
        text = "".join(line for line in handle if not line.lstrip().startswith("#"))
    lines = [token.lstrip("+") for token in shlex.split(text)]
    OmegaConf.set_struct(cfg, False)
    cfg.merge_with(OmegaConf.from_dotlist(lines))
    return [line.split("=", 1)[0] for line in lines]


def _rank(rank, world_size, cfg_yaml):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    import _megatron_cpu as mc
    from _lightning_gpt import GPTSetup, classes
    from megapipe.monitor.lightning import MegapipeCallback

    cfg = OmegaConf.create(cfg_yaml)
    m, mp = cfg.model, cfg.megapipe
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size), NODE_RANK="0")
    dp = world_size // (m.pipeline_model_parallel_size * m.tensor_model_parallel_size)
    setup = GPTSetup(pipeline_model_parallel_size=m.pipeline_model_parallel_size,
                     virtual_pipeline_model_parallel_size=m.virtual_pipeline_model_parallel_size,
                     layout=mp.pipeline_model_parallel_layout, num_layers=m.num_layers, hidden_size=m.hidden_size,
                     seq_length=m.encoder_seq_length, micro_batch_size=m.micro_batch_size,
                     num_microbatches=m.global_batch_size // (m.micro_batch_size * dp), num_steps=cfg.trainer.max_steps,
                     lr=float(m.optim.get("lr", 0.05)))
    strategy_cls, module_cls = classes(setup)
    callback = MegapipeCallback(plan=mp.plan, log_every=mp.log_every, drift_threshold=mp.drift_threshold,
                                topology_check=mp.topology_check, log_dir=os.path.join(cfg.exp_dir, "monitor"),
                                tokens_per_step=m.global_batch_size * m.encoder_seq_length, run_dir=cfg.exp_dir)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy_cls(process_group_backend="gloo"),
                         max_steps=setup.num_steps, logger=CSVLogger(cfg.exp_dir, name="csv", version=0),
                         log_every_n_steps=cfg.trainer.log_every_n_steps, callbacks=[callback],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, default_root_dir=cfg.exp_dir)
    module = module_cls()
    with mc.megatron_cpu():
        trainer.fit(module)
    links = [f"rank {rank} -> {l.peer}: {l.bandwidth_gbytes_per_s:.3g} GB/s, {l.latency_us:.3g} us"
             for l in (callback.monitor.links if callback.monitor else [])]
    return {"losses": module.losses, "messages": callback.monitor.messages if callback.monitor else None, "links": links,
            "metrics": callback.monitor.last_metrics if callback.monitor else {}}


@hydra_runner(config_path="conf", config_name="train_gpt")
def main(cfg: DictConfig) -> None:
    import _megatron_cpu as mc

    if cfg.megapipe.overrides:
        keys = apply_overrides(cfg, str(cfg.megapipe.overrides))
        print(f"megapipe: applied {len(keys)} overrides from {cfg.megapipe.overrides}")
    if cfg.megapipe.plan and not cfg.megapipe.pipeline_model_parallel_layout:
        import yaml

        with open(cfg.megapipe.plan, encoding="utf-8") as handle:
            cfg.megapipe.pipeline_model_parallel_layout = yaml.safe_load(handle)["best"]["layout"]
    if not cfg.get("exp_dir"):
        from hydra.core.hydra_config import HydraConfig

        cfg.exp_dir = HydraConfig.get().runtime.output_dir
    cfg_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    print(cfg_yaml)
    results = mc.run_ranks(_rank, world_size=int(cfg.trainer.devices), args=(cfg_yaml,), timeout_s=1800)
    for rank, result in enumerate(results):
        if all(x == x for x in result["losses"]):  # the last pipeline stage holds the loss
            print(f"rank {rank}: losses {[round(x, 4) for x in result['losses']]}")
        for link in result["links"]:
            print(link)
        for message in result["messages"] or []:
            print(f"rank {rank}: {message}")
    print("rank 0 metrics:", {k: round(v, 4) for k, v in sorted(results[0]["metrics"].items())})


if __name__ == "__main__":
    main()
