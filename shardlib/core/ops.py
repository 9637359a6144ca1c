"""The operations model code calls whose form depends on the parallel layout, in one place.

A model names logical dims only; it cannot know whether its sequence is split over a
``context`` axis or its experts over an ``expert`` axis. So it calls the functions here, and
the forms installed by ``use_ops`` (the plan's sections fill them: ``ParallelPlan.ops``)
decide how they run: which attention kernel, whether the MoE exchange is left to XLA or
written as an explicit all-to-all, whether a block's projections run as plain or FP8
products. Outside ``use_ops`` attention is local and dense, the exchange only re-constrains
the layout and ``matmul`` is ``jnp.einsum``, so a model runs unchanged on one device. ``lookup``
reads a vocab-split table; ``scan_blocks`` and ``run_blocks`` are the layer loop every
model shares. Nothing here knows a strategy: the strategies know these ops.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib.core.attention import LocalAttention, Packed, SlidingWindow
from shardlib.core.errors import ShardingError
from shardlib.core.layout import active_layout, constrain
from shardlib.core.lookup import lookup
from shardlib.core.token_slice import active_slice, slice_positions, sliced_attention

__all__ = [
    "OpsSettings",
    "Packed",
    "active_ops",
    "attention",
    "batch_mean",
    "batch_sum",
    "exchange",
    "lookup",
    "matmul",
    "stacked_matmul",
    "vjp_at_once",
    "recomputed",
    "run_blocks",
    "scan_blocks",
    "use_ops",
]

AttentionForm = Callable[..., Any]
"""``form(q_BLHK, k_BLGK, v_BLGK, positions_L, *, causal) -> out_BLHK``."""
ExchangeForm = Callable[[jax.Array, tuple, tuple, str], jax.Array]
"""``form(x, src_names, dst_names, direction) -> x`` laid out by ``dst_names``."""
BatchForm = Callable[[jax.Array, str], jax.Array]
"""``form(value, "mean" | "sum") -> value``: a mean or sum over this program's rows of the
batch, made the whole batch's."""
MatmulForm = Callable[[str, jax.Array, jax.Array, str, Any], jax.Array]
"""``form(spec, x, w, name, layer_state) -> einsum(spec, x, w)`` computed the form's way;
``layer_state`` is this layer's slice of the form's per-layer state (``run_blocks``'
``layer_extras``; None outside the layer loop), ``name`` the projection's (one per layer)."""
ProductForm = Callable[[str, jax.Array, jax.Array], jax.Array]
"""``form(spec, x, w) -> einsum(spec, x, w)`` where a strategy decides what the product
keeps for its backward (2.5D's SUMMA keeps X split and gathers it again for dW:
``parallel/tensor25d.py``)."""


@dataclass(frozen=True)
class OpsSettings:
    """The forms the ops take; one value is active at a time (``use_ops``)."""

    attention: AttentionForm = field(default_factory=LocalAttention)
    """How attention runs: ``LocalAttention`` or a strategy's form (context parallelism)."""
    exchange: ExchangeForm | None = None
    """The MoE exchange; None: re-constrain and let XLA derive the all-to-all (GShard)."""
    batch: BatchForm | None = None
    """Where a program sees only some rows of the batch (a pipeline's per-replica loop,
    ``parallel/pipeline/replicas.py``), how their means become the whole batch's."""
    matmul: MatmulForm | None = None
    """How a block's projections multiply; None: ``jnp.einsum`` (an FP8 run installs its
    quantize-dequantize form, ``train/fp8.py``)."""
    product: ProductForm | None = None
    """A strategy's form of the projections (None: ``matmul``'s); not beside ``matmul``."""


_DEFAULT = OpsSettings()  # dense local attention, XLA's exchange: one device's forms
_OPS: contextvars.ContextVar[OpsSettings | None] = contextvars.ContextVar(
    "shardlib_ops", default=None
)
_LAYER: contextvars.ContextVar[Any] = contextvars.ContextVar("shardlib_layer", default=None)
_KEEP_STACKED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "shardlib_keep_stacked", default=False
)


