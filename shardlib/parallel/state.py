"""Layouts of the training state: the batch, the parameters, gradients and optax's state.

The trainer (``shardlib.train.setup``) and a loop written by hand (notebook 01, a model of
one's own) read the same functions:

* where the batch lives (``batch_sharding``: the activation rule of its logical names);
* what the parameters look like before anything is allocated (``abstract_params``);
* where the optimizer state lives: ``opt_state_specs``, the one rule for it. A moment shaped
  like its parameter takes the parameter's layout; a factored statistic (adafactor's
  ``v_row``/``v_col``) drops the dim it was reduced over, so its remaining dims keep their
  splits instead of being replicated; every other leaf (a step count, a schedule's counter)
  is replicated over the *whole mesh*. ``tx.init`` run eagerly leaves those scalars on
  device 0, and ``jit(..., out_shardings=...)`` then refuses the mixed state with JAX's
  "incompatible devices" error; ``init_optimizer`` runs ``tx.init`` inside ``jit`` with
  ``optimizer_shardings`` instead.

With ``offload`` the trainer's optimizer-state shardings carry ``memory_kind="pinned_host"``:
the state lives in host memory between steps and the step moves it to the device for the
update (``to_memory``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.core.errors import ShardingError
from shardlib.core.layout import (
    mesh_axes,
    named_shardings,
    names_at,
    param_layout,
    path_str,
    resolve_specs,
    shard_model,
)
from shardlib.core.resolve import resolve_spec
from shardlib.core.rules import Rules
from shardlib.parallel.mesh_rules import rules_for_mesh
from shardlib.parallel.plan import suggest_presets


def build_model(make_model, mesh: Mesh | None = None, rules: Rules | None = None) -> nnx.Module:
    """Build an annotated model: on one device (``mesh=None``) or sharded on ``mesh``.

    Flax 0.12 places a variable annotated with ``nnx.with_partitioning`` as soon as it is
    created, and outside a mesh that fails ("An auto mesh context or metadata is
    required"). Here the names stay metadata: with no mesh the model is built plainly on the
    default device (the one-device reference, whatever its annotations); with a mesh every
    parameter is created in its shards (``shard_model``), by ``rules`` or, if None, by the
    default plan of the mesh's axes (``rules_for_mesh``).
    """
    if mesh is None:
        return _build_on_one_device(make_model)
    rules = rules_for_mesh(mesh) if rules is None else rules
    with suggest_presets():
        return shard_model(make_model, mesh, rules)


def _build_on_one_device(make_model) -> nnx.Module:
    """``make_model()`` with the annotations as metadata only, in one compiled program.

    Built eagerly, every initializer would be its own small compiled op (seconds for a
    model of a few dozen tensors); under ``jit`` the whole initialisation is one program.
    """

    def init():
        with nnx.use_eager_sharding(False):
            return nnx.split(make_model())[1]

    with nnx.use_eager_sharding(False):
        graphdef = nnx.split(nnx.eval_shape(make_model))[0]
    return nnx.merge(graphdef, jax.jit(init)())


def batch_sharding(
    mesh: Mesh,
    rules: Rules,
    names: tuple[str | None, ...] = ("batch", None),
    *,
    shape: tuple[int, ...] | None = None,
) -> NamedSharding:
    """The NamedSharding of an input batch from the activation rules of its ``names``.

    ``("batch", None)`` fits token ids ``[batch, seq]``; images ``[batch, h, w, c]`` take
    ``("batch", None, None, None)``. With ``shape`` the layout is validated (the batch must
    divide by the mesh axes it is split over) and an error names the batch and a fix.
    """
    if shape is not None:
        with suggest_presets(batch=shape[0]):
            axes = mesh_axes(mesh)
            spec = resolve_spec("batch", tuple(shape), names, rules, axes, "activations")
    else:
        spec = rules.spec(names, "activations")
    return NamedSharding(mesh, spec)


def abstract_params(make_model, mesh: Mesh, rules: Rules) -> tuple[Any, dict]:
    """``(graphdef, params)``: ``jax.ShapeDtypeStruct`` leaves that carry their sharding.

    Nothing is allocated (the model is only traced), so ``explain`` and ``jit(...).lower``
    take these for a model of any size; ``jax.tree.map(lambda x: x.sharding, params)`` is
    the tree of shardings to pass to ``jit``.
    """
    with suggest_presets():
        graphdef, shapes, specs = param_layout(make_model, mesh, rules)
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        shapes,
        named_shardings(specs, mesh),
    )
    return graphdef, params


def _mesh_of(params: Any) -> Mesh:
    """The one mesh every parameter's NamedSharding is on."""
    meshes = {
        id(s.mesh): s.mesh
        for s in (getattr(x, "sharding", None) for x in jax.tree.leaves(params))
        if isinstance(s, NamedSharding)
    }
    if len(meshes) != 1:
        raise ShardingError(
            f"optimizer state: the parameters are on {len(meshes)} meshes (NamedShardings), "
            "so the mesh to replicate the optimizer's scalars over is unclear. Fix: pass "
            "mesh=..., and place every parameter with shardlib.abstract_params or "
            "shardlib.build_model on that mesh."
        )
    return next(iter(meshes.values()))


def grad_specs(param_shapes: dict, param_names: dict, mesh: Mesh, rules: Rules) -> dict:
    """Gradients are shaped like parameters: the same names through the given rules."""
    return resolve_specs(param_shapes, param_names, mesh, rules, "params", prefix="grads")


def _reduced_names(path: str, shape: tuple, names: tuple | None, leaf_shape: tuple):
    """Per-dim names of a state tensor of ``leaf_shape`` that belongs to a parameter.

    The same shape keeps the names; one dim fewer (a factored statistic) drops the dim whose
    removal gives ``leaf_shape`` (when several equal-sized dims qualify, the last one: any of
    them is a valid layout); the parameter's leading dims alone (a per-layer statistic, such
    as 1-bit LAMB's coefficients ``[layers]``) keep their names. Size-1 placeholders are
    replicated; anything else is an error.
    """
    if leaf_shape == shape:
        return names
    if len(leaf_shape) == len(shape) - 1:
        dropped = [d for d in range(len(shape)) if shape[:d] + shape[d + 1 :] == leaf_shape]
        if dropped:
            d = dropped[-1]
            return None if names is None else names[:d] + names[d + 1 :]
    if 0 < len(leaf_shape) < len(shape) and leaf_shape == shape[: len(leaf_shape)]:
        return None if names is None else names[: len(leaf_shape)]  # per layer: LAMB's ratios
    if math.prod(leaf_shape) <= 1:
        return None
    raise ShardingError(
        f"optimizer state of {path!r} has shape {leaf_shape}, which is neither the parameter's "
        f"shape {shape} nor that shape with one dim reduced: shardlib cannot tell its layout. "
        "Fix: use an optimizer whose state mirrors its parameters (see shardlib.train.optim)."
    )


def _own_layout(param) -> tuple | None:
    """A parameter's PartitionSpec entries, one per dim (None: no NamedSharding, replicated)."""
    sharding = getattr(param, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec)
    return spec + (None,) * (len(param.shape) - len(spec))


def opt_state_specs(
    tx: optax.GradientTransformation,
    abstract_opt_state,
    params,
    mesh: Mesh,
    rules: Rules | None = None,
    names=None,
):
    """A PartitionSpec for every leaf of ``tx.init(params)``: the one optimizer-state layout.

    Each state tensor is laid out like its parameter (``_reduced_names``: a factored
    statistic drops the reduced dim and keeps the others); counters and scalars are
    replicated. With ``rules`` and ``names`` (each parameter's logical names, a tree like
    ``params``) a state tensor's names go through ``rules``, as the trainer does with its
    optimizer-state rules (ZeRO may split what the parameter keeps whole). Without them each
    parameter's own PartitionSpec (``params`` carry NamedShardings) is what its dims keep.
    """
    if (rules is None) != (names is None):
        raise ShardingError(
            "opt_state_specs: rules and names go together (the names are read through the "
            "rules). Fix: pass both, or neither to keep each parameter's own layout."
        )
    axes = mesh_axes(mesh)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [path_str(p) for p, _ in flat]
    info = {}
    for (key_path, leaf), path in zip(flat, paths, strict=True):
        dims = _own_layout(leaf) if names is None else names_at(names, key_path)
        info[path] = (tuple(leaf.shape), None if dims is None else tuple(dims))

    def spec(leaf, path: str):
        if not hasattr(leaf, "shape"):  # optax.MaskedNode and other placeholders
            return leaf
        shape, dims = info[path]
        leaf_dims = _reduced_names(path, shape, dims, tuple(leaf.shape))
        if rules is None:  # the parameter's own entries, in the short form resolve_spec gives
            entries = list(leaf_dims or ())
            while entries and entries[-1] is None:
                entries.pop()
            return P(*entries)
        return resolve_spec(
            f"opt_state.{path}", tuple(leaf.shape), leaf_dims, rules, axes, "params"
        )

    return optax.tree_map_params(
        tx,
        spec,
        abstract_opt_state,
        jax.tree_util.tree_unflatten(treedef, paths),
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, optax.MaskedNode),  # LoRA: frozen weights' slots
    )


