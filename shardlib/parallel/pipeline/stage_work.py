"""What one 1F1B stage computes and hands on per loop trip, at Megatron-LM's volume.

Megatron-LM's PTD-P (Narayanan et al., SC21) moves, per micro-batch and stage boundary, one
activation forward and one gradient backward, each tensor-parallel GPU only its 1/t share
(section 4.1's scatter/gather), and runs each layer's forward twice under full recompute:
once in the forward pass, saving only the layer's input, once in the backward pass right
before the layer's backward. Its tensor axis therefore carries 6 all-reduces of b·s·h per
layer and micro-batch. The pieces here give the SPMD schedule the same program:

* ``handover``: a stage's output (or input cotangent) pinned to its stage layout with the
  ``tensor`` axis added on seq or embed where the residual stream is replicated over it.
  The roll that moves it to the next stage then sends 1/t of it; the next trip's pin to
  the replicated layout all-gathers it over ``tensor`` (NVLink in Megatron's setting);
* ``forward_saving_inputs``: a chunk's layers in a scan that also returns every layer's
  input [k, b, seq, embed]. The schedule keeps them (not just the chunk's input) until the
  backward. The lockstep schedule keeps a device's inputs about twice as long as
  Megatron's (2vp - 1 ring slots on every device against p micro-batches in flight: about 2·L·b·s·h
  per device against L·b·s·h). ``pipeline.split_saved_inputs`` keeps them split over
  ``tensor`` the same way, which buys that back and more (1/t of it) for one all-gather
  per layer in the backward (half an all-reduce); the planner turns it on where the plan
  does not fit without it. So that...
* ``backward_from_inputs``: ...each layer's backward re-runs its forward once, from its own
  saved input, in a reverse scan (``jax.vjp`` of the plain block: one layer's residuals
  live at a time). Re-running the whole chunk from its input first would add a forward
  per layer (8 all-reduces instead of 6, 5 units of FLOPs instead of 4).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.core.layout import activation_spec, active_layout, constrain, mesh_axes
from shardlib.core.mesh import Axis
from shardlib.core.ops import vjp_at_once
from shardlib.core.rules import entry_axes
from shardlib.core.scopes import ONE_TRIP_SCOPE
from shardlib.parallel.pipeline.gpipe import STATE_NAMES
from shardlib.parallel.pipeline.partition import masked

LAYER_NAMES = STATE_NAMES[1:]  # [b, seq, embed]: one stage's residual (under the stage vmap)
SPLIT_NAMES = ("seq", "embed")  # the dims a residual is split on over tensor, first first


def split_spec(shape: tuple[int, ...], names: tuple, what: str) -> NamedSharding | None:
    """The layout of ``names`` plus ``tensor`` on the first of seq, embed that it divides,
    where ``tensor`` is not used yet (a residual already split over it, as under sequence
    parallelism, stays as it is). None outside a layout."""
    active = active_layout()
    if active is None:
        return None
    mesh, rules = active
    sizes = mesh_axes(mesh)
    spec = list(activation_spec(what, shape, names, rules, sizes))
    spec += [None] * (len(shape) - len(spec))
    t = sizes.get(Axis.TENSOR, 1)
    used = {a for d in spec for a in entry_axes(d)}
    if t > 1 and Axis.TENSOR not in used:
        for dim in (names.index(n) for n in SPLIT_NAMES):
            axes = entry_axes(spec[dim])
            local = shape[dim] // math.prod(sizes[a] for a in axes)
            if local % t == 0:
                spec[dim] = (*axes, Axis.TENSOR.value)
                break
    return NamedSharding(mesh, P(*spec))


def split(x: jax.Array, names: tuple, what: str) -> jax.Array:
    """``x`` pinned to ``split_spec``; a no-op outside a layout."""
    sharding = split_spec(tuple(x.shape), names, what)
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def handover(x_PBLD: jax.Array, what: str) -> jax.Array:
    """A [p, b, seq, embed] stage output or cotangent in the layout it travels in."""
    return split(x_PBLD, STATE_NAMES, what)


def _slot_fn(block_fn, with_keep: bool):
    """One layer of a chunk: ``block_fn`` in the compute dtype of ``x`` (fp32 master weights
    in: their gradients come back fp32), an identity slot where ``keep`` is 0 (uneven)."""

    def slot(layer, x):
        w, keep = layer if with_keep else (layer, None)
        w = jax.tree.map(lambda a: a.astype(x.dtype), w)
        return block_fn(w, x) if keep is None else masked(block_fn)((w, keep), x)

    return slot


def _layer_scan(w_k, keep_k, k: int, chunk):
    """``(xs, read)``: what a chunk's layer scan runs over and how one trip of it gets its
    layer ``(weights, keep, i)``. One chunk (``chunk`` None): ``w_k`` [k, ...] is the scan's
    xs. A device holding two (Chimera's down and up stages): ``w_k`` is the pair of their
    [k, ...] trees and ``keep_k`` [2, k]; trip i reads layer i of chunk ``chunk`` (0 or 1,
    per device under the stage vmap) and nothing else, so no [k, ...] copy of the chunk a
    trip runs is made beside the two stacks (one per trip at the 39B layout: 9 GiB)."""
    if chunk is None:
        return (w_k, keep_k, jnp.arange(k)), lambda xs: xs

    def read(i):
        down, up = w_k
        at = lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False)  # noqa: E731
        layer = jax.tree.map(lambda a, b: jnp.where(chunk == 0, at(a), at(b)), down, up)
        keep = None if keep_k is None else keep_k[chunk, i]
        return layer, keep, i

    return jnp.arange(k), read


def _add_layer(acc, g, i, chunk):
    """``acc`` [k, ...] (one chunk) or [2, k, ...] (two, ``chunk`` picks) with ``g`` added
    to layer i, in place: no copy of the accumulator."""
    idx = (i,) if chunk is None else (chunk, i)
    start = (*idx, *(0,) * (acc.ndim - len(idx)))
    size = (*(1,) * len(idx), *acc.shape[len(idx) :])
    old = jax.lax.dynamic_slice(acc, start, size)
    return jax.lax.dynamic_update_slice(acc, old + g.astype(acc.dtype).reshape(size), start)


def forward_saving_inputs(block_fn, w_k, keep_k, x_BLD, ring_RK, r, split_saved=False, chunk=None):
    """``(y [b, seq, embed], ring [R, k, b, seq, embed])``: the chunk's k layers applied in
    order, the input each of them saw written into slot ``r`` of the ring as it is seen
    (split over ``tensor`` with ``split_saved``; no [k, ...] stack beside the ring).
    ``chunk``: which of two chunks ``w_k`` holds (``_layer_scan``)."""
    slot = _slot_fn(block_fn, keep_k is not None)
    xs, read = _layer_scan(w_k, keep_k, ring_RK.shape[1], chunk)

    def body(carry, xs_i):
        x, ring = carry
        layer, keep, i = read(xs_i)
        x = constrain(x, LAYER_NAMES)  # the hand-over's split must not leak into the loop
        saved = split(x, LAYER_NAMES, "saved input") if split_saved else x
        ring = jax.lax.dynamic_update_slice(ring, saved[None, None], (r, i, 0, 0, 0))
        y = slot(layer if keep is None else (layer, keep), x)
        return (constrain(y, LAYER_NAMES), ring), None

    carry = (constrain(x_BLD, LAYER_NAMES), ring_RK)
    (y, ring_RK), _ = jax.lax.scan(body, carry, xs)
    return constrain(y, LAYER_NAMES), ring_RK


def backward_from_inputs(block_fn, w_k, keep_k, ring_RK, r, dy_BLD, acc_k, chunk=None):
    """``(acc_k + g_w [k, ...], dx [b, seq, embed])``: the chunk's backward, each layer's
    forward re-run once from its input saved in slot ``r`` of the ring, right before its
    own backward (last layer first), each layer's weight gradient added to its slot of the
    accumulator ``acc_k`` as it is computed. Read and added a layer at a time: no [k, ...]
    copy of the slot, nor stack of this chunk's gradients, beside the ring and accumulator.
    ``chunk``: which of two chunks ``w_k`` holds and ``acc_k`` [2, k, ...] accumulates."""
    slot = _slot_fn(block_fn, keep_k is not None)
    xs, read = _layer_scan(w_k, keep_k, ring_RK.shape[1], chunk)

    def body(carry, xs_i):
        dy, acc = carry
        layer, keep, i = read(xs_i)
        x = jax.lax.dynamic_slice(ring_RK, (r, i, 0, 0, 0), (1, 1, *ring_RK.shape[2:]))[0, 0]
        x, dy = constrain(x, LAYER_NAMES), constrain(dy, LAYER_NAMES)
        with vjp_at_once():  # one layer's residuals, pulled at once
            _, pull = jax.vjp(lambda w, x: slot(w if keep is None else (w, keep), x), layer, x)
        g_w, dx = pull(dy)
        acc = jax.tree.map(lambda a, g: _add_layer(a, g, i, chunk), acc, g_w)
        return (constrain(dx, LAYER_NAMES), acc), None

    carry = (constrain(dy_BLD, LAYER_NAMES), acc_k)
    (dx, acc_k), _ = jax.lax.scan(body, carry, xs, reverse=True)
    return acc_k, constrain(dx, LAYER_NAMES)


def _unflatten(treedef, w, chunk):
    """The blocks' tree of one chunk's leaves, or the pair of trees of two chunks'."""
    if chunk is None:
        return treedef.unflatten(w)
    return tuple(treedef.unflatten(c) for c in w)


def device_work(block_fn, treedef, embed, head_loss, *, split_saved: bool, seed):
    """One device's four kinds of work in a fused forward/backward loop (1F1B, Chimera), to
    be ``vmap``-ed over the stages: ``(fwd, bwd, head, embed_grad)``.

    * ``fwd(w, keep, x, ring, r) -> (y, ring)``: the chunk's layers, inputs saved in slot r;
    * ``bwd(w, keep, ring, r, dy, acc) -> (acc, dx)``: their backward from the saved inputs;
    * ``head(rest, y, target) -> (loss, g_rest, dy)``: every stage runs the head on its own
      output (only the pipeline's last counts), so no stage sends its output to another
      for it and the cotangent stays put; the loss cotangent is ``seed`` (scale / m);
    * ``embed_grad(rest, dx, inputs) -> g_rest``: the embedding's pull-back.

    ``w`` and ``acc`` are the chunk's flat leaves (``treedef`` rebuilds the blocks' tree).
    With ``chunk`` (a device holding two, ``_layer_scan``) ``w`` is the pair of the two
    chunks' leaves and ``acc``'s leaves are [2, k, ...].
    """

    def fwd(w, kp, x, ring, r, chunk=None):
        w = _unflatten(treedef, w, chunk)
        return forward_saving_inputs(block_fn, w, kp, x, ring, r, split_saved, chunk)

    def bwd(w, kp, ring, r, dy, acc, chunk=None):
        w, acc = _unflatten(treedef, w, chunk), treedef.unflatten(acc)
        acc, dx = backward_from_inputs(block_fn, w, kp, ring, r, dy, acc, chunk)
        return jax.tree.leaves(acc), dx

    def head(r, y, target):
        def scaled_loss(r, h):
            loss = head_loss(r, h, target).astype(jnp.float32)
            return loss * seed, loss

        _, pull, loss = jax.vjp(scaled_loss, r, y, has_aux=True)
        g_r, dy = pull(jnp.ones((), jnp.float32))
        return loss, g_r, dy

    def embed_grad(r, dx, inputs):
        return jax.vjp(lambda r: embed(r, inputs), r)[1](dx)[0]

    return fwd, bwd, head, embed_grad


def one_trip(step, carry, t: int):
    """``step(t, carry)`` once, in a while loop XLA keeps (trip count hidden behind a barrier).

    XLA inlines a loop of one trip into its caller. The cool-down's buffers (its chunk's
    weights in compute layout, the zeroed stacks of residuals and weight gradients its
    layer scans fill) then live in the entry computation, where the CPU scheduler creates
    them before the steady loop and keeps them through it: +24 GiB per device on the 39B
    layout (tensor 8 x stage 2, fp32, m = 2), whose ramps are one trip. As a loop of its own
    they exist only while it runs. ``explain`` counts the loop once (``ONE_TRIP_SCOPE``).
    """
    with jax.named_scope(ONE_TRIP_SCOPE):
        t0 = jax.lax.optimization_barrier(jnp.int32(t))
        return jax.lax.fori_loop(t0, t0 + 1, step, carry)
