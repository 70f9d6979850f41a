"""``megapipe COMMAND [overrides...]``: the only place that reads argv.

Each command is a module of :mod:`megapipe.commands` with ``prepare(cfg)`` (the config, and
any files it names, turned into records: every check that can fail on bad input) and
``run(prepared, directory=...)``, and may name the config keys it reads (``CONFIG_KEYS``) and the
files it writes (``FILES``) for its ``--help``. A single run composes the config once, prepares,
makes a run directory of its own (``output.dir``, else ``outputs/<command>/<time>``, made unique
when two runs start in the same second) and runs; a run that wrote files there gets Hydra's
``.hydra/`` record beside them, and ``<command>.log`` once something is logged. A run that fails,
or writes nothing there, leaves no directory behind. ``-m`` makes it a Hydra multirun (sweeps,
joblib or submitit launchers). Bad input of any kind (unknown config option, mistyped key,
infeasible plan, corrupt file) ends in one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import gc
import importlib
import itertools
import logging
import os
import sys
from collections.abc import Sequence

from megapipe.commands import COMMANDS, DRAWING
from megapipe.errors import MegapipeError

__all__ = ["main"]

USAGE = f"""usage: megapipe COMMAND [PATH] [key=value ...] [-m]

commands: {', '.join(COMMANDS)}
  megapipe plan                                  search TP/PP/DP/VP, micro-batch, recompute and schedule
  megapipe partition model=llama3_70b parallel.pipeline_model_parallel_size=8
  megapipe simulate schedule=all parallel.pipeline_model_parallel_size=8 train.num_microbatches=32
  megapipe report multirun/plan/DATE             gather a sweep's plans into one table
  megapipe profile model=tiny_gpt                measure per-layer costs with megatron-core
  megapipe calibrate RUN_DIR [RUN_DIR ...]       fit the runtime to monitored runs of your cluster (runtime=FILE)
  megapipe calibrate PROFILE [PROFILE ...]       fit the cost model's GPU efficiency to profiles
  megapipe replan RUN_DIR                        re-partition from a monitored run
  megapipe validate [RUNS.yaml]                  predicted against measured step time of published runs
  megapipe pack                                  share a cluster between jobs: nodes, GPU type and plan per job
