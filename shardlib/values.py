"""Command-line and TOML words turned into typed values, with errors that name the fix."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from shardlib.errors import ShardingError

_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def convert_value(name: str, raw: Any, annotation: Any) -> Any:
    """``raw`` as the type ``annotation`` names (bool, int, float, str, or one of them | None).

    Strings are converted; values already of the right type pass (TOML gives typed values),
    and a bool is never taken for an int (``data = true`` in a mesh file is an error).
    """
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(typing) | {"Any": Any})  # noqa: S307 - our own hints
    origin = typing.get_origin(annotation)
    if origin in (types.UnionType, typing.Union):
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null", "")):
            return None
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if annotation not in (bool, int, float, str):
        return raw
    if isinstance(raw, str):
        try:
            if annotation is bool:
                return _BOOLS[raw.lower()]
            return annotation(raw)
        except (KeyError, ValueError):
            pass
    elif isinstance(raw, bool):
        if annotation is bool:
            return raw
    elif annotation is float and isinstance(raw, int | float):
        return float(raw)
    elif isinstance(raw, annotation):
        return raw
    example = {bool: "true", int: "4", float: "0.5", str: "text"}[annotation]
    raise ShardingError(
        f"setting {name}={raw!r}: expected {annotation.__name__}. Fix: e.g. {name}={example}."
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
