"""Bind logical annotations to a mesh: parameter shardings and activation constraints.

``param_shardings`` reads the logical names that Flax NNX stores on each variable
(``nnx.with_partitioning``) and resolves them through the rules into validated
NamedShardings. ``constrain`` pins an activation's layout at a block boundary; it reads the
mesh and rules of the innermost ``use_layout`` block and is a no-op outside one, so model
code runs unchanged on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.core.resolve import resolve_spec
from shardlib.core.rules import Kind, Rules, entry_without, shared_dims

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "shardlib_layout", default=None
)


def mesh_axes(mesh: Mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))


@contextlib.contextmanager
def use_layout(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """Make ``mesh`` and ``rules`` the ones ``constrain`` uses; usable inside ``jit``.

    Constraints carry explicit NamedShardings, so no JAX-global mesh is needed (and
    ``jax.set_mesh`` cannot be entered while tracing).
    """
    rules.check_mesh(mesh_axes(mesh), where="use_layout")
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def suspend_layout() -> Iterator[None]:
    """``constrain`` is a no-op inside: for code in a ``shard_map`` body, where arrays are
    per-device blocks and a mesh-wide layout has no meaning."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_layout() -> tuple[Mesh, Rules] | None:
    return _ACTIVE.get()


def splits_alike(sizes: dict[str, int]) -> bool:
    """Whether the active layout splits these logical dims (name -> size) over the same mesh
    axes (True outside a layout). A model fuses products along dims that split alike (the
    query and K/V heads of one q/k/v projection) and keeps them apart where they do not:
    K/V heads fewer than the tensor degree stay whole (``Rules.replicate_indivisible``)
    while the query heads split, and one fused weight would have to be resharded."""
    active = _ACTIVE.get()
    if active is None:
        return True
    mesh, rules = active
    table = rules.for_sizes(sizes, mesh_axes(mesh)).activations
    return len({table.get(name, ()) for name in sizes}) == 1


def constrain(
    x: jax.Array,
    names: tuple[str | None, ...],
    *,
    what: str | None = None,
    beside: dict[str, int] | None = None,
):
    """Constrain ``x`` to the layout of its logical ``names``; a no-op outside use_layout.

    ``what`` names the tensor in errors; by default the call site names it (``activation
    [batch, seq, embed] at block.py:42 in Block.__call__``), so that a dim that does not
    divide points at the line that constrained it rather than at "activation".

    ``beside`` (``{name: size}``): ``x`` is the operand of a product whose output also has
    these dims; a *shared* mesh axis (``Rules.shared``: FSDP's) that the output keeps on
    one of them is dropped from ``x``'s dims. The LM head's input, ``beside={"vocab": V}``:
    under FSDP's vocab-parallel head its batch is then gathered over ``fsdp`` only, where
    XLA left to itself gathers every batch axis and slices the product afterwards.
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    if what is None:
        what = _call_site(names, sys._getframe(1))  # noqa: SLF001 - the caller's line
    spec = activation_spec(what, tuple(x.shape), names, rules, mesh_axes(mesh), beside)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def activation_spec(
    what: str,
    shape: tuple[int, ...],
    names: tuple[str | None, ...],
    rules: Rules,
    axes: dict[str, int],
    beside: dict[str, int] | None = None,
) -> P:
    """The validated PartitionSpec ``constrain`` pins (``beside`` as there)."""
    spec = resolve_spec(what, shape, names, rules, axes, "activations")
    if beside and rules.shared:
        full, sizes = (*names, *beside), (*shape, *beside.values())
        dims = shared_dims(rules, full, sizes, "activations", axes)
        moved = {a for d, e in dims.items() if d >= len(names) for a in e if a in rules.shared}
        spec = P(*(entry_without(entry, moved) for entry in spec))
    return spec


def _call_site(names: tuple[str | None, ...], frame) -> str:
    """``activation [batch, seq, embed] at block.py:42 in Block.__call__``."""
    code = frame.f_code
    where = getattr(code, "co_qualname", code.co_name)
    listed = ", ".join(str(n) for n in names)
    return f"activation [{listed}] at {Path(code.co_filename).name}:{frame.f_lineno} in {where}"


def logical_names(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical annotation Flax stored on a variable (its key moved across versions)."""
    meta = variable.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
        names = meta.get(key)
        if names is not None:
            return tuple(names)
    return None


def abstract_state(make_model) -> tuple[nnx.GraphDef, dict, dict]:
    """Shapes and logical names of a model's parameters, with nothing allocated.

    Eager sharding is switched off while tracing so that Flax does not try to place the
    annotated variables itself: shardlib resolves (and validates) the layout from the names.
    Returns ``(graphdef, shapes, names)`` where the last two are pure nested dicts.
    """
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(make_model)
    graphdef, state = nnx.split(model, nnx.Param)
    shapes = nnx.to_pure_dict(state)
    names: dict = {}
    for path, var in nnx.to_flat_state(state):
        node = names
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = logical_names(var)
    return graphdef, shapes, names


def path_str(path: tuple[Any, ...]) -> str:
    """``('blocks', 'attn', 'wq')`` -> ``blocks.attn.wq`` (key paths from jax.tree_util too)."""
    parts = []
    for key in path:
        key = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
        parts.append(str(key))
    return ".".join(parts)


def names_at(names: dict, key_path) -> tuple[str | None, ...] | None:
    """The logical names stored for one leaf of a parallel tree (``tree_flatten_with_path``)."""
    for key in key_path:
        names = names[key.key]
    return names


def resolve_specs(
    shapes: dict,
    names: dict,
    mesh: Mesh,
    rules: Rules,
    kind: Kind = "params",
    prefix: str = "params",
) -> dict:
    """Validated PartitionSpecs for a tree of shapes annotated with a parallel tree of names."""
    axes = mesh_axes(mesh)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    specs = []
    for key_path, leaf in flat:
        where = f"{prefix}.{path_str(key_path)}"
        node = names_at(names, key_path)
        specs.append(resolve_spec(where, tuple(leaf.shape), node, rules, axes, kind))
    return jax.tree_util.tree_unflatten(treedef, specs)


def named_shardings(specs: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def param_layout(make_model, mesh: Mesh, rules: Rules) -> tuple[nnx.GraphDef, dict, dict]:
    """``(graphdef, shapes, specs)`` of a model's parameters on ``mesh``, validated.

    ``make_model`` builds the module (e.g. ``lambda: MyModel(rngs=nnx.Rngs(0))``); it is only
    traced, so this works for models far larger than any device.
    """
    graphdef, shapes, names = abstract_state(make_model)
    return graphdef, shapes, resolve_specs(shapes, names, mesh, rules, "params")


def shard_model(make_model, mesh: Mesh, rules: Rules) -> nnx.Module:
    """Build the model with every parameter created directly in its shards."""
    graphdef, _, specs = param_layout(make_model, mesh, rules)

    def init():
        with nnx.use_eager_sharding(False):
            return nnx.to_pure_dict(nnx.state(make_model(), nnx.Param))

    params = jax.jit(init, out_shardings=named_shardings(specs, mesh))()
    return nnx.merge(graphdef, params)
