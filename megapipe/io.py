"""megapipe's files: atomic writes, profile files and plan files, read and written in one place.

Every file is written to a temporary file beside its path and renamed into place, so a
crash never leaves a half-written file, and with the mode the process umask gives a new
file (``tempfile`` alone would give 0600). The same inputs give the same bytes: YAML is
dumped with a fixed style and PNG metadata is pinned by the callers.

Readers turn every problem (missing file, bad YAML, wrong format string) into one
:class:`~megapipe.errors.MegapipeError` that names the file and the fix.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping

import yaml

from megapipe.errors import ConfigError, ProfileError
from megapipe.plan.document import FORMAT as PLAN_FORMAT
from megapipe.profile.format import profile_from_dict, profile_to_dict
from megapipe.records import Profile

__all__ = [
    "PLAN_FILE",
    "FAILED_FILE",
    "atomic_write_bytes",
    "atomic_write_text",
    "dump_yaml",
    "load_profile",
    "save_profile",
    "read_plan",
    "plan_document",
    "write_plan_dir",
    "PUBLIC_RUNS",
    "read_runs",
    "replace_marked_section",
]

PLAN_FILE = "plan.yaml"
"""The plan document's name inside a plan directory."""
FAILED_FILE = "failed.txt"
"""Written into a sweep job's directory when the job fails, with the one-line reason."""

PUBLIC_RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "public_runs.yaml")
"""The public measured runs shipped with megapipe (``megapipe validate``'s default data set)."""

_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's emitter and parser when PyYAML has them (10x faster; tests/test_io.py checks the bytes agree)."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it into place."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def dump_yaml(document: object, *, flow: bool | None = False, width: int = 120) -> str:
    """YAML text in megapipe's fixed style (insertion order kept), for byte-identical files."""
    return yaml.dump(document, Dumper=_DUMPER, sort_keys=False, default_flow_style=flow, width=width)


def _read_yaml(path: str, error: type[Exception], what: str, fix: str) -> object:
    try:
        with open(path, encoding="utf-8") as handle:
            return yaml.load(handle, Loader=_LOADER)
    except OSError as exc:
        raise error(f"cannot read {what} {path!r}: {exc.strerror}; {fix}") from None
    except yaml.YAMLError as exc:
        raise error(f"{what} {path!r} is not valid YAML: {str(exc).splitlines()[0]}; {fix}") from None


def load_profile(path: str | os.PathLike) -> Profile:
    """A ``megapipe-profile/1`` file; ProfileError naming the file otherwise."""
    path = os.fspath(path)
    data = _read_yaml(path, ProfileError, "profile", "pass a file written by `megapipe profile` or `megapipe plan`")
    return profile_from_dict(data, source=path)


def save_profile(profile: Profile, path: str | os.PathLike) -> None:
    """Write ``profile`` atomically as ``megapipe-profile/1``."""
    atomic_write_text(path, dump_yaml(profile_to_dict(profile), flow=None, width=200))


def plan_document(document: object, *, source: str = "plan") -> dict:
    """Check that ``document`` is a ``megapipe-plan/1`` mapping with a best plan; return it."""
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
    return plan_document(_read_yaml(path, ConfigError, "plan", fix), source=path)


PLAN_TEXT_FILES = (("megatron_args.txt", "megatron_command"), ("bridge_overrides.txt", "bridge_command"),
                   ("nemo2_overrides.txt", "nemo2_command"), ("nemo1_overrides.txt", "nemo1_command"))
"""The plan dir's argument files and the :class:`~megapipe.emit.Emitted` line each holds: one shell-quoted
line, to paste after the command or to use as ``eval "torchrun ... pretrain_gpt.py $(cat megatron_args.txt)"``."""
LAUNCH_FILE = "launch_megatron.sh"
NODE_RANKS_FILE = "node_ranks.txt"


def write_plan_dir(directory: str, *, document: dict, emitted=None, launch: str = "", node_ranks: str = "",
                   profile: Profile | None = None) -> tuple[str, ...]:
    """plan.yaml, and for a plan Megatron runs its argument files, launch script and (mixed clusters) the node
    ranks' GPU types, and profile.yaml when the plan was costed with one; each atomically. Returns the files."""
    os.makedirs(directory, exist_ok=True)
    written = [os.path.join(directory, PLAN_FILE)]
    atomic_write_text(written[0], dump_yaml(document))
    if emitted is not None:
        for name, attribute in PLAN_TEXT_FILES:
            written.append(os.path.join(directory, name))
            atomic_write_text(written[-1], getattr(emitted, attribute) + "\n")
        written.append(os.path.join(directory, LAUNCH_FILE))
        atomic_write_text(written[-1], launch)
        os.chmod(written[-1], 0o777 & ~_umask())
    if node_ranks:
        written.append(os.path.join(directory, NODE_RANKS_FILE))
        atomic_write_text(written[-1], node_ranks)
    if profile is not None:
        written.append(os.path.join(directory, "profile.yaml"))
        save_profile(profile, written[-1])
    return tuple(written)


def read_runs(path: str | os.PathLike = PUBLIC_RUNS):
    """The measured runs of a ``megapipe-runs/1`` file (:mod:`megapipe.validation.runs`)."""
    from megapipe.validation.runs import runs_from_document

    path = str(path)
    document = _read_yaml(path, ConfigError, "runs",
                          "give a megapipe-runs/1 file (megapipe/data/public_runs.yaml shows the layout)")
    return runs_from_document(document, source=path)


def replace_marked_section(path: str | os.PathLike, *, begin: str, end: str, body: str) -> None:
    """Rewrite the text between the ``begin`` and ``end`` marker lines of a text file (atomically)."""
    path = str(path)
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}; give an existing Markdown file") from None
    if begin not in text or end not in text or text.index(begin) > text.index(end):
        raise ConfigError(f"{path} lacks the marker lines {begin!r} ... {end!r}; add them where the table goes")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    atomic_write_text(path, f"{head}{begin}\n{body.rstrip()}\n{end}{tail}")
