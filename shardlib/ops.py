"""The operations model code calls whose form depends on the parallel layout, in one place.

A model names logical dims only; it cannot know whether its sequence is split over a
``context`` axis or its experts over an ``expert`` axis. So it calls the functions here and
the active settings (``use_ops``, entered by the trainer next to ``use_layout``) pick the
form: which attention kernel runs, how the embedding lookup reads a vocab-split table
(``lookup``), and whether the MoE exchange is left to XLA (``einsum``)
or written as an explicit all-to-all (``shard_map``). Outside ``use_ops`` attention is dense
and causal and the exchange only re-constrains the layout, so a model runs unchanged on one
device. ``scan_blocks`` and ``run_blocks`` are the layer loop every model shares.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib.attention import AttentionPlan, Packed, attend
from shardlib.errors import ShardingError
from shardlib.kernels import shard_map
from shardlib.layout import active_layout, constrain, mesh_axes
from shardlib.lookup import lookup
from shardlib.strategies.expert import DISPATCH_NAMES, DISPATCHES, EXPERT_NAMES, expert_axis

__all__ = [
    "DISPATCHES",
    "DISPATCH_NAMES",
    "EXPERT_NAMES",
    "OpsSettings",
    "Packed",
    "active_ops",
    "attention",
    "exchange",
    "lookup",
    "run_blocks",
    "scan_blocks",
    "use_ops",
]


@dataclass(frozen=True)
class OpsSettings:
    """The forms the ops take; one value is active at a time (``use_ops``)."""

    attention: AttentionPlan = field(default_factory=AttentionPlan)
    """Which attention kernel runs (dense / chunked / cuDNN, ring / Ulysses / all-gather)."""
    dispatch: str = "einsum"
    """MoE exchange: einsum (XLA derives the all-to-all) or shard_map (written explicitly)."""

    def __post_init__(self) -> None:
        if self.dispatch not in DISPATCHES:
            raise ShardingError(
                f"dispatch={self.dispatch!r} is unknown. Fix: use one of {', '.join(DISPATCHES)}."
            )


_DEFAULT = OpsSettings()  # dense causal attention, einsum exchange: one device's forms
_OPS: contextvars.ContextVar[OpsSettings | None] = contextvars.ContextVar(
    "shardlib_ops", default=None
)


@contextlib.contextmanager
def use_ops(
    *, attention: AttentionPlan | None = None, dispatch: str = "einsum"
) -> Iterator[OpsSettings]:
    """Make these forms the ones the ops follow; usable inside ``jit`` tracing.

    A context variable, not an argument threaded through the model: model code stays the
    same on one device and on a mesh, and nested blocks restore the outer settings.
    """
    settings = OpsSettings(attention=attention or AttentionPlan(), dispatch=dispatch)
    token = _OPS.set(settings)
    try:
        yield settings
    finally:
        _OPS.reset(token)


def active_ops() -> OpsSettings:
    return _OPS.get() or _DEFAULT


def attention(q_BLHK, k_BLGK, v_BLGK, positions_L=None, *, causal: bool = True):
    """Attention with grouped K/V heads, [B, L, H, K] -> [B, L, H, K], as the plan says.

    ``positions_L`` are the tokens' true positions (default 0..L-1): they drive the causal
    mask, so a reordered sequence (zig-zag context parallelism) attends correctly.
    """
    plan = active_ops().attention
    return attend(q_BLHK, k_BLGK, v_BLGK, positions_L, plan=plan, causal=causal)


def exchange(x_GECD: jax.Array, direction: Literal["dispatch", "combine"]) -> jax.Array:
    """Move the expert axis between the groups dim and the expert dim of an MoE buffer.

    ``dispatch``: [groups, experts, capacity, embed] split by groups -> split by experts;
    ``combine``: the reverse. Both forms move the same bytes; ``einsum`` only re-constrains
    the layout and lets XLA's propagation emit the all-to-all (GShard), ``shard_map`` writes
    ``jax.lax.all_to_all`` over the expert axis so the collective is exactly this one.
    """
    if direction not in ("dispatch", "combine"):
        raise ValueError(f"exchange direction {direction!r}: use 'dispatch' or 'combine'.")
    src, dst = (DISPATCH_NAMES, EXPERT_NAMES)
    if direction == "combine":
        src, dst = dst, src
    active = active_layout()
    if active_ops().dispatch == "einsum" or active is None:
        return constrain(x_GECD, dst)  # a no-op outside use_layout
    mesh, rules = active
    axis = expert_axis(rules, mesh_axes(mesh))
    if axis is None:  # no expert axis of size > 1: nothing to exchange
        return constrain(x_GECD, dst, what=f"moe {direction}")
    x_GECD = constrain(x_GECD, src, what=f"moe {direction} input")
    split, concat = (1, 0) if direction == "dispatch" else (0, 1)

    def all_to_all(x_local):
        return jax.lax.all_to_all(x_local, axis, split, concat, tiled=True)

    kernel = shard_map(all_to_all, mesh=mesh, in_specs=rules.spec(src), out_specs=rules.spec(dst))
    return constrain(kernel(x_GECD), dst, what=f"moe {direction} output")


BlockFn = Callable[[Any, Any], Any]
"""``block_fn(layer_state, carry) -> carry``: one block of the stack."""


def scan_blocks(block_fn: BlockFn, blocks_state, carry):
    """Apply stacked blocks with ``jax.lax.scan``: one compiled body, any depth.

    ``blocks_state`` holds every block's weights with a leading ``layers`` dim; the scan
    hands ``block_fn`` one layer's slice. Strategies that restructure the loop (remat,
    pipelining, offload) wrap ``block_fn`` or replace this function with the same signature.
    """

    def body(c, layer_state):
        return block_fn(layer_state, c), None

    carry, _ = jax.lax.scan(body, carry, blocks_state)
    return carry


def _first_layer(blocks_state):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), blocks_state)


def run_blocks(
    block_graph: nnx.GraphDef,
    blocks_state,
    x_BLD,
    positions_L=None,
    *,
    layers: Callable[[BlockFn, Any, Any], Any] = scan_blocks,
):
    """``(x_BLD, totals)``: the residual after every block, and the blocks' summed stats.

    A block is ``nnx.merge(block_graph, layer_state)(x_BLD, positions_L)`` and returns
    ``x_BLD`` or ``(x_BLD, stats)``; which one is read from its abstract output (nothing is
    computed twice). With stats the loop's carry is ``(x_BLD, totals)``, summed from zero;
    without, it is ``x_BLD`` and ``totals`` is None. ``layers`` runs the loop (``scan_blocks``
    or a strategy's replacement).
    """

    def block(layer_state, x):
        return nnx.merge(block_graph, layer_state)(x, positions_L)

    out = jax.eval_shape(block, _first_layer(blocks_state), x_BLD)
    if not isinstance(out, tuple):
        return layers(block, blocks_state, x_BLD), None

    def with_stats(layer_state, carry):
        x, totals = carry
        x, stats = block(layer_state, x)
        return x, jax.tree.map(jnp.add, totals, stats)

    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out[1])
    return layers(with_stats, blocks_state, (x_BLD, zeros))
