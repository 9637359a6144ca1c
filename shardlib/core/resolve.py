"""One tensor's validated ``PartitionSpec`` under the rules (``resolve_spec``).

Why a module of its own: ``rules.py`` holds the tables and how strategies compose them;
this is the check every tensor passes before anything is compiled, with the errors that
name the tensor, the dim, its size, the mesh axis and a fix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from jax.sharding import PartitionSpec as P

from shardlib.core.errors import ShardingError
from shardlib.core.rules import Kind, Rules, fmt_mesh, make_spec, shared_dims


def divides(shape, names, table: Mapping[str, tuple[str, ...]], mesh_axes: Mapping[str, int]):
    """Whether every named dim of ``shape`` divides by the mesh axes ``table`` gives it."""
    for name, size in zip(names, shape, strict=True):
        axes = table.get(name, ()) if name is not None else ()
        if size % math.prod(mesh_axes.get(a, 1) for a in axes):
            return False
    return True


@dataclass(frozen=True)
class Indivisible:
    """What a "dim does not divide" error carries, so that a layer that knows the mesh
    presets (``shardlib.parallel.plan.suggest_presets``) can name those that would fit."""

    shape: tuple[int, ...]
    names: tuple[str | None, ...]
    kind: Kind
    devices: int


def resolve_spec(
    path: str,
    shape: tuple[int, ...],
    names: tuple[str | None, ...] | None,
    rules: Rules,
    mesh_axes: Mapping[str, int],
    kind: Kind = "params",
) -> P:
    """The validated PartitionSpec of one tensor.

    ``names`` is the tensor's logical annotation (``None`` for an unannotated tensor, which
    is replicated on purpose). Raises ShardingError for an unknown logical name, a rank
    mismatch, a mesh axis used twice, a missing mesh axis, or a dim that does not divide.
    The last carries ``Indivisible`` (``error.indivisible``) for the presets suggestion.
    """
    if names is None:
        return P()
    names = tuple(names)
    if len(names) != len(shape):
        raise ShardingError(
            f"tensor {path!r} has shape {tuple(shape)} (rank {len(shape)}) but its logical "
            f"annotation {names} has {len(names)} names. Fix: give one logical name (or None) "
            "per dim."
        )
    table = rules.table(kind, names)
    for dim, name in enumerate(names):
        if name is not None and name not in table:
            raise ShardingError(
                f"tensor {path!r} dim {dim} is annotated {name!r}, which the {kind} rules do not "
                f"know (known: {', '.join(sorted(table))}). Fix: add the name to both tables: "
                f"rules.with_name({name!r}) (replicated; params=/activations= split it), on the "
                f"command line rules.{name}=AXIS,... (empty: replicated), in a mesh file "
                f"[rules] {name} = [...]; or correct the annotation."
            )
    if rules.replicate_indivisible:  # e.g. fewer K/V heads than the tensor degree
        sizes = {n: size for n, size in zip(names, shape, strict=True) if n is not None}
        rules = rules.for_sizes(sizes, mesh_axes)
        table = rules.table(kind, names)
    shared = shared_dims(rules, names, tuple(shape), kind, mesh_axes)
    used: dict[str, int] = {}
    parts = []
    for dim, (name, size) in enumerate(zip(names, shape, strict=True)):
        if name is None:
            parts.append(None)
            continue
        axes = shared.get(dim, table[name])
        for ax in axes:
            if ax not in mesh_axes:
                raise ShardingError(
                    f"tensor {path!r} dim {dim} ({name!r}, size {size}): the {kind} rule maps it "
                    f"to mesh axis {ax!r}, which the mesh ({fmt_mesh(mesh_axes)}) lacks. Fix: "
                    f"add {ax!r} to the mesh or remove it from the rule for {name!r}."
                )
            if ax in used:
                raise ShardingError(
                    f"tensor {path!r}: mesh axis {ax!r} is used by dim {used[ax]} "
                    f"({names[used[ax]]!r}) and again by dim {dim} ({name!r}) of {names}; a mesh "
                    f"axis can split only one dim. Fix: map {name!r} or {names[used[ax]]!r} to "
                    "another axis in the rules."
                )
            used[ax] = dim
        ways = math.prod(mesh_axes[a] for a in axes)
        if size % ways:
            over = " x ".join(f"{a}={mesh_axes[a]}" for a in axes)
            error = ShardingError(
                f"tensor {path!r} dim {dim} ({name!r}, size {size}) is split over mesh axis "
                f"{over} ({ways} ways), and {size} is not divisible by {ways}. Fix: change the "
                f"model so {name!r} is a multiple of {ways}, shrink that mesh axis, or map "
                f"{name!r} to () in the {kind} rules."
            )
            devices = math.prod(mesh_axes.values())
            error.indivisible = Indivisible(tuple(shape), names, kind, devices)
            raise error
        parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return make_spec(parts)
