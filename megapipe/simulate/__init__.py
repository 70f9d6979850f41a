"""One simulator for any pipeline order: step time, bubble, memory, critical path.

Each rank executes its order from :class:`megapipe.schedules.Schedule` strictly in
sequence. An op starts when its rank is free and its dependencies have finished:
``F(s, mb)`` needs ``F(s-1, mb)``; ``I(s, mb)`` / ``B(s, mb)`` need ``F(s, mb)``
and the input-gradient op (I or B) of ``(s+1, mb)``; ``W(s, mb)`` needs
``I(s, mb)``. A dependency produced on another rank arrives one p2p message later
(``latency_ms + bytes / bandwidth``); sends are asynchronous and never occupy the
sender. Op times come from :class:`StageTimes`: F costs ``fwd_ms``, a fused B
costs ``bwd_ms``, a split backward costs ``bwd_ms - wgrad_ms`` (I) plus
``wgrad_ms`` (W), as in :class:`megapipe.records.LayerCost`.

Memory release rule: a microbatch's activations on a stage are held from the start
of its F until the end of its last backward op on that stage -- B for fused
backwards, W for split ones (W still reads the layer inputs and the output
gradients). One rank runs its ops in sequence, so the peaks follow from the order
alone and do not depend on the times.

Two bubbles (Qi et al. 2024, Sec. 3): ``bubble_fraction`` is flushed,
``1 - sum(busy) / (P * step_time)`` from the global start to the global end;
``steady_bubble_fraction`` uses each rank's own span from its first op's start to
its last op's end, ``1 - sum(busy) / sum(span)``, the figure that applies when
iterations overlap (optimizer post-validation).
"""

from megapipe.simulate.engine import simulate
from megapipe.simulate.relaxed import relaxed_step_ms
from megapipe.simulate.inputs import p2p_cost, pipeline_link, stage_times
from megapipe.simulate.result import OpTiming, P2PCost, RankStats, SimResult, StageTimes

__all__ = ["simulate", "StageTimes", "P2PCost", "RankStats", "OpTiming", "SimResult", "stage_times", "pipeline_link",
           "p2p_cost", "relaxed_step_ms"]
