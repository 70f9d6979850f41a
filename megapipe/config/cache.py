"""Composed configs kept on disk between processes, so a command starts without Hydra's composition.

Composing the full config reads some thirty YAML files and merges them into the schemas: about a quarter of a
second, paid by every command before it starts its work. What Hydra composes from the defaults list depends only
on the inputs named below, so that is kept (pickled: the schema's types and flags come back with it) under a key
that hashes all of them:

* the overrides that choose or add configs (``model=llama3_8b``, ``+experiment=x``, ``~key``), the config name;
* every file under ``hydra_conf`` (its path and bytes) and the schema's source (``schema.py``);
* the versions of Python, Hydra, OmegaConf and megapipe, and the Hydra plugins installed.

The overrides that set a value (``output.dir=/tmp/x``, ``train.global_batch_size=512``) are then applied to it
by Hydra's own override code, as Hydra applies them after composing the defaults, and the ``hydra`` node's record
of the overrides, of the working directory and of the job's name is written as Hydra writes it: the result is the
config a fresh composition gives (tests/test_config.py compares them). Overrides of the ``hydra`` node other
than the job's name, and those adding a config search path, are never cached; an override the cached path cannot
apply is composed afresh, so Hydra's own error reaches the user.

The cache lives in ``$MEGAPIPE_CACHE_DIR`` (``off`` or an empty value turns it off), else
``$XDG_CACHE_HOME/megapipe`` or ``~/.cache/megapipe``, and keeps the newest :data:`KEEP` entries. An entry that
cannot be read or written is composed afresh: the cache can make a command faster, never different.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
from collections.abc import Callable, Sequence

from omegaconf import DictConfig, open_dict

__all__ = ["CACHE_DIR_ENV", "KEEP", "cache_dir", "composed"]

CACHE_DIR_ENV = "MEGAPIPE_CACHE_DIR"
KEEP = 512
"""Entries kept; older ones are removed when a new one is written."""
_FORMAT = b"megapipe-compose-1"
_SUFFIX = ".cfg.pickle"

_digests: dict[str, bytes] = {}
"""This process's hash of a config directory's files, the schema and the versions, by directory (they do not change
while it runs)."""


def cache_dir() -> str | None:
    """Where composed configs are kept, or None when the cache is off."""
    chosen = os.environ.get(CACHE_DIR_ENV)
    if chosen is not None:
        return None if chosen.strip() in ("", "off", "0", "false") else os.path.expanduser(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megapipe")


def composed(overrides: Sequence[str], *, config_name: str, return_hydra_config: bool, conf_dir: str,
             compose: Callable[[list[str], bool], DictConfig]) -> DictConfig:
    """The config ``compose(overrides, return_hydra_config)`` gives, with the defaults list's composition taken
    from the cache when it holds it."""
    overrides = list(overrides)
    directory = cache_dir()
    if directory is None:
        return compose(overrides, return_hydra_config)
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # Hydra's own parse error, from Hydra's composition
        return compose(overrides, return_hydra_config)
    if any(override.is_hydra_override() and override.key_or_group != "hydra.job.name" for override in parsed):
        return compose(overrides, return_hydra_config)
    values = [override for override in parsed if _sets_a_value(override, conf_dir)]
    choices = [override.input_line for override in parsed if override not in values]
    key = hashlib.sha256(_inputs_digest(conf_dir))
    key.update(repr((choices, config_name)).encode("utf-8"))
    path = os.path.join(directory, key.hexdigest() + _SUFFIX)
    cfg = _load(path)
    if cfg is None:
        cfg = compose(choices, True)
        _store(path, cfg, directory)
    try:
        return _finish(cfg, parsed, values, return_hydra_config)
    except Exception:  # a value Hydra refuses: its composition says why, in its words
        return compose(overrides, return_hydra_config)


def _sets_a_value(override, conf_dir: str) -> bool:
    """Whether Hydra applies ``override`` after composing the defaults (``key.path=value``, not a group choice)."""
    from hydra.core.override_parser.types import OverrideType

    key = override.key_or_group
    if override.type is not OverrideType.CHANGE or override.package is not None or override.is_sweep_override():
        return False
    if "/" in key or "@" in key:
        return False
    return "." in key or not os.path.isdir(os.path.join(conf_dir, key))


def _finish(cfg: DictConfig, parsed: list, values: list, return_hydra_config: bool) -> DictConfig:
    """Apply the value overrides and write the ``hydra`` node's records, as Hydra's composition does."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname
    from hydra.core.utils import setup_globals

    setup_globals()  # the resolvers (now, hydra) a composition registers
    ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    task = [override for override in parsed if not override.is_hydra_override()]
    hydra = cfg.hydra
    hydra.overrides.task = [override.input_line for override in task]
    hydra.overrides.hydra = [override.input_line for override in parsed if override.is_hydra_override()]
    hydra.runtime.cwd = os.getcwd()
    dirname = hydra.job.config.override_dirname
    hydra.job.override_dirname = get_overrides_dirname(overrides=task, kv_sep=dirname.kv_sep,
                                                       item_sep=dirname.item_sep, exclude_keys=dirname.exclude_keys)
    if not return_hydra_config:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


def _inputs_digest(conf_dir: str) -> bytes:
    found = _digests.get(conf_dir)
    if found is None:
        import hydra
        import omegaconf

        import megapipe

        digest = hashlib.sha256(_FORMAT)
        for part in (sys.version, hydra.__version__, omegaconf.__version__, megapipe.__version__):
            digest.update(part.encode("utf-8") + b"\0")
        for plugins in _plugin_dirs():  # a Hydra plugin installed or removed may add config sources
            digest.update(repr((plugins, sorted(os.listdir(plugins)))).encode("utf-8"))
        files = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "schema.py")]  # the schemas Hydra merges
        for root, dirs, names in os.walk(conf_dir):
            dirs[:] = sorted(name for name in dirs if name != "__pycache__")
            files.extend(os.path.join(root, name) for name in sorted(names))
        for path in files:
            with open(path, "rb") as handle:
                data = handle.read()
            digest.update(os.path.relpath(path, conf_dir).encode("utf-8") + b"\0")
            digest.update(hashlib.sha256(data).digest())
        found = _digests[conf_dir] = digest.digest()
    return found


def _plugin_dirs() -> list[str]:
    import importlib.util

    spec = importlib.util.find_spec("hydra_plugins")
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    return sorted(path for path in locations if os.path.isdir(path))


def _load(path: str) -> DictConfig | None:
    try:
        with open(path, "rb") as handle:
            cfg = pickle.load(handle)
    except Exception:  # absent, half-read by a race, or from an incompatible library: compose afresh
        return None
    return cfg if isinstance(cfg, DictConfig) else None


def _store(path: str, cfg: DictConfig, directory: str) -> None:
    from megapipe.files import atomic_write_bytes

    try:
        atomic_write_bytes(path, pickle.dumps(cfg, protocol=pickle.HIGHEST_PROTOCOL))
        entries = [name for name in os.listdir(directory) if name.endswith(_SUFFIX)]
        if len(entries) > KEEP:
            aged = sorted(entries, key=lambda name: os.stat(os.path.join(directory, name)).st_mtime_ns)
            for name in aged[:len(entries) - KEEP]:
                os.unlink(os.path.join(directory, name))
    except OSError:  # a read-only home or a full disk: the command goes on without the cache
        pass
