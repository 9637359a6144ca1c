"""ZeRO-Offload's update, streamed: the offloaded optimizer state visits the device one layer
at a time.

Moving the whole offloaded state to the device for ``tx.update`` (what XLA does when the
step writes ``device_put(opt_state, device)``) keeps it off the device only *between* steps:
during the update the device holds all of it again (measured on an H200, llama-1b: 28.4 GiB
without offload, 27.5 GiB with; docs/gpu.md). Here the update is a ``lax.fori_loop`` over
the stacked ``blocks`` dim instead. Trip ``i`` slices layer ``i`` of every stacked state
tensor out of host memory, moves that slice to the device, runs optax's own ``tx.update`` on
it (with the matching slices of the gradients and parameters), and writes the new slice back
into the host buffer (``dynamic_update_slice``, in place: the state is donated). The device
holds one layer's state at a time; the parameters that are not stacked (embedding, head,
norms) are updated in one more call, whole.

Slicing the optimizer's state is optax's business, not ours: ``optax.tree_map_params``
says which state leaves are shaped like which parameter, so any optax state tree works
(a chain, ``masked``, ``inject_hyperparams``). Each call sees a tree shaped like the
whole one: the leaves that are not its part are zero-size placeholders (dim 0 of length 0,
so a leaf keeps its rank and ``decay_mask`` decides alike), which cost nothing and whose
results are dropped. Non-parameter leaves (step counts, injected hyper-parameters) enter
every call unchanged and leave from the last one, so each call computes the same bias
correction and learning rate as the whole update would.

That is exact for optimizers whose update is elementwise given those scalars (Adam, AdamW,
SGD with momentum): ``ELEMENTWISE``. LAMB, LARS (a trust ratio per tensor) and Adafactor
(factored statistics) are not, and are refused with the fix. Gradient clipping by the
global norm scales each slice by the whole gradient's norm (``grad_norm``, offloaded rows
summed one at a time); the chain's own clip then sees slices whose norm is at most the
clipped global norm and leaves them alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from shardlib.core.errors import ShardingError

STACKED, REST, OTHER = "stacked", "rest", "other"
BLOCKS = "blocks"  # the params key of the stacked layers ([layers, ...] leaves)
ELEMENTWISE = ("adamw", "adam", "sgd")
"""Optimizers whose update of one element reads only that element and the shared scalars."""


def streams(plan) -> bool:
    """Whether the train step updates per layer: something is offloaded and ``per_layer``."""
    return plan.offload.per_layer and (plan.offload.optimizer or plan.offload.params)


def check(plan, optimizer) -> None:
    """Refuse a streamed update that would not equal the whole one, before compiling."""
    if not streams(plan):
        return
    problems = []
    if optimizer.name not in ELEMENTWISE or plan.data.onebit_momentum:
        problems.append(f"optimizer={optimizer.name} is not elementwise (a per-tensor trust "
                        "ratio, factored statistics or a momentum exchange)")  # fmt: skip
    if plan.pipeline_spec() is not None:  # (offload.params refuses a stage axis itself)
        problems.append("a stage axis splits the stacked layers' dim over devices")
    if problems:
        raise ShardingError(
            f"offload with offload.per_layer (the update streamed one layer at a time through "
            f"the device): {'; '.join(problems)}. Fix: offload_per_layer=false (the whole "
            f"state visits the device for the update), or optimizer={'/'.join(ELEMENTWISE)} "
            "without a stage axis."
        )


def state_kinds(tx: optax.GradientTransformation, opt_state, params) -> list[str]:
    """One of STACKED / REST / OTHER per leaf of ``opt_state`` (``jax.tree.leaves`` order):
    shaped like a stacked block parameter, like another parameter, or no parameter's."""
    labels = {k: jax.tree.map(lambda _, k=k: STACKED if k == BLOCKS else REST, v)
              for k, v in params.items()}  # fmt: skip
    kinds = optax.tree_map_params(
        tx,
        lambda leaf, label: label if hasattr(leaf, "shape") else leaf,
        opt_state,
        labels,
        transform_non_params=lambda _: OTHER,
        is_leaf=lambda x: isinstance(x, optax.MaskedNode),
    )
    return jax.tree.leaves(kinds)


def _empty(x):
    """A zero-size stand-in of ``x`` with its rank (dim 0 of length 0), on the device."""
    return jnp.zeros((0, *x.shape[1:]) if len(x.shape) else (0,), x.dtype)


