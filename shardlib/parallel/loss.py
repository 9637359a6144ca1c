"""Chunked loss: the output projection and cross-entropy over slices of the sequence.

The LM head turns the residual stream [batch, seq, embed] into fp32 logits [batch, seq,
vocab]. With a large vocabulary those logits, their softmax and their gradient are the
largest buffers of a step (vocab 128K, 8K tokens per device: 4 GiB each in fp32), though
each token's loss needs only its own row. ``loss.chunk`` computes the head and the
cross-entropy one slice of the sequence at a time in a ``jax.lax.scan`` whose body is under
``jax.checkpoint``: the forward keeps each slice's loss only, and the backward recomputes a
slice's logits from the hidden states it already holds (one extra head matmul per step), so
at most one slice's logits [batch, chunk, vocab] are live in the forward or the backward.
Liger-Kernel's fused linear cross-entropy cuts the tokens into chunks the same way.

The slices are strided (slice i holds positions i, i + n, i + 2n, ... for n slices):
reshaping [seq] to [chunk, n] keeps a sequence split (context parallelism) on the outer
dim, so each device computes its own share of every slice and nothing moves. Vocabulary
stays whole in each slice, so the head's vocab-parallel layouts (tensor, FSDP's
vocab-parallel head) are those of the unchunked loss. The model is not touched: the library
calls the model's own ``head`` on each slice. Data-parallel replicas each run their slices
on their own copy of the head's weights, so the head's gradient is summed over them once,
after the slices, not once per slice (``chunked_cross_entropy``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.core.errors import ShardingError
from shardlib.core.layout import active_layout, mesh_axes, use_layout


@dataclass(frozen=True)
class LossChunks:
    """``[parallel.loss]``: the LM head and cross-entropy computed in slices of the sequence
    (the module docstring), so the fp32 logits are never whole."""

    axes: ClassVar[dict[str, str]] = {}  # no mesh axis of its own
    logical_names: ClassVar[dict[str, str]] = {}

    chunk: int = 0
    """Sequence positions per slice (each slice: every sequence's ``chunk`` positions); must
    divide the sequence length. 0: the logits are computed whole (no extra matmul)."""

    def __post_init__(self) -> None:
        if self.chunk < 0:
            raise ShardingError(
                f"parallel.loss.chunk={self.chunk} must be >= 0. Fix: loss_chunk=0 (off) or "
                "a divisor of the sequence length (e.g. loss_chunk=256)."
            )

    def rules(self, mesh_axes) -> list:
        return []

    def check(self, mesh_axes, rules, workload) -> None:
        """The slice divides the sequence, and its positions divide over the mesh axes that
        split the sequence (context parallelism), so every device holds a share of it."""
        if not self.chunk:
            return
        seq = workload.seq
        if seq % self.chunk:
            divisors = [d for d in (32, 64, 128, 256, 512, 1024, 2048) if seq % d == 0 and d < seq]
            fix = f"loss_chunk={divisors[-1]}" if divisors else "loss_chunk=0"
            raise ShardingError(
                f"parallel.loss.chunk={self.chunk} does not divide the sequence length {seq}. "
                f"Fix: a divisor of {seq} ({fix}), or loss_chunk=0."
            )
        seq_axes = [a for a in rules.activations.get("seq", ()) if mesh_axes.get(a, 1) > 1]
        ways = math.prod(mesh_axes[a] for a in seq_axes)
        if self.chunk % ways:
            raise ShardingError(
                f"parallel.loss.chunk={self.chunk}: a slice's positions do not divide over "
                f"the {ways} devices of mesh axes {seq_axes} that split the sequence. Fix: "
                f"loss_chunk={ways * max(1, self.chunk // ways)}, or loss_chunk=0."
            )


def chunked_cross_entropy(
    head: Callable[[Any, jax.Array], jax.Array],
    params: Any,
    x_BLD: jax.Array,  # [batch, seq, embed]
    targets_BL: jax.Array,  # [batch, seq]
    weights_BL: jax.Array | None,  # [batch, seq]
    *,
    chunk: int,
) -> jax.Array:
    """Mean (weighted where ``weights_BL`` is given) next-token cross-entropy over all
    positions, equal to ``optax.softmax_cross_entropy_with_integer_labels(head(params,
    x_BLD), targets_BL)`` averaged (times the weights), with at most one slice's logits live.

    ``head(params, x [batch, chunk, embed]) -> fp32 logits [batch, chunk, vocab]``: the
    model's own head (final norm and output projection) with the weights it reads from
    ``params``, called once per slice and again per slice in the backward.

    Under a layout whose batch axes hold replicas of the weights (``replica_axes``: data
    parallelism), each replica group runs its slices with its own copy of ``params`` (a
    ``vmap`` over the groups, split over those axes): the weights' gradients then add up
    inside each group over the slices and are summed over the groups once, after the loop.
    With the weights shared by the groups, XLA would reduce the head's gradient over the
    replicas once per slice instead (data 8, 8 slices: 127 MiB of all-reduces, not 29).
    Where FSDP splits the batch too the weights stay shared (``replica_axes``)."""
    b, length, _ = x_BLD.shape
    if length % chunk:
        raise ShardingError(
            f"chunked loss: chunk {chunk} does not divide the sequence length {length}. "
            "Fix: a divisor of the sequence length as parallel.loss.chunk."
        )
    axes, groups = replica_axes(b)
    if groups == 1:
        return _summed(head, params, x_BLD, targets_BL, weights_BL, chunk) / (b * length)
    mesh, rules = active_layout()

    def grouped(a):  # [G, ...] split over the replica axes, the rest as propagation says
        spec = P(axes, *(P.UNCONSTRAINED,) * (a.ndim - 1))
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))

    def by_group(a):  # [batch, ...] -> [G, batch / G, ...]: rows stay where they are
        return grouped(a.reshape(groups, b // groups, *a.shape[1:]))

    copies = jax.tree.map(lambda p: grouped(jnp.broadcast_to(p, (groups, *p.shape))), params)
    inner = rules.replace(
        activations={"batch": tuple(a for a in rules.activations["batch"] if a not in axes)}
    )
    run = jax.vmap(
        functools.partial(_summed, head, chunk=chunk), spmd_axis_name=axes
    )  # one group's sum of its rows' losses, per group
    with use_layout(mesh, inner):  # inside a group the batch is split by the other axes
        weights = None if weights_BL is None else by_group(weights_BL)
        totals_G = run(copies, by_group(x_BLD), by_group(targets_BL), weights)  # [G]
    return jnp.sum(totals_G) / (b * length)


def replica_axes(batch: int) -> tuple[tuple[str, ...], int]:
    """(mesh axes, devices): the axes that split the batch in the active layout when none
    of them splits a parameter (data parallelism's replicas, beside tensor or context
    parallelism, not FSDP or ZeRO-3) and the batch divides over them; ((), 1) otherwise
    or where no layout is active."""
    active = active_layout()
    if active is None:
        return (), 1
    mesh, rules = active
    sizes = mesh_axes(mesh)
    split = {a for entry in rules.params.values() for a in entry} | set(rules.shared)
    axes: list[str] = []
    for axis in rules.activations.get("batch", ()):
        if axis in split and sizes.get(axis, 1) > 1:
            # FSDP or ZeRO-3 beside the replicas: the groups' copies of an FSDP-split
            # (vocab-parallel) head are resharded inside the loop (all-to-alls of the whole
            # head per slice, data 2 x fsdp 2 x tensor 2): the weights stay shared
            return (), 1
        axes.append(axis)
    groups = math.prod(sizes.get(a, 1) for a in axes)
    if groups == 1 or batch % groups:
        return (), 1
    return tuple(axes), groups


def _summed(head, params, x_BLD, targets_BL, weights_BL, chunk: int) -> jax.Array:
    """The sum of the (weighted) losses of every position, slice by slice."""
    b, length, _ = x_BLD.shape
    n = length // chunk

    def slices(a):  # [batch, seq, ...] -> [n, batch, chunk, ...]: slice i is positions i::n
        return jnp.moveaxis(a.reshape(b, chunk, n, *a.shape[2:]), 2, 0)

    x_NBCD = slices(x_BLD)  # [n, batch, chunk, embed]
    targets_NBC = slices(targets_BL)  # [n, batch, chunk]
    weights_NBC = None if weights_BL is None else slices(weights_BL)  # [n, batch, chunk]

    @jax.checkpoint  # keep the slice's inputs only: its logits are recomputed in backward
    def slice_loss(params, x_BCD, targets_BC, weights_BC):
        logits_BCV = head(params, x_BCD)  # [batch, chunk, vocab] fp32
        ce_BC = optax.softmax_cross_entropy_with_integer_labels(logits_BCV, targets_BC)
        return jnp.sum(ce_BC if weights_BC is None else ce_BC * weights_BC)

    def body(total, xs):
        x_BCD, targets_BC, weights_BC = xs
        return total + slice_loss(params, x_BCD, targets_BC, weights_BC), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (x_NBCD, targets_NBC, weights_NBC))
    return total
