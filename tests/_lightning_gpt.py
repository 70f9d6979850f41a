"""Test/script helper: a Lightning Trainer setup that trains megatron-core GPT chunks on CPU/gloo.

``MegatronLikeStrategy``: a DDPStrategy that initializes megatron-core's parallel
state after the process group and skips the DDP wrapper (what NeMo 2's
MegatronStrategy does). ``GPTPipeline``: a LightningModule (manual optimization,
SGD) whose ``training_step`` runs megatron-core's ``get_forward_backward_func()``
over the chunks built by ``_megatron_cpu.build_gpt_chunks``. Run inside
``_megatron_cpu.megatron_cpu()`` on every rank, with LOCAL_RANK/RANK/WORLD_SIZE set
(as torchrun would) so Lightning uses the existing process group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import _megatron_cpu as mc

__all__ = ["GPTSetup", "classes"]


@dataclass(frozen=True)
class GPTSetup:
    pipeline_model_parallel_size: int = 2
    virtual_pipeline_model_parallel_size: int | None = None
    layout: str | None = None
    num_layers: int = 4
    hidden_size: int = mc.HIDDEN_SIZE
    seq_length: int = 16
    micro_batch_size: int = 2
    num_microbatches: int = 4
    num_steps: int = 4
    lr: float = 0.05
    delays: mc.UnitDelays = mc.UnitDelays()

    @property
    def tokens_per_step(self) -> int:
        return self.num_microbatches * self.micro_batch_size * self.seq_length


def classes(setup: GPTSetup):
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    class MegatronLikeStrategy(DDPStrategy):
        def setup_distributed(self) -> None:
            super().setup_distributed()
            mc.init_model_parallel(pipeline_model_parallel_size=setup.pipeline_model_parallel_size,
                                   virtual_pipeline_model_parallel_size=setup.virtual_pipeline_model_parallel_size)

        def configure_ddp(self) -> None:
            pass

    class GPTPipeline(pl.LightningModule):
        tokens_per_step = setup.tokens_per_step

        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.chunks = None
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if self.chunks is None:
                self.chunks = torch.nn.ModuleList(mc.build_gpt_chunks(
                    layout=setup.layout, num_layers=setup.num_layers, delays_ms=setup.delays,
                    hidden_size=setup.hidden_size, seq_length=setup.seq_length))

        def training_step(self, batch, batch_idx):
            from megatron.core.pipeline_parallel import get_forward_backward_func

            optimizer = self.optimizers()
            optimizer.zero_grad()
            chunks = list(self.chunks)
            data = [mc._microbatches(step=batch_idx, num_microbatches=setup.num_microbatches,
                                     micro_batch_size=setup.micro_batch_size, seq_length=setup.seq_length,
                                     data_seed=7, vocab_size=mc.VOCAB_SIZE) for _ in chunks]
            out = get_forward_backward_func()(
                forward_step_func=mc._forward_step, data_iterator=data if len(chunks) > 1 else data[0],
                model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=setup.num_microbatches,
                seq_length=setup.seq_length, micro_batch_size=setup.micro_batch_size, forward_only=False)
            optimizer.step()
            self.losses.append(sum(float(o["loss"]) for o in out) / len(out) if out else math.nan)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=setup.lr)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(list(range(setup.num_steps)), batch_size=1)

    return MegatronLikeStrategy, GPTPipeline
