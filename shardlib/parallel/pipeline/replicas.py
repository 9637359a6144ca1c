"""One data-parallel gradient reduction per pipeline step: the per-replica view.

Why: inside a pipeline loop every micro-batch's weight gradient is a contraction over the
batch, and the batch is split over ``data`` (and ``fsdp``). GSPMD reduces a contraction over
a split dim where it is computed, so the gradient of weights replicated over ``data`` was
all-reduced on every loop trip: m + p - 1 (or m + 2(p-1)) reductions of a stage's gradients
per step instead of one (109 GiB of data-axis traffic per device per step at m = 4
on a 39B layout, where one ring reduction is ~18 GiB).

How, with no hand-written collective: inside the pipelined step the weights get an explicit
leading *replica* dim R = the product of the replica axes, split over those axes
(``broadcast_to`` + a sharding constraint: a local copy, no communication), and the
pipeline runs under ``vmap`` over [R, B/R, ...] (``spmd_axis_name`` = the replica axes).
Each device then only ever sees its own replica's weights and batch rows, so the gradient
w.r.t. its copy is a local partial sum that accumulates across micro-batches in the loop
carry. The transpose of the broadcast, a sum over R, runs once after the loop: an all-reduce
of the stage's gradients (reduce-scatter where the gradient layout is split: ZeRO, fsdp).

Which batch axes become replica axes (a leading run of the batch's axes, so that the
reshape [B] -> [R, B/R] keeps every device's rows in place):

* ``data`` whenever parameters are replicated over it (ZeRO 0-2);
* ``fsdp`` (and ``data`` under ZeRO-3) only with ``gather_weights="step"``: the broadcast
  then all-gathers each stage's weights once per step and keeps them for all micro-batches
  (memory for communication). The default ``"microbatch"`` keeps FSDP's per-micro-batch
  all-gather and its per-micro-batch gradient reduce-scatter into the sharded accumulator.

Inside the vmap the rules lose the replica axes (``use_layout`` with ``inner``): the vmap
puts them back on the replica dim of every constrained value.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.core.layout import active_layout, mesh_axes, use_layout
from shardlib.core.mesh import Axis
from shardlib.core.ops import batch_rows
from shardlib.core.rules import Rules, entry_without

GATHER_WEIGHTS = ("microbatch", "step")
REPLICA_AXIS = "pipeline_replicas"  # the vmap axis of the replica dim (batch means over it)
_CANDIDATES = (Axis.DATA, Axis.FSDP)  # axes whose replicas differ only in their batch rows


def drop_axes(spec: P, axes: tuple[str, ...]) -> P:
    """``spec`` with the mesh ``axes`` removed from every dim."""
    return P(*(entry_without(e, axes) for e in spec))


def without_axes(rules: Rules, axes: tuple[str, ...]) -> Rules:
    """``rules`` with ``axes`` removed from every entry (the layout of one replica)."""

    def strip(table):
        return {name: tuple(a for a in mesh if a not in axes) for name, mesh in table.items()}

    shared = tuple(a for a in rules.shared if a not in axes)
    return dataclasses.replace(
        rules, params=strip(rules.params), activations=strip(rules.activations), shared=shared
    )


@dataclass(frozen=True)
class Replicas:
    """The replica axes of the active layout and how values move to and from [R, ...]."""

    axes: tuple[str, ...]
    """Mesh axes of the replica dim, outer first (a leading run of the batch's axes)."""
    count: int
    """R: the product of their sizes."""
    mesh: Mesh
    outer: Rules
    """The active rules."""
    inner: Rules
    """The rules of one replica: ``outer`` without ``axes``."""

    @property
    def _entry(self):
        return self.axes[0] if len(self.axes) == 1 else self.axes

    def spec(self, spec: P) -> P:
        """[R, ...] layout of a value laid out as ``spec``: R over the replica axes."""
        return P(self._entry, *drop_axes(spec, self.axes))

    def inner_sharding(self, sharding: NamedSharding) -> NamedSharding:
        """What ``sharding`` becomes inside the vmap (the vmap adds the replica axes back)."""
        return NamedSharding(self.mesh, drop_axes(sharding.spec, self.axes))

    def broadcast(self, w: jax.Array, spec: P) -> jax.Array:  # [...] -> [R, ...]
        """Each replica's own copy of ``w`` (laid out as ``spec``): its gradient is per
        replica, and the transpose of this broadcast is the one reduction over R."""
        w_R = jnp.broadcast_to(w[None], (self.count, *w.shape))
        return jax.lax.with_sharding_constraint(w_R, NamedSharding(self.mesh, self.spec(spec)))

    def split_batch(self, x_B: jax.Array, spec: P) -> jax.Array:  # [B, ...] -> [R, B/R, ...]
        """Rows of replica r together (the batch dim is split over the replica axes first)."""
        x_R = x_B.reshape(self.count, x_B.shape[0] // self.count, *x_B.shape[1:])
        full = P(self._entry, *drop_axes(spec, self.axes))
        return jax.lax.with_sharding_constraint(x_R, NamedSharding(self.mesh, full))

    def merge_batch(self, x_R: jax.Array, spec: P) -> jax.Array:  # [R, B/R, ...] -> [B, ...]
        x_B = x_R.reshape(x_R.shape[0] * x_R.shape[1], *x_R.shape[2:])
        return jax.lax.with_sharding_constraint(x_B, NamedSharding(self.mesh, spec))

    def vmap(self, fn: Callable) -> Callable:
        """``fn`` run once per replica (under the inner rules), replicas stacked on dim 0.
        A batch mean or sum taken inside (``ops.batch_mean``, ``batch_sum``: an MoE router's
        statistics) is reduced over the replicas, so it is the whole batch's (replicas hold
        equal rows): every replica then carries the same statistics."""

        def whole(value, how):
            reduce = jax.lax.pmean if how == "mean" else jax.lax.psum
            return reduce(value, REPLICA_AXIS)

        def one(*args):
            with use_layout(self.mesh, self.inner), batch_rows(whole):
                return fn(*args)

        return jax.vmap(one, spmd_axis_name=self._entry, axis_name=REPLICA_AXIS)


def replicas(*, gather_weights: str = "microbatch") -> Replicas | None:
    """The active layout's replica axes (module docstring); None without a layout or R = 1."""
    active = active_layout()
    if active is None:
        return None
    mesh, rules = active
    sizes = mesh_axes(mesh)
    param_axes = {a for axes in rules.params.values() for a in axes}
    axes: list[str] = []
    for axis in rules.activations.get("batch", ()):
        if axis not in _CANDIDATES or (axis in param_axes and gather_weights != "step"):
            break
        axes.append(axis)
    count = math.prod(sizes[a] for a in axes)
    if count == 1:
        return None
    return Replicas(tuple(axes), count, mesh, rules, without_axes(rules, tuple(axes)))
