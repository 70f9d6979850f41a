"""``megapipe COMMAND [overrides...]``: the only place that reads argv.

Each command is a Hydra app over the shipped ``hydra_conf``; ``-m`` makes it a
multirun (sweeps, joblib or submitit launchers). Bad input of any kind (unknown
config option, mistyped key, infeasible plan, corrupt file) ends in one line on
stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import importlib
import itertools
import os
import sys
from collections.abc import Sequence

from megapipe.commands import COMMANDS
from megapipe.errors import MegapipeError

__all__ = ["main", "output_dir"]

USAGE = f"""usage: megapipe COMMAND [PATH] [key=value ...] [-m]

commands: {', '.join(COMMANDS)}
  megapipe plan                                  search TP/PP/DP/VP, micro-batch, recompute and schedule
  megapipe partition model=llama3_70b parallel.pipeline_model_parallel_size=8
  megapipe simulate schedule=all parallel.pipeline_model_parallel_size=8 train.num_microbatches=32
  megapipe report multirun/plan/DATE             gather a sweep's plans into one table
  megapipe profile model=tiny_gpt                measure per-layer costs with megatron-core
  megapipe calibrate PROFILE [PROFILE ...]       fit the cost model's efficiency to measurements
  megapipe replan RUN_DIR                        re-partition from a monitored run
Config groups live in hydra_conf/ (model=, cluster=, parallel=, train=, schedule=, search=, output=).
Add your own with hydra.searchpath=[file:///your/conf]. `megapipe COMMAND --help` shows Hydra's help."""

_MAX_PRECHECK = 64
_FLAGS_WITH_VALUE = ("--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-dir", "-cd",
                     "--experimental-rerun")


def _fail(command: str, message: str) -> int:
    first = " ".join(str(message).strip().split())
    print(f"megapipe {command}: error: {first}", file=sys.stderr)
    return 2


def output_dir(cfg) -> str:
    """Where a command writes its files: output.dir, else Hydra's run directory."""
    if cfg.output.get("dir"):
        return str(cfg.output.dir)
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.output_dir
    except ValueError:
        return os.getcwd()


def _split_args(rest: Sequence[str]) -> tuple[list[str], list[str], bool]:
    """Return (overrides, hydra flags, multirun); bare paths become ``input=...``."""
    overrides, flags, multirun, paths = [], [], False, []
    args = iter(rest)
    for arg in args:
        if arg in ("-m", "--multirun"):
            multirun = True
        elif arg in _FLAGS_WITH_VALUE:
            flags += [arg, next(args, "")]
        elif arg.startswith("-"):
            flags.append(arg)
        elif "=" in arg:
            overrides.append(arg)
        else:
            paths.append(arg)
    if paths:
        overrides.append("input=" + ",".join(paths) if len(paths) == 1 else f"input='{os.pathsep.join(paths)}'")
    return overrides, flags, multirun


def _precheck(overrides: list[str], multirun: bool, check=None) -> None:
    """Compose once per combination (up to a cap) so errors surface as one line before Hydra runs.

    ``check`` is the command's own ``precheck(cfg)`` when it has one (``plan`` leaves
    searched dimensions free, so the filled defaults must not be validated).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from megapipe.config import compose, to_setup

    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = []
    for override in parsed:
        if override.is_sweep_override() and multirun:
            choices.append([f"{override.get_key_element()}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
    for combo in itertools.islice(itertools.product(*choices), _MAX_PRECHECK):
        (check or to_setup)(compose(list(combo)))


def _describe(exc: BaseException) -> str:
    """Hydra's multi-line composition errors, folded into one line (option lists comma-separated)."""
    lines = [line.strip() for line in (str(exc) or type(exc).__name__).splitlines() if line.strip()]
    folded = lines[0] if lines else type(exc).__name__
    for line in lines[1:]:
        if line.startswith(("Config search path", "full_key", "object_type")):
            break
        folded += (" " if folded.endswith((":", ".")) else ", ") + line
    cause = exc.__cause__
    if cause is not None and str(cause).strip():
        folded += ": " + str(cause).strip().splitlines()[0]
    return folded


def _task(command: str, module, multirun: bool):
    def task(cfg) -> None:
        try:
            module.run(cfg)
        except MegapipeError as exc:
            code = _fail(command, str(exc))
            if not multirun:
                sys.exit(code)

    return task


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if not sys.stdout.isatty():
        # rich falls back to 80 columns when piped; plan tables need more to stay readable.
        os.environ.setdefault("COLUMNS", "200")
    if command not in COMMANDS:
        return _fail("", f"unknown command {command!r}; use one of {', '.join(COMMANDS)}")
    try:
        module = importlib.import_module(f"megapipe.commands.{command}")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("megapipe"):
            return _fail(command, f"the {command!r} command is not available in this build")
        return _fail(command, f"{command!r} needs {exc.name!r}; install it (e.g. pip install 'megapipe[megatron]')")
    overrides, flags, multirun = _split_args(rest)
    if not any(flag in ("--help", "-h", "--cfg", "-c", "--info", "--hydra-help") or flag.startswith("--cfg")
               for flag in flags):
        try:
            _precheck(overrides, multirun, getattr(module, "precheck", None))
        except MegapipeError as exc:
            return _fail(command, str(exc))
        except Exception as exc:  # Hydra's composition errors: unknown group option, bad key, bad value
            return _fail(command, _describe(exc))
    return _run_hydra(command, module, overrides, flags, multirun)


def _run_hydra(command: str, module, overrides: list[str], flags: list[str], multirun: bool) -> int:
    import hydra

    from megapipe.config import conf_dir, register_configs

    register_configs()
    app = hydra.main(config_path=conf_dir(), config_name="config", version_base=None)(_task(command, module, multirun))
    saved = sys.argv
    sys.argv = [f"megapipe-{command}", *flags, *(["-m"] if multirun else []), f"hydra.job.name={command}", *overrides]
    try:
        app()
    except SystemExit as exc:
        return int(exc.code or 0) if isinstance(exc.code, int) else 2
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
