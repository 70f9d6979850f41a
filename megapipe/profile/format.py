"""The ``megapipe-profile/1`` document: a :class:`~megapipe.records.Profile` as plain data, and back.

```yaml
format: megapipe-profile/1
device: h100_80gb
layers:
  - {name: embedding, kind: embedding, fwd_ms: 0.3, bwd_ms: 0.5, wgrad_ms: 0.25, static_bytes: 4.0e9, act_bytes: 1.0e8}
```

Dicts in and out (:func:`profile_to_dict`, :func:`profile_from_dict`); :func:`load_profile` and
:func:`save_profile` read and write the file (atomically, :mod:`megapipe.files`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from megapipe.errors import ProfileError
from megapipe.files import atomic_write_text, dump_yaml, read_yaml
from megapipe.records import TIME_PARTS, LayerCost, LayerKind, Profile

__all__ = ["FORMAT", "profile_to_dict", "profile_from_dict", "load_profile", "save_profile"]

FORMAT = "megapipe-profile/1"
_NUMBERS = ("fwd_ms", "bwd_ms", "wgrad_ms", "static_bytes", "act_bytes")


def profile_to_dict(profile: Profile) -> dict:
    return {
        "format": FORMAT,
        "device": profile.device,
        "meta": dict(profile.meta),
        "layers": [_layer_to_dict(layer) for layer in profile.layers],
    }


def profile_from_dict(data: Mapping, *, source: str = "profile") -> Profile:
    if not isinstance(data, Mapping):
        raise ProfileError(f"{source}: not a mapping; expected a {FORMAT} document")
    if data.get("format") != FORMAT:
        raise ProfileError(f"{source}: format={data.get('format')!r} is not supported; expected {FORMAT!r}")
    raw_layers = data.get("layers")
    if not isinstance(raw_layers, Sequence) or not raw_layers:
        raise ProfileError(f"{source}: 'layers' must be a non-empty list")
    layers = tuple(_layer_from_dict(entry, source, index) for index, entry in enumerate(raw_layers))
    meta = data.get("meta") or {}
    if not isinstance(meta, Mapping):
        raise ProfileError(f"{source}: 'meta' must be a mapping")
    return Profile(layers=layers, device=str(data.get("device") or ""), meta=tuple(meta.items()))


def _layer_to_dict(layer: LayerCost) -> dict:
    out = {"name": layer.name, "kind": layer.kind.value}
    out.update({key: float(getattr(layer, key)) for key in _NUMBERS})
    if layer.param_count:
        out["param_count"] = float(layer.param_count)
    if layer.parts:
        out["parts"] = {name: float(value) for name, value in zip(TIME_PARTS, layer.parts)}
    return out


def _layer_from_dict(entry: object, source: str, index: int) -> LayerCost:
    if not isinstance(entry, Mapping):
        raise ProfileError(f"{source}: layers[{index}] is not a mapping")
    try:
        kind = LayerKind(entry.get("kind"))
    except ValueError:
        raise ProfileError(
            f"{source}: layers[{index}].kind={entry.get('kind')!r}; use one of embedding, decoder, loss, mtp"
        ) from None
    values = {}
    for key in _NUMBERS + ("param_count",):
        raw = entry.get(key, 0.0 if key == "param_count" else None)
        try:
            values[key] = float(raw)
        except (TypeError, ValueError):
            raise ProfileError(f"{source}: layers[{index}].{key}={raw!r} is not a number") from None
    return LayerCost(name=str(entry.get("name", f"{kind.value}.{index}")), kind=kind,
                     parts=_parts(entry.get("parts"), source, index), **values)


def _parts(raw: object, source: str, index: int) -> tuple[float, ...]:
    """The optional time breakdown (the cost model writes it; measured profiles have none)."""
    if raw is None:
        return ()
    if not isinstance(raw, Mapping) or set(raw) - set(TIME_PARTS):
        raise ProfileError(f"{source}: layers[{index}].parts must map some of {list(TIME_PARTS)} to ms")
    try:
        return tuple(float(raw.get(name, 0.0)) for name in TIME_PARTS)
    except (TypeError, ValueError):
        raise ProfileError(f"{source}: layers[{index}].parts holds a value that is not a number") from None


def load_profile(path: str | os.PathLike) -> Profile:
    """A ``megapipe-profile/1`` file; ProfileError naming the file otherwise."""
    path = os.fspath(path)
    data = read_yaml(path, ProfileError, "profile", "pass a file written by `megapipe profile` or `megapipe plan`")
    return profile_from_dict(data, source=path)


def save_profile(profile: Profile, path: str | os.PathLike) -> None:
    """Write ``profile`` atomically as ``megapipe-profile/1``."""
    atomic_write_text(path, dump_yaml(profile_to_dict(profile), flow=None, width=200))
