"""``megapipe calibrate PROFILE [PROFILE ...]``: fit the cluster GPU's efficiency fields to measurements.

The profiles (written by ``megapipe profile``) carry their shapes in meta; the prior is
the selected cluster's GPU. Writes ``<output dir>/calibration/<gpu>.yaml``, a Hydra
overlay used as::

    megapipe plan cluster=... hydra.searchpath=[file://<output dir>] +calibration=<gpu>

(or pass the printed ``cluster.gpu.*=`` overrides), and ``calibration.json`` with the
fitted values, the error before/after and, for two or more profiles, leave-one-out
cross-validation.
"""

from __future__ import annotations

import json
import os

from omegaconf import DictConfig

from megapipe.commands.common import console, print_json
from megapipe.config import Setup, to_setup
from megapipe.cost.calibrate import FIELDS, cross_validate, fit_gpu, overlay_yaml, sample_from_profile
from megapipe.errors import ConfigError, ProfileError
from megapipe.io import atomic_write_text, load_profile

__all__ = ["prepare", "run"]


def _paths(setup: Setup) -> list[str]:
    if not setup.input:
        raise ConfigError("no profile given; run `megapipe calibrate PROFILE [PROFILE ...]`")
    return [path for path in str(setup.input).split(os.pathsep) if path]


def prepare(cfg: DictConfig) -> Setup:
    setup = to_setup(cfg)
    _paths(setup)
    return setup


def run(setup: Setup, *, directory: str) -> None:
    gpu = setup.cluster.gpu
    samples = []
    for path in _paths(setup):
        profile = load_profile(path)
        if profile.device != gpu.name:
            raise ProfileError(
                f"{path} was measured on {profile.device!r} but cluster GPU is {gpu.name!r}; "
                "pick the cluster of that GPU (cluster=...) or profile with extra.device_name set to it"
            )
        samples.append(sample_from_profile(profile, source=path))
    calibration = fit_gpu(samples=samples, gpu=gpu)
    folds = cross_validate(samples=samples, gpu=gpu) if len(samples) > 1 else ()
    overlay = os.path.join(directory, "calibration", f"{gpu.name}.yaml")
    atomic_write_text(overlay, overlay_yaml(calibration, comment=f"megapipe calibrate on {len(samples)} profile(s)"))
    result = {
        "gpu": gpu.name,
        "overlay": overlay,
        "fitted": {name: getattr(calibration.gpu, name) for name in FIELDS},
        "prior": {name: getattr(gpu, name) for name in FIELDS},
        "identified": list(calibration.identified),
        "mean_abs_rel_error_before": calibration.mean_abs_rel_error_before,
        "mean_abs_rel_error_after": calibration.mean_abs_rel_error_after,
        "cross_validation": [
            {"label": fold.label, "mean_abs_rel_error_before": fold.mean_abs_rel_error_before,
             "mean_abs_rel_error_after": fold.mean_abs_rel_error_after,
             "fitted": {name: getattr(fold.gpu, name) for name in FIELDS}}
            for fold in folds
        ],
        "overrides": [f"cluster.gpu.{name}={float(f'{getattr(calibration.gpu, name):.6g}')!r}" for name in FIELDS],
    }
    atomic_write_text(os.path.join(directory, "calibration.json"), json.dumps(result, indent=2) + "\n")
    if setup.output.json:
        print_json(result)
        return
    _print(result, directory=directory)


def _print(result: dict, *, directory: str) -> None:
    from rich.table import Table

    table = Table(title=f"calibration of {result['gpu']}")
    for column in ("field", "prior", "fitted"):
        table.add_column(column, justify="left" if column == "field" else "right")
    for name, value in result["fitted"].items():
        fitted = f"{value:.4g}" if name in result["identified"] else f"{value:.4g} (not identified)"
        table.add_row(name, f"{result['prior'][name]:.4g}", fitted)
    out = console()
    out.print(table)
    out.print(
        f"mean |predicted/measured - 1|: {result['mean_abs_rel_error_before']:.1%} before, "
        f"{result['mean_abs_rel_error_after']:.1%} after"
    )
    for fold in result["cross_validation"]:
        out.print(
            f"  held out {fold['label']}: {fold['mean_abs_rel_error_before']:.1%} -> "
            f"{fold['mean_abs_rel_error_after']:.1%}"
        )
    name = os.path.splitext(os.path.basename(result["overlay"]))[0]
    out.print(f"use: hydra.searchpath=[file://{os.path.abspath(directory)}] +calibration={name}",
                  markup=False, soft_wrap=True)
    out.print("or:  " + " ".join(result["overrides"]), markup=False, soft_wrap=True)
