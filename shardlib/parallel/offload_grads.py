"""ZeRO-Offload's gradient path: each layer's weight gradient leaves the device as the
backward pass produces it.

With the optimizer state offloaded (``offload.optimizer``), the update reads the
gradients one layer at a time (``offload_stream``), so nothing needs them on the device
after the backward pass: ZeRO-Offload moves each gradient to host memory as soon as it is
produced, overlapped with the rest of the backward. Here the layer loop's backward writes
layer ``i``'s gradient straight into a host-memory buffer, so the device holds one layer's
gradient at a time instead of all of them.

JAX gives a gradient the memory space of the value it differentiates, and a
``custom_vjp`` cannot change that (its backward rule must return the primal's type: a
rule that returns ``device_put(ct, Space.Host)`` for a device weight is refused with
"Custom VJP bwd rule must produce an output with the same type as the args tuple of the
primal function"). So the gradient is taken with respect to a *sink*: a host-memory tree
shaped like the stacked weights whose value nothing reads (XLA drops it). The weights
enter the loss with their gradient stopped; inside the layer loop ``tap(w, sink_row)``
returns ``w`` and sends the cotangent of ``w`` to ``sink_row``, a host value, so the
backward scan stacks the per-layer gradients in host memory. The gradient of the sink is
the weights' gradient, exactly (same operations, same order).

One micro-batch only: a sum of gradients across micro-batches would be computed in host
memory (``gradients.accumulate``), which XLA does not do. Pipelines, ZeRO++ and 1-bit Adam
take their own gradient paths and keep theirs on the device.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from shardlib.core.errors import ShardingError
from shardlib.parallel.offload import HOST_MEMORY

BLOCKS = "blocks"  # the params key of the stacked layers (as offload_stream's)


def plan_sends_grads_to_host(plan) -> bool:
    """Whether the step's block gradients go to host memory as the backward produces them:
    the optimizer state is offloaded and updated per layer, the weights stay on the device
    (offloaded weights' gradients are host memory already), on the plain gradient path."""
    offload, data = plan.offload, plan.data
    return (
        offload.optimizer
        and offload.grads
        and offload.per_layer
        and not offload.params
        and plan.pipeline_spec() is None
        and data.microbatches == 1
        and not data.zeropp
        and not data.onebit_momentum
    )


def step_sends_grads_to_host(plan, stacked_layers: int) -> bool:
    """``plan_sends_grads_to_host`` for a step whose blocks are stacked ``stacked_layers``
    deep: the one predicate the gradient function (which sends them) and the step (which
    then leaves them in host memory) both read. A user's model (0 stacked layers) has no
    layer loop to send them from, so its gradients stay on the device whatever the plan
    says."""
    return stacked_layers > 0 and plan_sends_grads_to_host(plan)


def pin_in_update_layout(plan, stacked_layers: int, grads: dict, update_shardings: dict) -> dict:
    """The gradients pinned to the optimizer update's layout, except the blocks' where the
    backward already wrote them to host memory (``step_sends_grads_to_host``): they stay
    there, and the streamed update reads them a layer at a time."""
    if not step_sends_grads_to_host(plan, stacked_layers):
        return jax.lax.with_sharding_constraint(grads, update_shardings)
    rest = [k for k in grads if k != BLOCKS]
    pinned = jax.lax.with_sharding_constraint(
        {k: grads[k] for k in rest}, {k: update_shardings[k] for k in rest}
    )
    return {**grads, **pinned}


@dataclass
class _Sink:
    rows: list  # the sink's leaves, [layers, ...] each, in params["blocks"] leaf order
    used: bool = False


_SINK: contextvars.ContextVar = contextvars.ContextVar("shardlib_grad_sink", default=None)


@jax.custom_vjp
def tap(w, sink):
    """``w``; its cotangent goes to ``sink`` (host memory), none to ``w``."""
    del sink
    return w


def _tap_fwd(w, sink):
    del sink
    return w, None


def _tap_bwd(_, ct):
    return None, jax.device_put(ct, jax.memory.Space.Host)


tap.defvjp(_tap_fwd, _tap_bwd)


def tapped_blocks(blocks_state):
    """``(blocks, sink)`` for the layer loop: ``sink`` the active sink's rows laid out like
    ``blocks_state`` (None outside ``value_and_grad`` below). Marks the sink as read."""
    sink = _SINK.get()
    if sink is None:
        return blocks_state, None
    leaves, treedef = jax.tree.flatten(blocks_state)
    shapes = [(x.shape, x.dtype) for x in leaves]
    if shapes != [(x.shape, x.dtype) for x in sink.rows]:
        raise ShardingError(
            f"offload.optimizer's gradient sink: the layer loop's stacked weights {shapes} "
            f"are not params['blocks'] {[(x.shape, x.dtype) for x in sink.rows]}. Fix: "
            "offload_per_layer=false (gradients stay on the device until the update)."
        )
    sink.used = True
    return blocks_state, jax.tree.unflatten(treedef, sink.rows)


def tap_layer(layer_state, sink_row, dtype):
    """One layer's weights through ``tap`` (their gradient to host), cast to ``dtype``."""
    return jax.tree.map(lambda w, s: tap(w, s).astype(dtype), layer_state, sink_row)


def value_and_grad(fn, host_shardings=None):
    """``jax.value_and_grad(fn, has_aux=True)`` whose ``grads['blocks']`` are in host
    memory, written one layer at a time by the backward layer loop (module docstring).
    ``host_shardings``: the blocks' gradient layout (a tree like ``params['blocks']``),
    given host memory here; None: the default device's."""

    def grad_fn(params, batch):
        blocks = params[BLOCKS]
        rest = {k: v for k, v in params.items() if k != BLOCKS}
        leaves, treedef = jax.tree.flatten(blocks)
        layouts = [None] * len(leaves) if host_shardings is None else jax.tree.leaves(
            host_shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding)
        )  # fmt: skip
        sink_leaves = [_host_zeros(x, sh) for x, sh in zip(leaves, layouts, strict=True)]
        stopped = jax.lax.stop_gradient(blocks)
        record = _Sink(sink_leaves)

        def with_sink(rest, sink_leaves):
            record.rows = sink_leaves
            token = _SINK.set(record)
            try:
                return fn({**rest, BLOCKS: stopped}, batch)
            finally:
                _SINK.reset(token)

        out, (g_rest, g_sink) = jax.value_and_grad(with_sink, (0, 1), has_aux=True)(
            rest, sink_leaves
        )
        if not record.used:
            raise ShardingError(
                "offload.optimizer sends the blocks' gradients to host memory from the layer "
                "loop, but this loss never ran it (a model without the decoder's stacked "
                "blocks). Fix: offload_per_layer=false."
            )
        return out, {**g_rest, BLOCKS: jax.tree.unflatten(treedef, g_sink)}

    return grad_fn


def _host_zeros(x, sharding):
    """A host-memory stand-in for ``x``'s gradient buffer; its value is never read."""
    if sharding is None:
        return jax.device_put(jnp.zeros(x.shape, x.dtype), jax.memory.Space.Host)
    return jax.device_put(jnp.zeros(x.shape, x.dtype), sharding.with_memory_kind(HOST_MEMORY))
