"""Views of the stacked ``[layers, ...]`` parameters and the batch that pipeline schedules use.

Both schedules (``pipeline.py``: GPipe and circular; ``pipeline/one_f_one_b.py``: (interleaved)
1F1B) view the same stack as ``[p, v, k, ...]`` (virtual stage r·p + s on device s),
copy it per data replica, and cut the batch into micro-batches the same way; keeping these
views in one place keeps the two schedules' layouts identical, which their parity tests and
the planner's memory terms assume. A batch is token rows or, for a model of one's own, a
tree of arrays with their logical names (``microbatched`` cuts every array alike).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from shardlib.core.errors import ShardingError
from shardlib.core.layout import active_layout, constrain, logical_names, mesh_axes
from shardlib.core.resolve import resolve_spec
from shardlib.parallel.pipeline.storage import LayerOrder


def stage_axes():
    """Mesh axes of the activation ``stage`` dim under the active layout (for vmap)."""
    active = active_layout()
    if active is None:
        return None
    axes = active[1].activations.get("stage", ())
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def constrain_param(w: jax.Array, names: tuple[str | None, ...] | None, what: str):
    """Pin a (reshaped) parameter to the layout its logical names give in the params rules."""
    active = active_layout()
    if active is None or names is None:
        return w
    mesh, rules = active
    spec = resolve_spec(what, tuple(w.shape), names, rules, mesh_axes(mesh), "params")
    return jax.lax.with_sharding_constraint(w, NamedSharding(mesh, spec))


def staged_names(names: tuple | None) -> tuple | None:
    """``("layers", *rest)`` -> ``("stage", None, None, *rest)`` for a [p, v, k, ...] view."""
    if names is None:
        return None
    if names[0] != "layers":
        raise ShardingError(f"stacked parameter {names} does not lead with 'layers'.")
    return ("stage", None, None, *names[1:])


def to_stages(w_L: jax.Array, names, p: int, v: int, stored: bool = False) -> jax.Array:
    """[L, ...] -> [p, v, k, ...]: virtual stage r·p + s (layers in order) on device s.

    ``stored``: the rows are in stage order already (``pipeline.storage``), so the view is a
    local reshape; from natural order they are put in stage order first, a regrouping over
    ``stage`` (an all-to-all)."""
    if not stored:
        w_L = LayerOrder(p, v).store_rows(w_L)
    w = w_L.reshape(p, v, w_L.shape[0] // (p * v), *w_L.shape[1:])
    return constrain_param(w, staged_names(names), "staged parameter")


def from_stages(w_pvk: jax.Array, names, stored: bool = False) -> jax.Array:
    """Inverse of ``to_stages``: [p, v, k, ...] -> [L, ...] in the stored layout."""
    p, v, k = w_pvk.shape[:3]
    w = w_pvk.reshape(p * v * k, *w_pvk.shape[3:])
    if not stored:
        w = LayerOrder(p, v).natural_rows(w)
    return constrain_param(w, names, "stacked parameter")


def variable_names(blocks_state) -> list:
    """The logical names of every leaf of an nnx State (None for an unannotated leaf)."""
    variables = jax.tree.leaves(blocks_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [logical_names(var) if isinstance(var, nnx.Variable) else None for var in variables]


def to_replicas(reps, blocks_state):
    """Every stacked leaf as [R, L, ...]: one copy per replica (``pipeline.replicas``)."""
    axes = mesh_axes(reps.mesh)
    leaves, treedef = jax.tree.flatten(blocks_state)
    out = []
    for w, names in zip(leaves, variable_names(blocks_state), strict=True):
        spec = resolve_spec("stacked parameter", w.shape, names, reps.outer, axes, "params")
        out.append(reps.broadcast(w, spec))
    return treedef.unflatten(out)


def from_replicas(g_R, blocks_state):
    """The inverse of ``to_replicas`` for gradients: each [R, L, ...] leaf averaged over the
    replicas (one reduction over the data axes) and pinned to its parameter's layout."""
    leaves, treedef = jax.tree.flatten(g_R)
    means = [
        constrain_param(jnp.mean(g, 0), n, "stacked gradient")
        for g, n in zip(leaves, variable_names(blocks_state), strict=True)
    ]
    return treedef.unflatten(means)


def stage_state(blocks_state, p: int, v: int, stored: bool = False):
    """Every stacked leaf of an nnx State as [p, v, k, ...] (metadata kept on the Variables)."""
    names = variable_names(blocks_state)
    leaves, treedef = jax.tree.flatten(blocks_state)
    staged = [to_stages(w, n, p, v, stored) for w, n in zip(leaves, names, strict=True)]
    return treedef.unflatten(staged)


def split_microbatches(x_B: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [m, B/m, ...] taking rows i, i+m, ... : each device keeps its own rows."""
    b = x_B.shape[0] // m
    return jnp.swapaxes(x_B.reshape(b, m, *x_B.shape[1:]), 0, 1)


def merge_microbatches(x_M: jax.Array) -> jax.Array:
    """Inverse of ``split_microbatches``."""
    m, b = x_M.shape[:2]
    return jnp.swapaxes(x_M, 0, 1).reshape(m * b, *x_M.shape[2:])


def stage_mask(p: int, ndim: int) -> jax.Array:
    """Stage ids [p, 1, ..., 1] that broadcast against a [p, ...] buffer of rank ``ndim``."""
    return jnp.arange(p).reshape(p, *([1] * (ndim - 1)))


TOKEN_NAMES = ("batch", None)  # a batch of token rows [b, seq + 1]


def is_names(x) -> bool:
    """A leaf of a tree of logical-name tuples (the batch's ``names``)."""
    return isinstance(x, tuple)


def batch_tree_names(batch, names):
    """The logical names of every array of ``batch``: ``names`` (a tree like the batch's,
    a user's model's ``Batches.names``), or ``TOKEN_NAMES`` for each (token rows)."""
    return jax.tree.map(lambda _: TOKEN_NAMES, batch) if names is None else names


def microbatched(batch, names, m: int):
    """Every array of ``batch`` as [m, b/m, ...] (``split_microbatches``) on its layout."""
    return jax.tree.map(
        lambda n, x: constrain(split_microbatches(x, m), (None, *n)),
        batch_tree_names(batch, names),
        batch,
        is_leaf=is_names,
    )
