"""Layouts for a training loop of your own: the batch, the parameters and optax's state.

The trainer (``shardlib.train``) derives all of these from a ``ParallelPlan``; a user who
writes the loop by hand (notebook 01, a model of their own) needs the same three answers
without the trainer:

* where the batch lives (``batch_sharding``: the activation rule of its logical names);
* what the parameters look like before anything is allocated (``abstract_params``);
* where the optimizer state lives (``optimizer_shardings``): each moment takes its
  parameter's layout and every other leaf (Adam's step count, a schedule's counter) is
  replicated over the *whole mesh*. ``tx.init`` run eagerly leaves those scalars on device
  0, and ``jit(..., out_shardings=...)`` then refuses the mixed state with JAX's
  "incompatible devices" error; ``init_optimizer`` runs ``tx.init`` inside ``jit`` with
  these shardings instead.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.core.errors import ShardingError
from shardlib.core.layout import mesh_axes, named_shardings, param_layout, shard_model
from shardlib.core.rules import Rules, resolve_spec
from shardlib.parallel.plan import rules_for_mesh, suggest_presets


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


def optimizer_shardings(
    tx: optax.GradientTransformation, params: Any, mesh: Mesh | None = None
) -> Any:
    """NamedShardings of ``tx.init(params)``: moments like their parameter, the rest replicated.

    ``params`` is a tree of arrays or ``ShapeDtypeStruct``s with NamedShardings (from
    ``abstract_params`` or ``build_model``); ``mesh`` defaults to theirs. A per-parameter
    leaf whose shape differs from its parameter's (a factored second moment) is replicated.
    """
    mesh = _mesh_of(params) if mesh is None else mesh
    replicated = NamedSharding(mesh, P())

    def like(leaf, param):
        if not hasattr(leaf, "shape"):  # optax.MaskedNode and other placeholders
            return leaf
        same = tuple(leaf.shape) == tuple(param.shape)
        sharding = getattr(param, "sharding", None)
        return sharding if same and isinstance(sharding, NamedSharding) else replicated

    return optax.tree_map_params(
        tx,
        like,
        jax.eval_shape(tx.init, params),
        params,
        transform_non_params=lambda leaf: replicated if hasattr(leaf, "shape") else leaf,
        is_leaf=lambda x: isinstance(x, optax.MaskedNode),
    )


def abstract_optimizer_state(
    tx: optax.GradientTransformation, params: Any, mesh: Mesh | None = None
) -> Any:
    """``tx.init(params)`` as ``ShapeDtypeStruct``s with their shardings (nothing allocated)."""
    shardings = optimizer_shardings(tx, params, mesh)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        jax.eval_shape(tx.init, params),
        shardings,
    )


def init_optimizer(tx: optax.GradientTransformation, params: Any, mesh: Mesh | None = None):
    """``tx.init(params)`` laid out by ``optimizer_shardings``: no scalar left on device 0."""
    shardings = optimizer_shardings(tx, params, mesh)
    return jax.jit(tx.init, out_shardings=shardings)(params)
