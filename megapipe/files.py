"""megapipe's file writes and YAML, on the ground floor: every file format's owner writes through here.

Every file is written to a temporary file beside its path and renamed into place, so a crash never leaves a
half-written file, and with the mode the process umask gives a new file (``tempfile`` alone would give 0600).
The same inputs give the same bytes: YAML is dumped with a fixed style and PNG metadata is pinned by the
callers. :func:`read_yaml` turns every reading problem (missing file, bad YAML) into one
:class:`~megapipe.errors.MegapipeError` that names the file and the fix.

The formats live beside their owners: profiles in :mod:`megapipe.profile.format`, plan directories in
:mod:`megapipe.plandir`, measured runs in :mod:`megapipe.validation.runs`.
"""

from __future__ import annotations

import os
import tempfile

import yaml

from megapipe.errors import ConfigError

__all__ = ["FAILED_FILE", "atomic_write_bytes", "atomic_write_text", "dump_yaml", "read_yaml", "make_executable",
           "replace_marked_section"]

FAILED_FILE = "failed.txt"
"""Written into a sweep job's directory when the job fails, with the one-line reason."""

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


def read_yaml(path: str, error: type[Exception], what: str, fix: str) -> object:
    """The YAML document at ``path``; ``error`` naming the file, ``what`` it should be and the ``fix`` otherwise."""
    try:
        with open(path, encoding="utf-8") as handle:
            return yaml.load(handle, Loader=_LOADER)
    except OSError as exc:
        raise error(f"cannot read {what} {path!r}: {exc.strerror}; {fix}") from None
    except yaml.YAMLError as exc:
        raise error(f"{what} {path!r} is not valid YAML: {str(exc).splitlines()[0]}; {fix}") from None


def make_executable(path: str | os.PathLike) -> None:
    """Give a written script the execute bits the umask allows."""
    os.chmod(path, 0o777 & ~_umask())


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
