"""Command-line and TOML words turned into typed values, with errors that name the fix."""

from __future__ import annotations

import builtins
import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from shardlib.core.errors import ShardingError

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def convert_value(name: str, raw: str | object, annotation: Any) -> Any:
    """A command-line string (or an already typed value) as ``annotation``'s type.

    Handles bool, int, float, str, Literal and ``X | None`` ("none"/"null" -> None); other
    annotations pass the value through. ``name`` only labels the error.
    """
    if isinstance(annotation, str):  # a postponed annotation: builtins and typing names only
        annotation = eval(annotation, {"__builtins__": builtins}, vars(typing))  # noqa: S307
    origin = typing.get_origin(annotation)
    if origin in (types.UnionType, typing.Union):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null")):
            return None
        if len(options) == 1:
            return convert_value(name, raw, options[0])
        return raw
    if origin is typing.Literal:
        allowed = typing.get_args(annotation)
        if raw not in allowed:
            raise ShardingError(
                f"{name}={raw!r} is not allowed. Fix: use one of {', '.join(map(str, allowed))}."
            )
        return raw
    if annotation not in (bool, int, float, str):
        return raw
    if not isinstance(raw, str):
        if annotation is float and isinstance(raw, int) and not isinstance(raw, bool):
            return float(raw)
        if isinstance(raw, annotation) and not (annotation is int and isinstance(raw, bool)):
            return raw
        raise ShardingError(
            f"{name}={raw!r} is a {type(raw).__name__}, expected {annotation.__name__}. "
            f"Fix: pass a {annotation.__name__}."
        )
    if annotation is bool:
        if raw.lower() in _TRUE + _FALSE:
            return raw.lower() in _TRUE
    else:
        try:
            return annotation(raw)
        except ValueError:
            pass
    example = {bool: "true", int: "4", float: "0.5"}[annotation]
    raise ShardingError(
        f"{name}={raw!r}: expected {annotation.__name__}. Fix: e.g. {name}={example}."
    )


def replace_path(obj, path: list[str], value: Any, *, where: str = "config"):
    """``obj`` (nested frozen dataclasses) with the field at ``path`` set to ``value``.

    Strings and TOML values are converted to the field's type; an unknown field is refused
    with the fields that exist.
    """
    name = path[0]
    names = [f.name for f in dataclasses.fields(obj)]
    if name not in names:
        raise ShardingError(
            f"{where}: {type(obj).__name__} has no setting {name!r}. Settings: {', '.join(names)}."
        )
    if len(path) > 1:
        inner = replace_path(getattr(obj, name), path[1:], value, where=where)
        return dataclasses.replace(obj, **{name: inner})
    if not dataclasses.is_dataclass(getattr(obj, name)):
        value = convert_value(name, value, typing.get_type_hints(type(obj))[name])
    return dataclasses.replace(obj, **{name: value})


def flatten_table(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A TOML table (nested or dotted keys) as ``{"dataset.batch": 64, ...}``."""
    out = {}
    for key, value in table.items():
        if isinstance(value, Mapping):
            out.update(flatten_table(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out
