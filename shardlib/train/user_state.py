"""A user's model state besides its parameters: BatchNorm statistics, Dropout RNG streams,
counters (every ``nnx.Variable`` that is not an ``nnx.Param``), carried in the train state.

The train state gets one more entry, ``MODEL_STATE``: a pure dict like the parameters', of
everything else the model holds. The step merges it with the parameters, runs the user's
loss on the model in train mode, and reads it back after the forward pass, so whatever the
forward writes (``nnx.BatchNorm``'s running ``mean``/``var``, an ``nnx.Rngs`` stream's
``count``, a counter of the user's) is the next step's value. It is closed over by the
loss, not differentiated: neither gradients nor the optimizer ever see it. It is saved in
and restored from checkpoints with the rest of the state, so a resume continues it exactly.

* Layout: a variable with logical names (``nnx.Variable(x, out_sharding=(...))``) is laid out
  by the parameters' rules, as a parameter of those names would be; one without names
  (``nnx.BatchNorm``'s statistics: Flax gives them none) is replicated.
* RNG streams: ``nnx.Rngs``'s key (``RngKey``, a typed PRNG key) is stored as its raw key
  data (uint32, ``jax.random.key_data``) so that checkpoints and fingerprints see a plain
  array, and rewrapped for the forward pass. The key never changes; each call of a stream
  folds in its ``count`` (``RngCount``), which the state carries. So each step's dropout key
  is ``fold_in(key, count)``: a function of the seed and the step, and a resume after a kill
  draws the same masks (bitwise the same losses). The keys come from ``run.seed``: the
  factory's ``rngs`` is ``nnx.Rngs(params=key, default=fold_in(key, 1))``, so a stream it
  forks (``nnx.Dropout(rate, rngs=rngs)`` forks ``rngs.dropout``, i.e. ``default``) is seeded.
* Data parallel: the batch is split over devices but the loss is one program over the
  global batch (GSPMD), so ``nnx.BatchNorm``'s batch mean and variance are reductions over
  the global batch (XLA inserts the all-reduce): the statistics, the normalised activations
  and the running averages are those of one device on the whole batch, not a per-device
  ("local") BatchNorm. Dropout's mask is drawn for the global batch shape with one key;
  with JAX's partitionable threefry (the default) each device computes its own slice of the
  same bits, so the masks are one device's too.
* Micro-batches (``microbatches=m``): each micro-batch's forward starts from the step's state,
  and the state read back is the mean over micro-batches (integers rounded back). Running
  means are then exact; a running variance averages per-micro-batch variances (it misses
  the spread between micro-batch means). Micro-batch i draws from its own streams: i is
  folded into every RNG key (``fold_keys``; ``parallel.gradients.micro_batch_index``), so
  its dropout key is ``fold_in(fold_in(key, i), count)``; with m = 1 nothing is folded.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib.core.layout import logical_names, named_shardings, resolve_specs

MODEL_STATE = "model_state"  # the train state's entry (and the loss's metrics' entry)


def seeded_rngs(key: jax.Array) -> nnx.Rngs:
    """The factory's ``rngs``: ``params`` as before (same initial parameters), and a
    ``default`` stream that every other stream name (``dropout``, ...) falls back to."""
    return nnx.Rngs(params=key, default=jax.random.fold_in(key, 1))


def _is_key(var) -> bool:
    return isinstance(var, nnx.RngKey)


@dataclass(frozen=True)
class ModelState:
    """The shape of a model's non-parameter state (read from an abstract trace)."""

    shapes: dict
    """Pure dict of ``jax.ShapeDtypeStruct`` as the train state carries it (keys as data)."""
    names: dict
    """The same tree of logical-name tuples (None: replicated)."""
    keys: frozenset
    """Paths (tuples) of the RNG keys, stored as key data."""
    where: tuple[str, ...] = ()
    """``path (type)`` of every variable, for messages."""

    def __bool__(self) -> bool:
        return bool(self.where)

    def shardings(self, mesh, rules) -> dict:
        specs = resolve_specs(self.shapes, self.names, mesh, rules, "params", MODEL_STATE)
        return named_shardings(specs, mesh)