@contextlib.contextmanager
def _bound(var: contextvars.ContextVar, value) -> Iterator[None]:
    """Inside: ``var`` is ``value``; the outer value comes back after (nested blocks too)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


@contextlib.contextmanager
def use_ops(
    *,
    attention: AttentionForm | None = None,
    exchange: ExchangeForm | None = None,
    product: ProductForm | None = None,
) -> Iterator[OpsSettings]:
    """Make these forms the ones the ops follow; usable inside ``jit`` tracing.

    A context variable, not an argument threaded through the model: model code stays the
    same on one device and on a mesh, and nested blocks restore the outer settings.
    """
    settings = OpsSettings(
        attention=attention or LocalAttention(), exchange=exchange, product=product
    )
    with _bound(_OPS, settings):
        yield settings


def active_ops() -> OpsSettings:
    return _OPS.get() or _DEFAULT


@contextlib.contextmanager
def batch_rows(form: BatchForm) -> Iterator[None]:
    """Inside: this program sees a part of the batch's rows; ``batch_mean`` and ``batch_sum``
    complete theirs with ``form`` (the other forms stay as they are)."""
    with _bound(_OPS, dataclasses.replace(active_ops(), batch=form)):
        yield


@contextlib.contextmanager
def use_matmul(form: MatmulForm | None) -> Iterator[None]:
    """Inside: ``matmul`` runs in ``form`` (None: leave the active form as it is); the
    other forms stay as they are."""
    if form is None:
        yield
        return
    with _bound(_OPS, dataclasses.replace(active_ops(), matmul=form)):
        yield


def matmul(spec: str, x: jax.Array, w: jax.Array, *, name: str) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` of activations ``x`` and a weight ``w`` (both in the
    compute dtype), in the active form: plain, or FP8 with ``name``'s scales in this
    layer. A block's projections call this; ``name`` is unique within the block."""
    settings = active_ops()
    form = settings.matmul
    if settings.product is not None:
        if form is not None:
            raise ShardingError(
                f"projection {name!r}: the layout's product form (2.5D products='summa') and "
                "a precision's (FP8) both want to run it. Fix: products='megatron' with FP8, "
                "or another precision."
            )
        return settings.product(spec, x, w)
    if form is None:
        return jnp.einsum(spec, x, w)
    return form(spec, x, w, name, _LAYER.get())


def stacked_matmul(
    spec: str, x: jax.Array, build: Callable[..., jax.Array], weights, *, name: str
) -> jax.Array:
    """``matmul(spec, x, build(*weights))``: one product of several weights that ``build``
    stacks (q, k and v; gate and up), so that the backward pass sums their input gradients
    before one reduction. The stacked copy is rebuilt in the backward pass, not kept: kept,
    it is a residual of the layer loop under remat=none, one copy per layer of those
    weights as the layout holds them, which no fused kernel keeps (GPT's q/k/v: gpt-tiny
    widened to h 512, 4 layers, one sequence per device on data 8, fp32: 153.2 -> 134.3 MB
    of temporaries; Llama's block still stacks q/k/v and gate/up inline: 0.56 of 7.95 GB
    at 39B width on tensor 8, 2 layers, one sequence, until the planner's shared memory
    coefficients, fitted with those copies in, are refitted). Rebuilding it is a copy; the
    product is not run again (its output is not needed there): FLOPs unchanged. Where the
    caller takes a layer's VJP right after its forward (``vjp_at_once``) the copy lives
    for one layer anyway, and rebuilding it would gather FSDP-split weights again."""

    def product(x, *weights):
        return matmul(spec, x, build(*weights), name=name)

    if _KEEP_STACKED.get():
        return product(x, *weights)
    return jax.checkpoint(product, prevent_cse=False)(x, *weights)


@contextlib.contextmanager
def vjp_at_once() -> Iterator[None]:
    """Trace a block whose VJP is taken right after its forward (a fused pipeline's stage
    backward, ``parallel.pipeline.stage_work``; a recomputed block, ``recomputed``):
    ``stacked_matmul`` keeps its stacked weights, which live one layer there (1F1B on
    stage 2 x fsdp 4, gpt-tiny widened to h 512: rebuilt, they were gathered again, 396.5 ->
    420.1 MB on the wire)."""
    with _bound(_KEEP_STACKED, True):
        yield


def recomputed(fn: Callable) -> Callable:
    """``fn`` (a block, or a segment of blocks) traced under ``vjp_at_once``, for a
    ``jax.checkpoint`` that runs its forward again right before its VJP (``parallel.remat``,
    ``parallel.segments``). Rebuilt there instead, a fused product's stacked weights had
    their own checkpoint inside the recompute, and XLA gathered FSDP-split weights once
    more (GPT's q/k/v; gpt-tiny at h 256, 4 layers, fsdp 8, remat=full: 46.2 -> 43.6 MiB
    on the wire, what remat=selective moves; memory unchanged)."""

    def run(*args):
        with vjp_at_once():
            return fn(*args)

    return run


