"""Quoting for the two places emitted text is read: a POSIX shell and Hydra's override parser.

Hydra's grammar (``hydra.core.override_parser``, OverrideLexer.g4) takes a bare
word as a string, but ``|``, ``*`` and ``'`` need a quoted value; its keywords
``null``, ``true`` and ``false`` and numbers are typed. A shell then strips one
level of quotes, so a Hydra override that contains quotes is shell-quoted again.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable

__all__ = ["cli_number", "format_override", "format_value", "shell_join", "shell_quote"]

_SHELL_SAFE = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")
_HYDRA_BARE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_HYDRA_KEYWORDS = {"null", "true", "false", "nan", "inf"}


def format_value(value: object, *, quote: bool = False) -> str:
    """A Python value as Hydra reads it back: None -> null, bools lower-case, strings quoted when needed.

    ``quote=True`` quotes every string, as layouts should be: an unquoted layout
    written with Megatron's cosmetic commas would become a Hydra sweep.
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # Hydra types numbers; a quoted one would be a string
    if isinstance(value, (list, tuple)):  # Hydra's list syntax (moe_layer_freq)
        return "[" + ",".join(format_value(item, quote=quote) for item in value) + "]"
    text = str(value)
    if not quote and _HYDRA_BARE.fullmatch(text) and text.lower() not in _HYDRA_KEYWORDS:
        return text
    if "'" not in text and "\\" not in text:
        return f"'{text}'"
    if '"' not in text and "\\" not in text:
        return f'"{text}"'
    raise ValueError(f"cannot quote {text!r} for a Hydra override")


def cli_number(value: float) -> str:
    """A number as a Megatron-LM flag value: integral values without a decimal point, others as repr."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def format_override(key: str, value: object, *, quote: bool = False) -> str:
    """``key=value`` for Hydra; ``key`` may carry Hydra's ``+``/``++`` prefix."""
    return f"{key}={format_value(value, quote=quote)}"


def shell_quote(token: str) -> str:
    """Quote one argv token for a POSIX shell, keeping Hydra's inner single quotes readable."""
    if _SHELL_SAFE.fullmatch(token):
        return token
    if "'" not in token:
        return f"'{token}'"
    if not any(char in token for char in '"$`\\!'):
        return f'"{token}"'
    return shlex.quote(token)


def shell_join(tokens: Iterable[str]) -> str:
    """One shell line whose ``shlex.split`` gives back ``tokens``."""
    return " ".join(shell_quote(token) for token in tokens)
