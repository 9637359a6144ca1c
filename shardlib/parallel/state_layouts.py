"""Layouts of the training state beyond the parameters: gradients and optimizer state.

Each optimizer-state tensor is laid out like the parameter it belongs to, resolved through
the optimizer-state rules (ZeRO may shard it where the parameter is replicated). The
parameter's logical names carry over: a moment shaped like its parameter takes the same
names; a factored statistic (adafactor's ``v_row``/``v_col``) drops the name of the dim it
was reduced over, so its remaining dims keep their splits instead of being replicated.

With ``offload`` the optimizer state's shardings carry ``memory_kind="pinned_host"``: it
lives in host memory between steps and the step moves it to the device for the update.
"""

from __future__ import annotations

import math

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.core.errors import ShardingError
from shardlib.core.layout import mesh_axes, path_str, resolve_specs
from shardlib.core.rules import Rules, resolve_spec

HOST_KINDS = ("pinned_host", "unpinned_host")


def grad_specs(param_shapes: dict, param_names: dict, mesh: Mesh, rules: Rules) -> dict:
    """Gradients are shaped like parameters: the same names through the given rules."""
    return resolve_specs(param_shapes, param_names, mesh, rules, "params", prefix="grads")


def _reduced_names(path: str, shape: tuple, names: tuple | None, leaf_shape: tuple):
    """Logical names of a state tensor of ``leaf_shape`` that belongs to a parameter.

    The same shape keeps the names; one dim fewer (a factored statistic) drops the dim whose
    removal gives ``leaf_shape`` (when several equal-sized dims qualify, the last one: any of
    them is a valid layout). Size-1 placeholders are replicated; anything else is an error.
    """
    if leaf_shape == shape:
        return names
    if len(leaf_shape) == len(shape) - 1:
        dropped = [d for d in range(len(shape)) if shape[:d] + shape[d + 1 :] == leaf_shape]
        if dropped:
            d = dropped[-1]
            return None if names is None else names[:d] + names[d + 1 :]
    if math.prod(leaf_shape) <= 1:
        return None
    raise ShardingError(
        f"optimizer state of {path!r} has shape {leaf_shape}, which is neither the parameter's "
        f"shape {shape} nor that shape with one dim reduced: shardlib cannot tell its layout. "
        "Fix: use an optimizer whose state mirrors its parameters (see shardlib.train.optim)."
    )


def opt_state_specs(
    tx: optax.GradientTransformation,
    abstract_opt_state,
    param_shapes: dict,
    param_names: dict,
    mesh: Mesh,
    rules: Rules,
):
    """A PartitionSpec for every optimizer-state leaf; counters and scalars are replicated."""
    axes = mesh_axes(mesh)
    flat, treedef = jax.tree_util.tree_flatten_with_path(param_shapes)
    paths = [path_str(p) for p, _ in flat]
    info = {}
    for (key_path, leaf), path in zip(flat, paths, strict=True):
        node = param_names
        for key in key_path:
            node = node[key.key]
        info[path] = (tuple(leaf.shape), None if node is None else tuple(node))

    def spec(leaf, path: str):
        if not hasattr(leaf, "shape"):  # optax.MaskedNode and other placeholders
            return leaf
        shape, names = info[path]
        leaf_names = _reduced_names(path, shape, names, tuple(leaf.shape))
        return resolve_spec(
            f"opt_state.{path}", tuple(leaf.shape), leaf_names, rules, axes, "params"
        )

    return optax.tree_map_params(
        tx,
        spec,
        abstract_opt_state,
        jax.tree_util.tree_unflatten(treedef, paths),
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, optax.MaskedNode),  # LoRA: frozen weights' slots
    )


def shardings(specs, mesh: Mesh, memory_kind: str | None = None):
    """NamedShardings of a spec tree, in ``memory_kind`` memory (None: the default)."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s, memory_kind=memory_kind),
        specs,
        is_leaf=lambda s: isinstance(s, P),
    )


def to_memory(tree, shardings_tree, memory_kind: str):
    """Move ``tree`` (inside jit) to ``memory_kind`` with the layouts of ``shardings_tree``."""
    return jax.tree.map(
        lambda x, s: jax.device_put(x, s.with_memory_kind(memory_kind)), tree, shardings_tree
    )
