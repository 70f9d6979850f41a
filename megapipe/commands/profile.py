"""``megapipe profile``: measure per-unit costs of the configured model with megatron-core.

Settings beyond the model/train/parallel groups go in ``extra`` (all optional)::

    megapipe profile model=tiny_gpt cluster=cpu_gloo extra='{iters: 10, warmup: 2, num_threads: 2}'

``extra.device`` (auto|cpu|cuda), ``extra.warmup``, ``extra.iters``, ``extra.num_threads``,
``extra.dtype`` (bf16|fp16|fp32; default train.precision), ``extra.out`` (file; default
``<output dir>/profile.yaml``) and ``extra.device_name`` (what the profile calls its
device; default the cluster's GPU name when it is the device measured on, else torch's name).
Tensor parallelism is 1 unless ``parallel.tensor_model_parallel_size`` is set, in
which case launch as many processes with ``torchrun``; rank 0 writes the file.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from omegaconf import DictConfig

from megapipe.commands.common import console, print_json
from megapipe.config import Scenario, extra_of, to_scenario
from megapipe.config.options import output_options
from megapipe.errors import ConfigError
from megapipe.options import OutputOptions
from megapipe.profile.format import save_profile
from megapipe.records import Profile

__all__ = ["ProfileInputs", "prepare", "run", "profile_options", "CONFIG_KEYS"]

CONFIG_KEYS = ("model", "cluster", "parallel", "train", "extra", "output.format", "output.dir")
"""What `megapipe profile --help` lists (:mod:`megapipe.config.keys`)."""

_KEYS = ("device", "warmup", "iters", "num_threads", "dtype", "out", "device_name")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileInputs:
    scenario: Scenario
    options: Mapping[str, object]
    """The ``extra`` settings (:data:`_KEYS`), checked."""
    output: OutputOptions


def profile_options(extra: Mapping[str, object]) -> dict:
    """The ``extra`` mapping, checked for unknown keys."""
    unknown = sorted(set(extra) - set(_KEYS))
    if unknown:
        raise ConfigError(f"unknown profile setting(s) extra.{', extra.'.join(unknown)}; use {', '.join(_KEYS)}")
    return dict(extra)


def prepare(cfg: DictConfig) -> ProfileInputs:
    scenario = to_scenario(cfg)
    return ProfileInputs(scenario=scenario, options=profile_options(extra_of(cfg)), output=output_options(cfg))


def _device_name(requested: str | None, *, torch_name: str, gpu_name: str) -> str:
    """The cluster's GPU name when the measured device is that GPU (e.g. 'h100' in 'NVIDIA H100 80GB HBM3')."""
    if requested:
        return requested
    family = gpu_name.split("_")[0].lower()
    return gpu_name if family and family in torch_name.lower() else torch_name


def run(job: ProfileInputs, *, directory: str) -> None:
    from megapipe.profile.measure import measure_profile
    from megapipe.options import MeasureOptions

    scenario, options = job.scenario, job.options
    parallel = scenario.parallel
    if "tensor_model_parallel_size" not in scenario.fixed:
        parallel = dataclasses.replace(parallel, tensor_model_parallel_size=1, sequence_parallel=False)
    measure = MeasureOptions(**{key: options[key] for key in ("device", "warmup", "iters", "num_threads", "dtype")
                                if options.get(key) is not None})
    with _progress() as on_unit:
        profile = measure_profile(model=scenario.model, train=scenario.train, parallel=parallel, options=measure,
                                  on_unit=on_unit)
    gpu = scenario.cluster.gpu
    device = _device_name(options.get("device_name"), torch_name=profile.device, gpu_name=gpu.name)
    meta = dict(profile.meta)
    if device == gpu.name:
        meta["gpu_bf16_tflops"] = f"{gpu.bf16_tflops:g}"
    meta["data_parallel_size"] = str(parallel.data_parallel_size)
    profile = Profile(layers=profile.layers, device=device, meta=tuple(meta.items()))
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun every TP rank measured; rank 0 writes
        return
    path = options.get("out") or os.path.join(directory, "profile.yaml")
    save_profile(profile, path)
    _report(profile, path=path, as_json=job.output.json)


class _progress:
    """A transient rich progress bar on stderr over the three measured units."""

    def __enter__(self):
        from rich.console import Console
        from rich.progress import Progress

        self._bar = Progress(console=Console(stderr=True), transient=True)
        self._bar.__enter__()
        self._task = self._bar.add_task("profiling", total=3)
        self._started = False
        return self._on_unit

    def _on_unit(self, name: str) -> None:
        if self._started:
            self._bar.advance(self._task)
        self._started = True
        self._bar.update(self._task, description=f"profiling {name}")

    def __exit__(self, *exc) -> None:
        self._bar.advance(self._task)
        self._bar.__exit__(*exc)


def _report(profile: Profile, *, path: str, as_json: bool) -> None:
    first = {}
    for layer in profile.layers:
        first.setdefault(layer.kind.value, layer)
    if as_json:
        units = {kind: {key: getattr(layer, key) for key in ("fwd_ms", "bwd_ms", "wgrad_ms", "act_bytes",
                                                             "static_bytes", "param_count")}
                 for kind, layer in first.items()}
        print_json({"profile": path, "device": profile.device, "num_decoder_layers": profile.num_decoder_layers,
                    "units": units})
        return
    from rich.table import Table

    table = Table(title=f"profile of {dict(profile.meta).get('model', '?')} on {profile.device}")
    for column in ("unit", "fwd ms", "bwd ms", "wgrad ms", "act MiB", "params"):
        table.add_column(column, justify="left" if column == "unit" else "right")
    for kind, layer in first.items():
        label = f"{kind} x{profile.num_decoder_layers}" if kind == "decoder" else kind
        table.add_row(label, f"{layer.fwd_ms:.3f}", f"{layer.bwd_ms:.3f}", f"{layer.wgrad_ms:.3f}",
                      f"{layer.act_bytes / 2**20:.2f}", f"{layer.param_count:,.0f}")
    out = console()
    out.print(table)
    out.print(f"wrote {path}")
