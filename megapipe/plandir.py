"""A plan directory: the ``megapipe-plan/1`` file and the files that start the run, written and read in one place.

:func:`plan_emission` is the one sequence every command that emits a plan runs: each pipeline rank's GPU
type, whether megatron-core runs the schedule (:func:`megapipe.schedules.megatron_warnings`), the arguments
for every front end (:func:`megapipe.emit.emit`), the launch script and, on a mixed cluster, the GPU type of
each node rank. :func:`write_plan` adds the plan document (:func:`megapipe.plan.document.plan_document`)
and writes the directory; ``megapipe plan`` and ``megapipe pack`` (one per job) use it, ``megapipe
partition`` and ``megapipe replan`` the emission alone. :func:`read_plan` reads plan.yaml back, checked.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megapipe.emit import BridgeKeys, Emitted, emit, launch_script, node_rank_lines, slurm_script
from megapipe.errors import ConfigError
from megapipe.files import atomic_write_text, dump_yaml, make_executable, read_yaml
from megapipe.placement import default_gpus, gpus_by_name, node_gpus, node_ranges
from megapipe.plan.document import FORMAT as PLAN_FORMAT
from megapipe.plan.document import plan_document
from megapipe.plan.plans import SearchResult
from megapipe.profile.format import save_profile
from megapipe.records import ClusterSpec, GpuSpec, ModelSpec, ParallelSpec, Partition, Profile, TrainSpec
from megapipe.schedules import megatron_warnings

__all__ = ["PLAN_FILE", "PLAN_TEXT_FILES", "LAUNCH_FILE", "SLURM_FILE", "NODE_RANKS_FILE", "PROFILE_FILE", "GANTT_FILE",
           "MEMORY_FILE", "PLAN_DIR_FILES", "Emission", "plan_emission", "WrittenPlan", "write_plan",
           "checked_plan_document", "read_plan"]

PLAN_FILE = "plan.yaml"
"""The plan document's name inside a plan directory."""
_NEMO1_FILE = "nemo1_overrides.txt"
PLAN_TEXT_FILES = (("megatron_args.txt", "megatron_command"), ("bridge_overrides.txt", "bridge_command"),
                   ("nemo2_overrides.txt", "nemo2_command"), (_NEMO1_FILE, "nemo1_command"))
"""The plan dir's argument files and the :class:`~megapipe.emit.Emitted` line each holds: one shell-quoted
line, to paste after the command or to use as ``eval "torchrun ... pretrain_gpt.py $(cat megatron_args.txt)"``;
when NeMo 1 cannot run the plan as planned, a comment line before the NeMo 1 line says why."""
LAUNCH_FILE = "launch_megatron.sh"
SLURM_FILE = "launch_slurm.sbatch"
NODE_RANKS_FILE = "node_ranks.txt"
PROFILE_FILE = "profile.yaml"
GANTT_FILE = "gantt.png"
MEMORY_FILE = "memory.png"
PLAN_DIR_FILES = (
    (PLAN_FILE, "the plan (megapipe-plan/1): the best plan to run, the ranked ones, the inputs; no timestamps"),
    ("megatron_args.txt", "the Megatron-LM arguments, one shell-quoted line"),
    ("bridge_overrides.txt", "Megatron-Bridge overrides, one shell line"),
    ("nemo2_overrides.txt", "NeMo 2 overrides, one shell line"),
    (_NEMO1_FILE, "NeMo 1 overrides, one shell line; a first # line says why when NeMo 1 cannot run them as planned"),
    (LAUNCH_FILE, "torchrun on each node: NODE_RANK=n MASTER_ADDR=host MEGATRON_LM=checkout bash launch_megatron.sh"),
    (SLURM_FILE, "the same on Slurm: MEGATRON_LM=checkout sbatch launch_slurm.sbatch"),
    (NODE_RANKS_FILE, "mixed clusters only: the GPU type each node rank must run on"),
    (PROFILE_FILE, "the per-layer costs the best plan was made with (megapipe-profile/1; replan reads it)"),
    (GANTT_FILE, "the best plan's schedule, rank by rank over one step"),
    (MEMORY_FILE, "each pipeline rank's peak memory, the best plan beside the equal split"),
)
"""Every file a plan directory may hold, in the order they are written and named on the console, and what it is:
the argument files and launch scripts only for a plan megatron-core runs, the pictures unless
``output.pictures=false``. ``megapipe plan --help`` prints this list; tests hold the README and docs/emit.md to it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Emission:
    """A plan in the front ends' own terms, or why it has none."""

    gpus: tuple[GpuSpec, ...]
    """The GPU type of each pipeline rank."""
    emitted: Emitted | None
    """None for a plan megatron-core cannot run (:attr:`what_if`)."""
    what_if: tuple[str, ...] = ()
    """Why there are no arguments: what megatron-core would run instead."""
    launch: str = ""
    """launch_megatron.sh."""
    slurm: str = ""
    """launch_slurm.sbatch."""
    nodes: tuple[str, ...] = ()
    """The GPU type of each node rank on a mixed cluster; empty otherwise."""