def optimizer_shardings(
    tx: optax.GradientTransformation,
    params: Any,
    mesh: Mesh | None = None,
    *,
    rules: Rules | None = None,
    names: Any = None,
) -> Any:
    """NamedShardings of ``tx.init(params)``, laid out by ``opt_state_specs``.

    ``params`` is a tree of arrays or ``ShapeDtypeStruct``s with NamedShardings (from
    ``abstract_params`` or ``build_model``); ``mesh`` defaults to theirs. A moment keeps its
    parameter's layout and a factored statistic the splits of the dims it keeps. With
    ``rules`` and the parameters' logical ``names`` (``shardlib.core.layout.abstract_state(
    make_model)[2]``) the state is resolved exactly as the trainer resolves it.
    """
    mesh = _mesh_of(params) if mesh is None else mesh
    specs = opt_state_specs(tx, jax.eval_shape(tx.init, params), params, mesh, rules, names)
    return shardings(specs, mesh)


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


def abstract_optimizer_state(
    tx: optax.GradientTransformation, params: Any, mesh: Mesh | None = None, **layout
) -> Any:
    """``tx.init(params)`` as ``ShapeDtypeStruct``s with their shardings (nothing allocated);
    ``layout``: ``rules`` and ``names`` as ``optimizer_shardings`` takes them."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        jax.eval_shape(tx.init, params),
        optimizer_shardings(tx, params, mesh, **layout),
    )


def init_optimizer(
    tx: optax.GradientTransformation, params: Any, mesh: Mesh | None = None, **layout
):
    """``tx.init(params)`` laid out by ``optimizer_shardings``: no scalar left on device 0."""
    out_shardings = optimizer_shardings(tx, params, mesh, **layout)
    return jax.jit(tx.init, out_shardings=out_shardings)(params)