def read(model: nnx.Module) -> ModelState:
    """The non-parameter state of an (abstract) model: shapes, names, key paths."""
    shapes, names, keys, where = {}, {}, set(), []
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.Param))):
        value = var.get_value()
        if _is_key(var):
            keys.add(path)
            value = jax.eval_shape(jax.random.key_data, value)
        _put(shapes, path, jax.ShapeDtypeStruct(value.shape, value.dtype))
        _put(names, path, None if _is_key(var) else logical_names(var))
        where.append(f"{'.'.join(map(str, path))} ({type(var).__name__})")
    return ModelState(shapes, names, frozenset(keys), tuple(where))


def _put(tree: dict, path, leaf) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = leaf


def carried(model: nnx.Module, keys: frozenset) -> dict:
    """The model's non-parameter state as the train state carries it (keys as data)."""
    out: dict = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.Param))):
        value = var.get_value()
        _put(out, path, jax.random.key_data(value) if path in keys else value)
    return out


def as_model_state(tree: dict, keys: frozenset) -> dict:
    """The carried state ready for ``nnx.merge`` (key data wrapped back into keys)."""
    flat = []
    for path, leaf in _flat(tree):
        flat.append((path, jax.random.wrap_key_data(leaf) if path in keys else leaf))
    out: dict = {}
    for path, leaf in flat:
        _put(out, path, leaf)
    return out


def fold_keys(tree: dict, keys: frozenset, index) -> dict:
    """``as_model_state``'s tree with ``index`` folded into every RNG key: micro-batch
    ``index``'s own streams (its dropout masks differ from the other micro-batches')."""
    out: dict = {}
    for path, leaf in _flat(tree):
        _put(out, path, jax.random.fold_in(leaf, index) if path in keys else leaf)
    return out


def _flat(tree: dict, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, (*prefix, k))
        else:
            yield (*prefix, k), v


def settle(old: dict, new: dict, keys: frozenset) -> dict:
    """The next step's state from the forward pass's (a mean over micro-batches): each
    leaf in its own dtype (integers rounded), the RNG keys unchanged."""
    out: dict = {}
    new_flat = dict(_flat(new))
    for path, before in _flat(old):
        after = new_flat[path]
        if path in keys:
            after = before
        elif jnp.issubdtype(before.dtype, jnp.integer) and not jnp.issubdtype(
            after.dtype, jnp.integer
        ):
            after = jnp.round(after)
        _put(out, path, jnp.asarray(after).astype(before.dtype))
    return out


def user_inventory(factory) -> tuple:
    """``(Inventory, ModelState)`` of the model ``factory`` builds, abstractly: the
    parameters as ``core.inventory.inventory`` reads them (its graphdef is the whole model's, so
    ``nnx.merge(graphdef, params, model_state)`` rebuilds it), and everything else."""
    import math

    from shardlib.core.inventory import Inventory, ParamEntry
    from shardlib.core.layout import names_at, path_str
    from shardlib.core.model import checkpoint_names

    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: factory.make(seeded_rngs(jax.random.key(0))))
    graphdef, params, _ = nnx.split(model, nnx.Param, ...)
    shapes = nnx.to_pure_dict(params)
    names: dict = {}
    for path, var in nnx.to_flat_state(params):
        _put(names, path, logical_names(var))
    entries = tuple(
        ParamEntry(path_str(kp), tuple(leaf.shape), names_at(names, kp))
        for kp, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]
    )
    inv = Inventory(
        graphdef,
        shapes,
        names,
        sum(math.prod(p.shape) for p in entries),
        0,
        entries,
        checkpoint_names=checkpoint_names(model),
        model_type=type(model),
    )
    return inv, read(model)