def batch_mean(x: jax.Array, axis) -> jax.Array:
    """``x.mean(axis)`` over the batch's rows: the whole batch's even where this program
    holds only some of them. A statistic that is not linear in the batch (an MoE router's
    load-balancing loss, a product of two batch means) needs its means whole: model code
    takes them here, and the layout decides how."""
    mean = jnp.mean(x, axis)
    form = active_ops().batch
    return mean if form is None else form(mean, "mean")


def batch_sum(x: jax.Array, axis=None) -> jax.Array:
    """``x.sum(axis)`` over the batch's rows (``batch_mean``'s sum: a count, say)."""
    total = jnp.sum(x, axis)
    form = active_ops().batch
    return total if form is None else form(total, "sum")


def attention(q_BLHK, k_BLGK, v_BLGK, positions_L=None, *, causal: bool = True, window=0):
    """Attention with grouped K/V heads, [B, L, H, K] -> [B, L, H, K], in the active form.

    ``positions_L`` are the tokens' true positions (default 0..L-1): they drive the causal
    mask, so a reordered sequence (zig-zag context parallelism) attends correctly; ``Packed``
    positions keep each query inside its own document. ``window`` > 0 limits each query to
    its last ``window`` keys (sliding-window attention, Mistral's): the forms receive it as
    ``causal=SlidingWindow(window)``, which every causal kernel masks by.
    """
    if causal and window:
        causal = SlidingWindow(window)
    form, slot = active_ops().attention, active_slice()
    if slot is not None:  # TeraPipe's token slice: over the prefix it keeps
        return sliced_attention(slot, form, q_BLHK, k_BLGK, v_BLGK, positions_L, causal)
    return form(q_BLHK, k_BLGK, v_BLGK, positions_L, causal=causal)


def exchange(
    x: jax.Array, src: tuple, dst: tuple, direction: Literal["dispatch", "combine"]
) -> jax.Array:
    """Move ``x`` from the layout of logical names ``src`` to that of ``dst``, where one mesh
    axis changes dims: an MoE buffer [groups, experts, capacity, embed] going to its experts
    (``dispatch``: the axis leaves the groups dim for the experts dim) and back (``combine``).

    By default this only re-constrains the layout and XLA's propagation emits the all-to-all
    (GShard); a strategy may install an explicit form (``use_ops(exchange=...)``). Both move
    the same bytes. The model names both layouts; nothing here knows them.
    """
    if direction not in ("dispatch", "combine"):
        raise ValueError(f"exchange direction {direction!r}: use 'dispatch' or 'combine'.")
    form = active_ops().exchange
    if form is None or active_layout() is None:
        return constrain(x, dst)  # a no-op outside use_layout
    return form(x, src, dst, direction)


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


@contextlib.contextmanager
def _in_layer(layer_extras) -> Iterator[None]:
    with _bound(_LAYER, layer_extras):
        yield


def _first_layer(blocks_state):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), blocks_state)


def run_blocks(
    block_graph: nnx.GraphDef,
    blocks_state,
    x_BLD,
    positions_L=None,
    *,
    layers: Callable[[BlockFn, Any, Any], Any] = scan_blocks,
    layer_extras=None,
):
    """``(x_BLD, totals)``: the residual after every block, and the blocks' summed stats.

    A block is ``nnx.merge(block_graph, layer_state)(x_BLD, positions_L)`` and returns
    ``x_BLD`` or ``(x_BLD, stats)``; which one is read from its abstract output (nothing is
    computed twice). With stats the loop's carry is ``(x_BLD, totals)``, summed from zero;
    without, it is ``x_BLD`` and ``totals`` is None. ``layers`` runs the loop (``scan_blocks``
    or a strategy's replacement). ``layer_extras``: the ops' per-layer state (an FP8 run's
    scales and amax histories), stacked like the blocks; it travels through the loop beside
    the weights, so every block reads its own layer's slice (``matmul``) and a gradient
    with respect to it comes back stacked like it.
    """
    if layer_extras is not None:
        blocks_state = (blocks_state, layer_extras)

    def block(layer_state, x):
        pos = slice_positions(positions_L, x.shape[1])  # a token slice's, under TeraPipe
        if layer_extras is None:
            return nnx.merge(block_graph, layer_state)(x, pos)
        weights, extras = layer_state
        with _in_layer(extras):
            return nnx.merge(block_graph, weights)(x, pos)

    out = jax.eval_shape(block, _first_layer(blocks_state), x_BLD)
    if not isinstance(out, tuple):
        return layers(block, blocks_state, x_BLD), None

    def with_stats(layer_state, carry):
        x, totals = carry
        x, stats = block(layer_state, x)
        return x, jax.tree.map(jnp.add, totals, stats)

    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out[1])
    return layers(with_stats, blocks_state, (x_BLD, zeros))