def plan_emission(*, partition: Partition, parallel: ParallelSpec, train: TrainSpec, model: ModelSpec,
                  cluster: ClusterSpec, stage_gpus: Sequence[str] = (), bridge_keys: str = "flat",
                  title: str = "") -> Emission:
    """Place, check and emit one plan: ``stage_gpus`` names each pipeline rank's GPU type (a mixed plan's
    placement), else the cluster's default placement."""
    pp = parallel.pipeline_model_parallel_size
    gpus = gpus_by_name(cluster, stage_gpus) if stage_gpus else default_gpus(cluster, pp)
    nodes = node_gpus(cluster, parallel, [gpu.name for gpu in gpus]) if cluster.is_heterogeneous else ()
    what_if = megatron_warnings(partition.schedule, pipeline_model_parallel_size=pp,
                                virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size)
    if what_if:
        return Emission(gpus=gpus, emitted=None, what_if=what_if, nodes=nodes)
    emitted = emit(partition=partition, parallel=parallel, train=train, model=model, gpus=gpus,
                   bridge_keys=BridgeKeys(bridge_keys), domain_gpus=cluster.domain_gpus,
                   gpus_per_node=cluster.gpus_per_node)
    ranges, title = node_ranges(nodes) if nodes else "", title or f"megapipe plan of {model.name} on {cluster.name}"
    launch = launch_script(emitted, gpus_per_node=cluster.gpus_per_node, num_nodes=cluster.num_nodes,
                           vocab_size=model.vocab_size, node_ranges=ranges, title=title)
    slurm = slurm_script(emitted, gpus_per_node=cluster.gpus_per_node, num_nodes=cluster.num_nodes,
                         vocab_size=model.vocab_size, job_name=f"megapipe-{model.name}", node_ranges=ranges, title=title)
    return Emission(gpus=gpus, emitted=emitted, launch=launch, slurm=slurm, nodes=nodes)


@dataclass(frozen=True, slots=True, kw_only=True)
class WrittenPlan:
    emission: Emission
    document: dict
    """plan.yaml's content."""
    files: tuple[str, ...]


def write_plan(directory: str, *, result: SearchResult, model: ModelSpec, cluster: ClusterSpec, inputs: Mapping,
               bridge_keys: str = "flat", title: str = "", extra: Mapping | None = None) -> WrittenPlan:
    """The best plan of ``result`` emitted, documented and written: plan.yaml, and for a plan megatron-core
    runs its argument files, launch scripts (torchrun per node, and a Slurm batch script) and (mixed clusters) the
    node ranks' GPU types, and profile.yaml (the layer costs the best plan was made with); each atomically."""
    best = result.best
    emission = plan_emission(partition=best.partition, parallel=best.parallel, train=best.train, model=model,
                             cluster=cluster, stage_gpus=best.stage_gpus, bridge_keys=bridge_keys, title=title)
    sections = dict(extra or {})
    if emission.nodes:
        sections["node_gpus"] = list(emission.nodes)
    document = plan_document(result=result, model=model, cluster=cluster, inputs=dict(inputs),
                             emitted=emission.emitted.as_dict() if emission.emitted else None, extra=sections)
    profile = result.profile if isinstance(result.profile, Profile) else None
    files = _write_files(directory, document=document, emission=emission, profile=profile)
    return WrittenPlan(emission=emission, document=document, files=files)


def _write_files(directory: str, *, document: dict, emission: Emission, profile: Profile | None) -> tuple[str, ...]:
    os.makedirs(directory, exist_ok=True)
    written = [os.path.join(directory, PLAN_FILE)]
    atomic_write_text(written[0], dump_yaml(document))
    if emission.emitted is not None:
        for name, attribute in PLAN_TEXT_FILES:
            written.append(os.path.join(directory, name))
            text = getattr(emission.emitted, attribute) + "\n"
            atomic_write_text(written[-1], _caveat(name, emission.emitted) + text)
        written.append(os.path.join(directory, LAUNCH_FILE))
        atomic_write_text(written[-1], emission.launch)
        make_executable(written[-1])
        written.append(os.path.join(directory, SLURM_FILE))
        atomic_write_text(written[-1], emission.slurm)
    if emission.nodes:
        written.append(os.path.join(directory, NODE_RANKS_FILE))
        atomic_write_text(written[-1], node_rank_lines(emission.nodes))
    if profile is not None:
        written.append(os.path.join(directory, PROFILE_FILE))
        save_profile(profile, written[-1])
    return tuple(written)


def _caveat(name: str, emitted: Emitted) -> str:
    """A comment line opening an argument file its front end cannot run as planned, saying why (NeMo 1 only: the
    other front ends take every plan megatron-core runs)."""
    if name != _NEMO1_FILE or not emitted.nemo1_unrunnable:
        return ""
    return f"# NeMo 1 cannot run this plan as planned: {'; '.join(emitted.nemo1_unrunnable)}\n"


def checked_plan_document(document: object, *, source: str = "plan") -> dict:
    """``document`` when it is a ``megapipe-plan/1`` mapping with a best plan; ConfigError naming the fix."""
    if not isinstance(document, Mapping) or document.get("format") != PLAN_FORMAT or "best" not in document:
        got = document.get("format") if isinstance(document, Mapping) else type(document).__name__
        raise ConfigError(f"{source}: format={got!r} is not a {PLAN_FORMAT} document; pass the {PLAN_FILE} "
                          "that `megapipe plan` wrote")
    return dict(document)


def read_plan(path: str | os.PathLike) -> dict:
    """The ``megapipe-plan/1`` document in ``path`` (a plan.yaml, or a directory holding one)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, PLAN_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"plan {path!r} does not exist; pass the {PLAN_FILE} that `megapipe plan` wrote")
    fix = f"restore the {PLAN_FILE} that `megapipe plan` wrote"
    return checked_plan_document(read_yaml(path, ConfigError, "plan", fix), source=path)