def layer_row(x, i, sharding=None):
    """Row ``i`` of the stacked ``x`` ([1, ...], rank kept), in device memory (laid out as
    ``sharding``, the stacked tensor's, where given)."""
    row = jax.lax.dynamic_slice_in_dim(x, i, 1)
    if sharding is None:
        return jax.device_put(row, jax.memory.Space.Device)
    return jax.device_put(row, sharding.with_memory_kind("device"))


def _put_row(x, row, i):
    """``x`` with row ``i`` replaced, in ``x``'s memory (host for offloaded state)."""
    space = jax.typeof(x).memory_space
    return jax.lax.dynamic_update_slice_in_dim(x, jax.device_put(row, space), i, 0)


def _sum_squares(x, layers: int) -> jax.Array:
    """``sum(x**2)`` in fp32; a host-memory stacked ``x`` one row at a time on the device."""
    if jax.typeof(x).memory_space != jax.memory.Space.Host:
        return jnp.sum(jnp.square(x.astype(jnp.float32)))
    row_sum = lambda i, acc: acc + _sum_squares(layer_row(x, i), layers)  # noqa: E731
    return jax.lax.fori_loop(0, layers, row_sum, jnp.zeros((), jnp.float32))


def grad_norm(grads, layers: int) -> jax.Array:
    """The global norm of ``grads``, whose stacked leaves may be in host memory."""
    return jnp.sqrt(sum(_sum_squares(g, layers) for g in jax.tree.leaves(grads)))


def clipper(norm, clip_norm: float):
    """optax.clip_by_global_norm's scaling by an already known global ``norm`` (its own
    update would compute the norm of whatever slice it is given)."""
    if clip_norm <= 0:
        return lambda g: g
    return lambda g: jnp.where(norm < clip_norm, g, (g / norm.astype(g.dtype)) * clip_norm)


def _call(tx, treedef, state_leaves, g, p, keep=None):
    """optax's update + apply_updates on one part: (new params, new state leaves); where
    ``keep`` (a boolean scalar: fp16's finite gradients) is false, the old ones."""
    updates, new_state = tx.update(g, jax.tree.unflatten(treedef, state_leaves), p)
    new_p, new_leaves = optax.apply_updates(p, updates), jax.tree.leaves(new_state)
    if keep is None:
        return new_p, new_leaves
    pick = lambda new, old: jnp.where(keep, new, old)  # noqa: E731
    return jax.tree.map(pick, new_p, p), [
        pick(n, o) for n, o in zip(new_leaves, state_leaves, strict=True)
    ]


def _stand_ins(tree: dict, blocks=None) -> dict:
    """``tree`` with every part but ``blocks`` replaced by zero-size stand-ins."""
    out = {k: jax.tree.map(_empty, v) for k, v in tree.items() if k != BLOCKS}
    return {**out, BLOCKS: blocks}


def rest_update(tx, treedef, kinds, leaves, rest, scalars, grads, params, clip, keep=None):
    """The parameters that are not stacked, in one call: ``rest`` holds their state leaves
    (device arrays at the REST positions), ``scalars`` the OTHER ones. Returns the new
    parameters (``blocks`` a stand-in) and every new state leaf (OTHER ones from here)."""
    state = [_empty(x) if k == STACKED else s if k == OTHER else r
             for x, k, s, r in zip(leaves, kinds, scalars, rest, strict=True)]  # fmt: skip
    g = {k: (v if k == BLOCKS else jax.tree.map(clip, v)) for k, v in grads.items()}
    g[BLOCKS] = jax.tree.map(_empty, grads[BLOCKS])
    p = {**params, BLOCKS: jax.tree.map(_empty, params[BLOCKS])}
    return _call(tx, treedef, state, g, p, keep)


def layer_update(tx, treedef, kinds, leaves, layer_rows, scalars, grads, blocks, i, clip,
                 keep=None):  # fmt: skip
    """Layer ``i``: ``layer_rows`` holds its state rows ([1, ...], device, at the STACKED
    positions), ``grads`` is ``(the gradient tree, its blocks' row i)``; ``blocks`` the
    stacked weights, returned with row ``i`` updated in place, with the new state leaves."""
    grads, grads_row = grads
    state = [r if k == STACKED else s if k == OTHER else _empty(x)
             for x, k, s, r in zip(leaves, kinds, scalars, layer_rows, strict=True)]  # fmt: skip
    g = _stand_ins(grads, jax.tree.map(clip, grads_row))
    p = _stand_ins(_rest_shapes(grads), jax.tree.map(lambda x: layer_row(x, i), blocks))
    new_p, new_leaves = _call(tx, treedef, state, g, p, keep)
    blocks = jax.tree.map(lambda x, r: _put_row(x, r, i), blocks, new_p[BLOCKS])
    return blocks, new_leaves


