"""The model's own logical names: what a model outside shardlib's vocabulary adds to the rules.

A ViT-style classifier names its dims ``patches`` and ``classes``; no strategy knows them,
so no rule can resolve its tensors until each is given mesh axes (``()``: replicated). The
plan carries them (``ParallelPlan.custom_names``) so that the command line
(``rules.NAME=AXIS,...``) and a mesh file (``[rules]``) can say it, as ``Rules.with_name``
does in Python. They are added after the strategies' rules, in both tables at once: a name
in one table only fails later, on the first tensor of the other kind.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from shardlib.core.errors import ShardingError
from shardlib.core.rules import Rules


def axes_of(name: str, value: Any) -> tuple[str, ...]:
    """Mesh axes of one ``rules.NAME`` setting: ``"tensor"``, ``"fsdp,tensor"``, a list or
    tuple of axes, or empty / ``none`` / ``()`` (replicated)."""
    if value is None:
        return ()
    if isinstance(value, str):
        text = value.strip().strip("()[]")
        if text.lower() in ("", "none"):
            return ()
        return tuple(a.strip().strip("'\"") for a in text.split(",") if a.strip())
    if isinstance(value, list | tuple) and all(isinstance(a, str) for a in value):
        return tuple(str(a) for a in value)
    raise ShardingError(
        f"rules.{name}={value!r}: expected mesh axes. Fix: rules.{name}=tensor, "
        f"rules.{name}=fsdp,tensor, or rules.{name}= (replicated); in a mesh file "
        f'[rules] {name} = ["tensor"].'
    )


def rules_table(table: Any, where: str) -> Mapping[str, Any]:
    """A mesh file's ``[rules]``, checked to be a table (``rules = "x"`` is not one)."""
    if not isinstance(table, Mapping):
        raise ShardingError(
            f"{where}: rules = {table!r} is not a table. Fix: [rules] NAME = [AXIS, ...]."
        )
    return table


def with_custom_names(rules: Rules, names: Iterable[tuple[str, tuple[str, ...]]]) -> Rules:
    """``rules`` knowing the model's own ``names``; a name shardlib or a strategy already
    lays out is refused (its layout is the strategy's setting, not a rule to override)."""
    for name, split in names:
        if name in rules.params or name in rules.activations:
            raise ShardingError(
                f"rules.{name}: {name!r} is one of shardlib's logical names, which the "
                f"strategies lay out (params -> {rules.params.get(name, ())}). Fix: rules.NAME "
                "is for the model's own names: set the strategy instead (a mesh axis, a "
                "[parallel.*] setting), or give the model's dim a name of its own."
            )
        rules = rules.with_name(name, params=split, activations=split)
    return rules
