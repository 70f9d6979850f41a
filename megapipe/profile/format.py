"""The ``megapipe-profile/1`` file: one entry per pipeline unit, in model order.

```yaml
format: megapipe-profile/1
device: h100_80gb
layers:
  - {name: embedding, kind: embedding, fwd_ms: 0.3, bwd_ms: 0.5, wgrad_ms: 0.25, static_bytes: 4.0e9, act_bytes: 1.0e8}
```
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import yaml

from megapipe.errors import ProfileError
from megapipe.records import LayerCost, LayerKind

__all__ = ["FORMAT", "Profile"]

FORMAT = "megapipe-profile/1"
_NUMBERS = ("fwd_ms", "bwd_ms", "wgrad_ms", "static_bytes", "act_bytes")


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """Per-unit costs for one microbatch: embedding, each decoder layer, MTP layers, loss."""

    layers: tuple[LayerCost, ...]
    device: str = ""
    """The GPU (cluster config name or torch device name) the times are for."""
    meta: tuple[tuple[str, str], ...] = field(default=())
    """Provenance: source, torch / megatron-core versions, shapes, date."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "meta", tuple((str(k), str(v)) for k, v in dict(self.meta).items()))
        _validate(self.layers)

    @property
    def num_decoder_layers(self) -> int:
        return sum(1 for layer in self.layers if layer.kind == LayerKind.decoder)

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "device": self.device,
            "meta": dict(self.meta),
            "layers": [_layer_to_dict(layer) for layer in self.layers],
        }

    @classmethod
    def from_dict(cls, data: Mapping, *, source: str = "profile") -> "Profile":
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
        return cls(layers=layers, device=str(data.get("device") or ""), meta=tuple(meta.items()))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Profile":
        try:
            with open(path, encoding="utf-8") as handle:
                data = yaml.safe_load(handle)
        except OSError as exc:
            raise ProfileError(f"cannot read profile {os.fspath(path)!r}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ProfileError(f"profile {os.fspath(path)!r} is not valid YAML: {str(exc).splitlines()[0]}") from None
        return cls.from_dict(data, source=os.fspath(path))

    def dumps(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=200)

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a crash never leaves a half-written profile."""
        atomic_write_text(path, self.dumps())


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it into place."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _layer_to_dict(layer: LayerCost) -> dict:
    out = {"name": layer.name, "kind": layer.kind.value}
    out.update({key: float(getattr(layer, key)) for key in _NUMBERS})
    if layer.param_count:
        out["param_count"] = float(layer.param_count)
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
    return LayerCost(name=str(entry.get("name", f"{kind.value}.{index}")), kind=kind, **values)


def _validate(layers: tuple[LayerCost, ...]) -> None:
    if not layers:
        raise ProfileError("profile has no layers")
    for index, layer in enumerate(layers):
        for key in _NUMBERS:
            value = getattr(layer, key)
            if not math.isfinite(value) or value < 0:
                raise ProfileError(f"layers[{index}] ({layer.name}): {key}={value!r} must be finite and >= 0")
        if layer.wgrad_ms > layer.bwd_ms * (1 + 1e-9):
            raise ProfileError(
                f"layers[{index}] ({layer.name}): wgrad_ms={layer.wgrad_ms} exceeds bwd_ms={layer.bwd_ms}; "
                "wgrad_ms is the weight-gradient part of bwd_ms"
            )
    kinds = [layer.kind for layer in layers]
    if kinds.count(LayerKind.embedding) > 1 or kinds.count(LayerKind.loss) > 1:
        raise ProfileError("a profile holds at most one embedding and one loss entry")
    if LayerKind.embedding in kinds and kinds[0] != LayerKind.embedding:
        raise ProfileError("the embedding entry must come first")
    if LayerKind.loss in kinds and kinds[-1] != LayerKind.loss:
        raise ProfileError("the loss entry must come last")