Config groups live in hydra_conf/ (model=, cluster=, parallel=, train=, schedule=, search=, output=).
Add your own with hydra.searchpath=[file:///your/conf]. `megapipe COMMAND --help` shows a command's help;
`megapipe COMMAND --hydra-help` Hydra's."""

_MAX_PRECHECK = 64
_FLAGS_WITH_VALUE = ("--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-dir", "-cd",
                     "--experimental-rerun")
_HYDRA_FLAGS = ("--cfg", "-c", "--info", "--hydra-help", "--package", "-p", "--config-name", "-cn",
                "--config-dir", "-cd", "--experimental-rerun", "--shell-completion", "-sc")


def _fail(command: str, message: str) -> int:
    first = " ".join(str(message).strip().split())
    print(f"megapipe {command}: error: {first}", file=sys.stderr)
    return 2


_TAKES_PATHS = {"report": "DIR", "replan": "RUN_DIR", "calibrate": "RUN_DIR or PROFILE", "validate": "RUNS.yaml"}
"""Commands that take positional paths, and what they are."""
_TAKES_SEVERAL = ("calibrate",)
"""Commands that take several paths at once."""
_OWN_FLAGS = ("-m", "--multirun", "-h", "--help")


class _BadArguments(MegapipeError):
    """An argument the command does not take."""


def _flag_error(command: str, rest: Sequence[str], at: int) -> _BadArguments:
    """The error for the flag at ``rest[at]``: Megatron-LM flags (all of them on the line) with their keys."""
    from megapipe.config.validate import megatron_flag_key

    flag = rest[at].split("=")[0]
    if megatron_flag_key(flag) is None:
        return _BadArguments(f"{command} takes no flag {flag}; settings are key=value (e.g. model=llama3_70b), "
                             f"see megapipe {command} --help")
    given, keys = [], []
    for index, arg in enumerate(rest):
        if not arg.startswith("--") or megatron_flag_key(arg) is None:
            continue
        name, has_value, value = arg.partition("=")
        if not has_value:
            following = rest[index + 1] if index + 1 < len(rest) else ""
            value = following if following and not following.startswith("-") and "=" not in following else ""
        given.append(f"{name} {value}".strip())
        key = megatron_flag_key(name)
        keys.append(key if "=" in key else f"{key}={value or 'true'}")
    return _BadArguments(f"{' '.join(given)}: Megatron-LM flags; megapipe takes key=value settings: "
                         f"{' '.join(keys)}")


def _split_args(command: str, rest: Sequence[str]) -> tuple[list[str], list[str], bool]:
    """Return (overrides, hydra flags, multirun); bare paths become ``input=...`` for commands that take them.

    Anything else a command does not take (a Megatron-LM flag, a stray word) is refused, naming the key it
    likely means, rather than dropped."""
    overrides, flags, multirun, paths = [], [], False, []
    rest = list(rest)
    index = 0
    while index < len(rest):
        arg = rest[index]
        following = rest[index + 1] if index + 1 < len(rest) else None
        index += 1
        if arg in ("-m", "--multirun"):
            multirun = True
        elif arg in _FLAGS_WITH_VALUE:
            flags += [arg, following or ""]
            index += 1
        elif arg.startswith("-"):
            if arg in _OWN_FLAGS or arg.split("=")[0] in _HYDRA_FLAGS:
                flags.append(arg)
            else:
                raise _flag_error(command, rest, index - 1)
        elif "=" in arg:
            overrides.append(arg)
        elif command in _TAKES_PATHS:
            paths.append(arg)
        else:
            raise _BadArguments(f"{command} takes no positional argument {arg!r}; settings are key=value "
                                f"(e.g. model=llama3_70b), see megapipe {command} --help")
    if len(paths) > 1 and command not in _TAKES_SEVERAL:
        raise _BadArguments(f"{command} takes one {_TAKES_PATHS[command]}, not {len(paths)} ("
                            f"{', '.join(repr(path) for path in paths)}); run it once per {_TAKES_PATHS[command]}")
    if paths:
        overrides.append("input=" + ",".join(paths) if len(paths) == 1 else f"input='{os.pathsep.join(paths)}'")
    return overrides, flags, multirun


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


def _help(command: str, module) -> str:
    """The command's docstring, the files it writes and the config keys it reads with their meanings."""
    import shutil

    path = f"{_TAKES_PATHS[command]} " if command in _TAKES_PATHS else ""
    parts = [f"usage: megapipe {command} {path}[key=value ...] [-m]", (module.__doc__ or "").strip()]
    files = getattr(module, "FILES", None)
    if files:
        width = max(len(name) for name, _ in files) + 2
        parts.append(f"Files it writes into its directory (output.dir, else outputs/{command}/<date>_<time>), with "
                     "the run's composed config and overrides under .hydra/:\n"
                     + "\n".join(f"  {name.ljust(width)}{what}" for name, what in files))
    elif files is not None:
        parts.append("It writes no files, so it leaves no directory.")
    keys = getattr(module, "CONFIG_KEYS", None)
    if keys:
        from megapipe.config.keys import config_help

        columns = shutil.get_terminal_size((120, 24)).columns
        parts.append(f"Config keys it reads (set any with key=value; `megapipe {command} --cfg job` prints their "
                     f"values):\n{config_help(keys, width=min(columns, 160))}")
    else:
        parts.append("Any config key can be overridden (model=, cluster=, parallel.*, train.*, schedule=, search.*, "
                     f"output.*);\n`megapipe {command} --cfg job` prints the composed config.")
    parts.append(f"`megapipe {command} --hydra-help` shows Hydra's options (-m sweeps: model=llama3_8b,llama3_70b).")
    return "\n\n".join(parts)


def _precheck_sweep(command: str, module, overrides: list[str]) -> None:
    """Compose and prepare each combination of a sweep (up to a cap) so bad input fails before any job runs."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from megapipe.config import compose

    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = []
    for override in parsed:
        if override.is_sweep_override():
            choices.append([f"{override.get_key_element()}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
    for combo in itertools.islice(itertools.product(*choices), _MAX_PRECHECK):
        module.prepare(compose([*combo, f"hydra.job.name={command}"], return_hydra_config=True))


def main(argv: Sequence[str] | None = None) -> int:
    """The console script (``argv`` None: the command line, with pictures drawn in a second process while the
    command computes) or an in-process call with ``argv``."""
    from megapipe.commands import painter

    if argv is None and len(sys.argv) > 1 and sys.argv[1] in DRAWING and not _asks_for_help(sys.argv[2:]):
        painter.start()
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    finally:
        painter.stop()
        if argv is None:
            # The console script's process ends next: what the command built (a pack's curves and plans) needs no
            # collecting, and the interpreter's last collection would walk all of it once more before exiting.
            gc.freeze()


def _asks_for_help(rest: Sequence[str]) -> bool:
    return any(arg in ("-h", "--help") for arg in rest)


def _main(argv: list[str]) -> int:
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
    if _asks_for_help(rest):
        print(_help(command, module))
        return 0
    try:
        overrides, flags, multirun = _split_args(command, rest)
        from megapipe.config.validate import check_override_keys

        check_override_keys(overrides)
    except MegapipeError as exc:
        return _fail(command, str(exc))
    if any(flag in ("-h", "--help") for flag in flags):
        print(_help(command, module))
        return 0
    if any(flag.split("=")[0] in _HYDRA_FLAGS for flag in flags):
        return _run_hydra(command, module, overrides, flags, multirun)
    try:
        if multirun:
            _precheck_sweep(command, module, overrides)
        else:
            from megapipe.config import compose

            cfg = compose([*overrides, f"hydra.job.name={command}"], return_hydra_config=True)
            prepared = module.prepare(cfg)
    except MegapipeError as exc:
        return _fail(command, str(exc))
    except Exception as exc:  # Hydra's composition errors: unknown group option, bad key, bad value
        return _fail(command, _describe(exc))
    if multirun:
        return _run_hydra(command, module, overrides, flags, multirun)
    try:
        _run_once(command, module, cfg, prepared, overrides)
    except MegapipeError as exc:
        return _fail(command, str(exc))
    return 0


def _make_run_dir(cfg) -> tuple[str, list[str]]:
    """``output.dir`` as given, else Hydra's ``hydra.run.dir``; a second run in the same second gets ``-1``, ``-2``...

    Returns the directory and the directories this made, deepest first (empty when ``output.dir`` existed), so a run
    that writes nothing can take them back."""
    if cfg.output.get("dir"):
        directory = str(cfg.output.dir)
        made = _missing_dirs(directory)
        os.makedirs(directory, exist_ok=True)
        return directory, made
    base = str(cfg.hydra.run.dir)
    for attempt in itertools.count():
        directory = base if attempt == 0 else f"{base}-{attempt}"
        made = _missing_dirs(directory)
        try:
            os.makedirs(directory)
            return directory, made
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def _missing_dirs(directory: str) -> list[str]:
    """``directory`` and those of its parents that do not exist yet, deepest first."""
    missing, path = [], os.path.abspath(directory)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _remove_made(made: list[str], *, failed: bool) -> None:
    """Take back the directories a run made: all of the run directory when the run failed, else only empty ones
    (a parent another run has written into meanwhile stays)."""
    import shutil

    if failed and made:
        shutil.rmtree(made[0], ignore_errors=True)
    for path in made:
        try:
            os.rmdir(path)
        except OSError:  # not empty, or already gone
            if os.path.exists(path):
                return


def _record_run(cfg, overrides: list[str], directory: str) -> None:
    """Hydra's ``.hydra/`` record of a run: the composed config and the overrides."""
    from omegaconf import OmegaConf

    from megapipe.files import atomic_write_text, dump_yaml

    record = os.path.join(directory, ".hydra")
    task = OmegaConf.to_container(cfg, resolve=False)
    task.pop("hydra", None)
    atomic_write_text(os.path.join(record, "config.yaml"), OmegaConf.to_yaml(OmegaConf.create(task)))
    atomic_write_text(os.path.join(record, "overrides.yaml"), dump_yaml(list(overrides)))


def _run_once(command: str, module, cfg, prepared, overrides: list[str]) -> None:
    """Make the run directory, log to ``<command>.log`` (opened at the first record), run, and record the run
    beside what it wrote; a failed run, or one that wrote nothing, leaves none of the directories it made."""
    from hydra.core.hydra_config import HydraConfig

    from megapipe.commands import painter

    HydraConfig.instance().set_config(cfg)
    directory, made = _make_run_dir(cfg)
    handler = logging.FileHandler(os.path.join(directory, f"{command}.log"), encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    logging.getLogger().addHandler(handler)
    failed = True
    recorded = False
    try:
        module.run(prepared, directory=directory)
        if os.listdir(directory):  # recorded while the painter draws the last pictures
            _record_run(cfg, overrides, directory)
            recorded = True
        painter.finish()
        failed = False
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
        if failed:
            _remove_made(made, failed=True)
    if recorded:
        return
    if made and not os.listdir(directory):
        _remove_made(made, failed=False)
        return
    _record_run(cfg, overrides, directory)


_FAILURES_ENV = "MEGAPIPE_SWEEP_FAILURES"


def _task(command: str, module, multirun: bool, runtime_path: str | None):
    def task(cfg) -> None:
        from hydra.core.hydra_config import HydraConfig

        from megapipe.config import with_runtime_file

        from megapipe.commands import painter

        directory = str(cfg.output.get("dir") or HydraConfig.get().runtime.output_dir)
        try:
            module.run(module.prepare(_with_command_line(with_runtime_file(cfg, runtime_path))), directory=directory)
            painter.finish()  # this job's pictures, before the next job starts
        except MegapipeError as exc:
            code = _fail(command, str(exc))
            if not multirun:
                sys.exit(code)
            _record_failure(directory, " ".join(str(exc).split()))

    return task


def _with_command_line(cfg):
    """A sweep job's config with Hydra's record of its command line (``hydra.overrides.task``), as a single run's
    composed config has it: what a command reads to tell the user's settings from the defaults."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    if "hydra" in cfg:
        return cfg
    with open_dict(cfg):
        cfg.hydra = {"overrides": {"task": list(HydraConfig.get().overrides.task)}}
    return cfg


def _record_failure(directory: str, message: str) -> None:
    """The failed job's reason in its directory, and a line for the parent process (jobs may run elsewhere)."""
    from megapipe.files import FAILED_FILE, atomic_write_text

    atomic_write_text(os.path.join(directory, FAILED_FILE), message + "\n")
    ledger = os.environ.get(_FAILURES_ENV)
    if ledger:
        with open(ledger, "a", encoding="utf-8") as handle:
            handle.write(f"{directory}\t{message}\n")


def _run_hydra(command: str, module, overrides: list[str], flags: list[str], multirun: bool) -> int:
    """Hydra's own runner: sweeps with their launchers, and Hydra's flags (--cfg, --info, ...)."""
    import hydra

    from megapipe.config import conf_dir, register_configs, runtime_file

    import tempfile

    try:
        overrides, runtime_path = runtime_file(overrides)
    except MegapipeError as exc:
        return _fail(command, str(exc))
    register_configs()
    app = hydra.main(config_path=conf_dir(), config_name="config", version_base=None)(
        _task(command, module, multirun, runtime_path))
    saved = sys.argv
    sys.argv = [f"megapipe-{command}", *flags, *(["-m"] if multirun else []), f"hydra.job.name={command}", *overrides]
    ledger = tempfile.NamedTemporaryFile("r", prefix="megapipe-sweep-", suffix=".txt", delete=False)  # noqa: SIM115
    os.environ[_FAILURES_ENV] = ledger.name
    try:
        app()
    except SystemExit as exc:
        return int(exc.code or 0) if isinstance(exc.code, int) else 2
    finally:
        sys.argv = saved
        os.environ.pop(_FAILURES_ENV, None)
        failed = ledger.read().splitlines()
        ledger.close()
        os.unlink(ledger.name)
    if failed:
        return _fail(command, f"{len(failed)} sweep job(s) failed (each wrote failed.txt in its directory), "
                              f"first: {failed[0].split(chr(9), 1)[-1]}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
