"""The config keys a command reads, each with its meaning, for ``megapipe COMMAND --help``.

The meanings come from the schema (:mod:`megapipe.config.schema`): a field made from a record is
documented by the docstring under the record's field (``record`` in the field's metadata), a setting
no record holds by its ``doc`` metadata, a hand-written schema field by the docstring under it. The
first sentence of each is the one-line meaning. A command names what it reads in its module's
``CONFIG_KEYS``: a group (``"train"``, every key under it) or one key (``"search.min_gain"``).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import os
import re
import textwrap
import typing
from collections.abc import Sequence

import yaml

from megapipe.config.build import conf_dir
from megapipe.config.schema import Config

__all__ = ["field_docs", "config_keys", "config_help"]

_SENTENCE_END = re.compile(r"\.\s+(?=[A-Z0-9(`])")
_MARKUP = re.compile(r"(?::\w+:)?`+([^`]+)`+")
"""Sphinx roles and literals (:mod:`x`, ``x``): the help shows x."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each annotated field of a class's source, whitespace folded."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # made by dataclasses.make_dataclass: no source of its own
        return {}
    body = ast.parse(source).body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _meaning(schema: type, item: dataclasses.Field, kind) -> str:
    """The first sentence of the field's doc."""
    doc = item.metadata.get("doc") or field_docs(item.metadata.get("record") or schema).get(item.name, "")
    if not doc and _is_schema(kind):
        doc = " ".join((kind.__doc__ or "").split())
    first = _SENTENCE_END.split(doc, maxsplit=1)[0].strip()
    return _MARKUP.sub(r"\1", first if first == doc or first.endswith(".") else first + ".")


def _is_schema(kind) -> bool:
    """A field holding a schema directly (not inside a list or an Optional): its keys are listed one by one."""
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


def _walk(schema: type, prefix: str):
    hints = typing.get_type_hints(schema)
    for item in dataclasses.fields(schema):
        key, kind = f"{prefix}{item.name}", hints[item.name]
        if _is_schema(kind):
            yield from _walk(kind, key + ".")
        else:
            yield key, _meaning(schema, item, kind)


def config_keys(reads: Sequence[str]) -> list[tuple[str, str]]:
    """(key, meaning) for every key ``reads`` names: a group stands for all its keys, in the schema's order."""
    every = dict(_walk(Config, ""))
    rows = []
    for entry in reads:
        found = [(key, meaning) for key, meaning in every.items() if key == entry or key.startswith(entry + ".")]
        if not found:
            raise KeyError(f"{entry!r} is no config key or group of {Config.__name__}")
        rows += found
    return rows


def _choices(group: str) -> str:
    """The group's options in hydra_conf (the default marked); empty for a group with one option or none."""
    directory = os.path.join(conf_dir(), group)
    if not os.path.isdir(directory):
        return ""
    names = sorted(name[:-5] for name in os.listdir(directory) if name.endswith(".yaml"))
    if len(names) < 2:
        return ""
    with open(os.path.join(conf_dir(), "config.yaml"), encoding="utf-8") as handle:
        defaults = {key: value for item in yaml.safe_load(handle)["defaults"] if isinstance(item, dict)
                    for key, value in item.items()}
    return ", ".join(f"{name} (default)" if name == defaults.get(group) else name for name in names)


def config_help(reads: Sequence[str], *, width: int = 120) -> str:
    """The help's key list, wrapped to ``width``: a config group's options (where it has several) on a line of
    their own, its keys indented under them."""
    choices = {group: _choices(group) for group in {key.split(".")[0] for key in reads}}
    rows = []
    for key, meaning in config_keys(reads):
        group = key.split(".")[0]
        rows.append(("  " + key if "." in key and choices.get(group) else key, group, meaning))
    column = min(max(len(label) for label, _, _ in rows) + 2, 46)
    lines, shown = [], set()
    for label, group, meaning in rows:
        if label.startswith(" ") and group not in shown:
            shown.add(group)
            lines.append(_wrapped(f"{group}=NAME", f"one of {choices[group]}", column, width))
        lines.append(_wrapped(label, meaning, column, width))
    return "\n".join(lines)


def _wrapped(key: str, meaning: str, column: int, width: int) -> str:
    head = key.ljust(column) if len(key) < column else key + "  "
    return textwrap.fill(meaning, width=max(width, column + 40), initial_indent=head,
                         subsequent_indent=" " * column, break_on_hyphens=False)
