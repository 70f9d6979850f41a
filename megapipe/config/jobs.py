"""The ``jobs`` and ``pack`` groups become records: the jobs of a shared cluster and how to pack them.

Validated once here (``megapipe pack``): duplicate or empty names, unknown model presets, GPU types no
node group has, token budgets and deadlines the objective needs, node counts, weights.
"""

from __future__ import annotations

import copy
import math
import os
import re

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from megapipe.config.validate import MAX_GPUS, MAX_SIZE, positive_int
from megapipe.errors import ConfigError
from megapipe.records import ClusterSpec, JobSpec
from megapipe.options import PackOptions

__all__ = ["OBJECTIVES", "jobs_of", "pack_options", "with_jobs_nodes"]

OBJECTIVES = ("throughput", "makespan", "deadlines")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def _number(key: str, value, *, low: float = 0.0, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            value < low or (value == low and not allow_zero):
        bound = f">= {low}" if allow_zero else f"> {low}"
        raise ConfigError(f"{key}={value!r} must be a number {bound}")
    return float(value)


def _job_scenario(cfg: DictConfig, job: DictConfig, where: str, cache: dict):
    """The job as ``megapipe plan`` would take it: the command line's config with the job's model, global batch,
    sequence length and precision in place (composed once per distinct job shape)."""
    from megapipe.config.build import compose_model, conf_dir, to_scenario

    presets = sorted(name[:-5] for name in os.listdir(os.path.join(conf_dir(), "model"))
                     if name.endswith(".yaml") and not name.startswith("_"))
    if str(job.model) not in presets:
        raise ConfigError(f"{where}.model={job.model!r} is no hydra_conf/model option; use one of {presets}")
    precision = job.get("precision")
    key = (str(job.model), job.get("seq_length"), precision, int(job.global_batch_size))
    if key not in cache:
        if "base" not in cache:
            # One copy of the config without the job list and Hydra's record (which a job does not read), each job's
            # fields set in it in turn: every field a job sets is set for each job, the precision back to the
            # command line's where the job names none. (OmegaConf copies the nodes it is given, here and below.)
            base = OmegaConf.masked_copy(cfg, [name for name in cfg if name not in ("jobs", "hydra")])
            cache["base"] = (base, base.train.get("precision"))
        job_cfg, line_precision = cache["base"]
        model = ("model", str(job.model))
        if model not in cache:
            cache[model] = compose_model(str(job.model))
        with open_dict(job_cfg):
            job_cfg.model = cache[model]
            job_cfg.train.global_batch_size = int(job.global_batch_size)
            job_cfg.train.seq_length = job.get("seq_length")
            job_cfg.train.precision = line_precision if precision is None else str(precision)
        try:
            cache[key] = to_scenario(job_cfg, search=True)
        except ConfigError as error:
            raise ConfigError(f"{where}: {error}") from None
    return cache[key]


def _command_line_keys(cfg: DictConfig) -> list[str] | None:
    """The keys the run's command line set (Hydra's record of it, ``hydra.overrides.task``); None without it."""
    if "hydra" not in cfg:
        return None
    task = OmegaConf.select(cfg, "hydra.overrides.task")
    return None if task is None else [str(item).lstrip("+~").split("=")[0] for item in task]


def with_jobs_nodes(cfg: DictConfig) -> tuple[DictConfig, str | None]:
    """The config with ``cluster.num_nodes`` set to the job list's ``num_nodes`` (the cluster it is written for),
    and a line saying so; the config as it is, and None, when the list names no node count, the command line
    sets the cluster (``cluster=``, ``cluster.*``) or replaces the jobs (``jobs.jobs=``), the cluster has node
    groups, or the command line is not known (a config composed outside the CLI)."""
    jobs = cfg.get("jobs")
    nodes = jobs.get("num_nodes") if isinstance(jobs, DictConfig) else None
    keys = _command_line_keys(cfg)
    if nodes is None or keys is None or cfg.cluster.get("node_groups"):
        return cfg, None
    if any(key == "cluster" or key.startswith(("cluster.", "jobs.jobs")) for key in keys):
        return cfg, None
    nodes = positive_int("jobs.num_nodes", nodes, upper=MAX_GPUS)
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.cluster.num_nodes = nodes
    return cfg, f"the node count {cfg.jobs.name or 'the job list'} is written for (jobs.num_nodes); " \
                f"cluster.num_nodes=N packs on N"


def jobs_of(cfg: DictConfig, cluster: ClusterSpec) -> tuple[JobSpec, ...]:
    """The ``jobs.jobs`` list as records; ConfigError naming the job and the field on bad input."""
    raw = cfg.jobs.get("jobs") if isinstance(cfg.get("jobs"), DictConfig) else None
    if not isinstance(raw, ListConfig) or len(raw) == 0:
        raise ConfigError("jobs.jobs is empty; pick a job list (jobs=lab_mix) or give jobs.jobs=[{name: ..., "
                          "model: ..., global_batch_size: ...}]")
    gpus = sorted({group.gpu.name for group in cluster.node_groups})
    cache: dict = {}
    jobs, names = [], set()
    for index, job in enumerate(raw):
        name = str(job.get("name") or "")
        where = f"jobs.jobs[{index}] ({name or '?'})"
        if not name:
            raise ConfigError(f"jobs.jobs[{index}] has no name; give every job a unique name")
        if not _NAME.fullmatch(name):
            raise ConfigError(f"{where}: name {name!r} must be letters, digits, '_', '-' or '.' (it names the job's "
                              "plan directory)")
        if name in names:
            raise ConfigError(f"jobs: the name {name!r} appears more than once; give every job a unique name")
        names.add(name)
        if not job.get("model"):
            raise ConfigError(f"{where} has no model; name a hydra_conf/model option")
        positive_int(f"{where}.global_batch_size", job.get("global_batch_size"), upper=MAX_SIZE)
        gpu = job.get("gpu")
        if gpu is not None and str(gpu) not in gpus:
            raise ConfigError(f"{where}.gpu={gpu!r} is no GPU type of cluster {cluster.name!r}; use one of {gpus}")
        scenario = _job_scenario(cfg, job, where, cache)
        tokens = job.get("tokens")
        deadline = job.get("deadline_hours")
        mbs = job.get("max_micro_batch_size")
        jobs.append(JobSpec(
            name=name, model=scenario.model, train=scenario.train, template=scenario.parallel,
            fixed=tuple(sorted(scenario.fixed.items())),
            tokens=0.0 if tokens is None else _number(f"{where}.tokens", tokens),
            deadline_hours=None if deadline is None else _number(f"{where}.deadline_hours", deadline),
            weight=_number(f"{where}.weight", job.get("weight", 1.0)),
            gpu=None if gpu is None else str(gpu),
            max_micro_batch_size=None if mbs is None else positive_int(f"{where}.max_micro_batch_size", mbs),
            arrives_later=bool(job.get("arrives_later", False)),
        ))
    if all(job.arrives_later for job in jobs):
        raise ConfigError("every job has arrives_later=true; at least one job must be packed first")
    return tuple(jobs)


def pack_options(cfg: DictConfig, jobs: tuple[JobSpec, ...]) -> PackOptions:
    node = cfg.get("pack")
    options = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else {}
    objective = str(options.get("objective", "throughput"))
    if objective not in OBJECTIVES:
        raise ConfigError(f"pack.objective={objective!r}; use one of {', '.join(OBJECTIVES)}")
    arrive = bool(options.get("arrive", False))
    packed = [job for job in jobs if arrive or not job.arrives_later]  # a job arriving later is packed in the what-if
    if objective in ("makespan", "deadlines"):
        lacking = [job.name for job in packed if job.tokens <= 0]
        if lacking:
            raise ConfigError(f"pack.objective={objective} needs a token budget for every job; {lacking} have none "
                              "(set tokens: for them)")
    if objective == "deadlines":
        lacking = [job.name for job in packed if job.deadline_hours is None]
        if lacking:
            raise ConfigError(f"pack.objective=deadlines needs deadline_hours for every job packed; {lacking} have "
                              "none (set deadline_hours: for them)")
    counts = options.get("node_counts")
    if counts is not None:
        counts = tuple(sorted({positive_int("pack.node_counts[]", count, upper=1 << 20) for count in counts}))
        if not counts:
            raise ConfigError("pack.node_counts is empty; give node counts such as [1, 2, 4, 8] or null")
    sizes = tuple(sorted({positive_int("pack.baseline_pipeline_sizes[]", size, upper=1024)
                          for size in options.get("baseline_pipeline_sizes") or (1, 2, 4, 8)}))
    fail_nodes = options.get("fail_nodes") or 0
    if isinstance(fail_nodes, bool) or not isinstance(fail_nodes, int) or fail_nodes < 0:
        raise ConfigError(f"pack.fail_nodes={fail_nodes!r} must be an int >= 0")
    slack = _number("pack.move_slack", options.get("move_slack", 0.0), allow_zero=True)
    if slack >= 1:
        raise ConfigError(f"pack.move_slack={slack} must lie in [0, 1)")
    if arrive and not any(job.arrives_later for job in jobs):
        raise ConfigError("pack.arrive=true but no job has arrives_later: true; mark the arriving job")
    restart = _number("pack.restart_minutes", options.get("restart_minutes", 10.0), allow_zero=True)
    return PackOptions(objective=objective, node_counts=counts, baseline_pipeline_sizes=sizes,
                       fail_group=options.get("fail_group"), fail_nodes=int(fail_nodes), arrive=arrive,
                       move_slack=slack, restart_minutes=restart)