def _rest_shapes(tree: dict) -> dict:
    return {k: v for k, v in tree.items() if k != BLOCKS}


def streamed_update(
    tx: optax.GradientTransformation,
    grads: dict,
    opt_state,
    params: dict,
    *,
    layers: int,
    state_shardings=None,
    clip_norm: float = 0.0,
    state_on_host: bool = True,
    keep=None,
    norm=None,
):
    """``(new_params, new_opt_state, grad_norm)``: what ``tx.update`` + ``optax.apply_updates``
    give, with the stacked state moved to the device one layer per loop trip (module
    docstring), and the gradient's global norm (``grad_norm``).

    ``grads`` and ``params`` are ``{"blocks": {... [layers, ...]}, ...}`` trees; the stacked
    ones may be in host memory (offloaded weights and their gradients): they stream alike;
    ``opt_state`` is optax's state, its leaves in host memory (``state_on_host``, ZeRO-Offload)
    or on the device (parameter offload alone: then the stacked weights stream);
    ``state_shardings`` (a tree like it) keeps each device slice in its state tensor's layout;
    ``keep`` (fp16: whether the gradients are finite) keeps the old values where false, on
    the device, row by row (a select between host and device buffers does not compile);
    ``norm``: ``grad_norm(grads, layers)`` where the caller has it already.
    """
    norm = grad_norm(grads, layers) if norm is None else norm
    clip = clipper(norm, clip_norm)
    leaves, treedef = jax.tree.flatten(opt_state)
    kinds = state_kinds(tx, opt_state, params)
    if len(kinds) != len(leaves):
        raise ShardingError(
            f"offload.per_layer: optax's state has {len(leaves)} leaves but "
            f"tree_map_params labelled {len(kinds)}. Fix: offload_per_layer=false."
        )
    shards = [None] * len(leaves) if state_shardings is None else jax.tree.leaves(
        state_shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding)
    )  # fmt: skip
    scalars = [jax.device_put(x, jax.memory.Space.Device) if k == OTHER else None
               for x, k in zip(leaves, kinds, strict=True)]  # fmt: skip
    space = jax.memory.Space.Host if state_on_host else jax.memory.Space.Device
    rows = [jax.device_put(x, space) if k == STACKED else None
            for x, k in zip(leaves, kinds, strict=True)]  # fmt: skip

    # the parameters that are not stacked: one call, their state whole on the device
    def on_device(x, sharding):  # in its own layout where known
        kind = jax.memory.Space.Device if sharding is None else sharding.with_memory_kind("device")
        return jax.device_put(x, kind)

    rest = [on_device(x, sh) if k == REST else None
            for x, k, sh in zip(leaves, kinds, shards, strict=True)]  # fmt: skip
    rest_params, rest_new = rest_update(tx, treedef, kinds, leaves, rest, scalars, grads,
                                        params, clip, keep)  # fmt: skip

    def trip(i, carry):
        blocks, state_rows = carry
        layer_rows = [layer_row(h, i, sh) if k == STACKED else None
                      for h, k, sh in zip(state_rows, kinds, shards, strict=True)]  # fmt: skip
        grads_row = jax.tree.map(lambda x: layer_row(x, i), grads[BLOCKS])
        blocks, new_leaves = layer_update(tx, treedef, kinds, leaves, layer_rows, scalars,
                                          (grads, grads_row), blocks, i, clip, keep)  # fmt: skip
        state_rows = [_put_row(h, r, i) if k == STACKED else h
                      for h, r, k in zip(state_rows, new_leaves, kinds, strict=True)]  # fmt: skip
        return blocks, state_rows

    blocks, state_rows = jax.lax.fori_loop(0, layers, trip, (params[BLOCKS], rows))
    new_leaves = [h if k == STACKED else r
                  for h, r, k in zip(state_rows, rest_new, kinds, strict=True)]  # fmt: skip
    new_params = {k: (blocks if k == BLOCKS else v) for k, v in rest_params.items()}
    return new_params, jax.tree.unflatten(treedef, new_leaves), norm
