"""One gradient path: ``ParallelPlan.value_and_grad`` for every layout.

The trainer hands over its loss and gets ``(params, batch) -> (loss, grads)``, the mean over
``data.microbatches`` sequential micro-batches (``accumulate``). Which gradient that is, is
the plan's business alone, decided here and nowhere else:

* plain: ``jax.value_and_grad`` of the loss. XLA's propagation reduces the gradients over
  the batch axes (every strategy's rules, GPipe and circular pipelines included,
  whose schedule is the loss's layer loop: ``layer_loop``);
* ``data.onebit_momentum`` (1-bit Adam): the same, but each device's own gradient. The train
  step runs in ``shard_map`` over ``data`` (``train/onebit.py``) and the optimizer's
  compressed momentum exchange is the only reduction over that axis, so nothing here pins a
  layout;
* ``offload.optimizer`` (streamed, weights on the device, one micro-batch): the same, but
  each layer's weight gradient leaves for host memory as the backward produces it
  (``offload_grads``: ZeRO-Offload's overlap);
* ``data``'s ZeRO++ parts: ZeRO-3's gradient with quantized or hierarchical collectives
  (``zeropp``);
* ``pipeline.schedule = 1f1b`` or ``chimera``: the (interleaved) 1F1B schedule (and the
  bidirectional Chimera, ``pipeline.chimera``) writes forward and backward
  into one loop (``pipeline.one_f_one_b``), so it cannot differentiate the loss whole. It
  runs the loss's own parts (``StagedLoss``: its token order, embedding, blocks, head and
  loss) under ``plan.ops()``, as the loss itself does, so the attention kernel the plan
  installs (a sequence split's kernel, say) and the loss are the trainer's under every schedule.
  ``pipeline.schedule = 2bw`` takes the same parts into PipeDream-2BW's loop (``no_flush``),
  which the train step calls itself: it also reads and returns the pipeline's in-flight work.

fp16: the loss is multiplied by ``loss_scale`` and the loss and gradients come back scaled
(the trainer unscales them and skips a non-finite step), whichever path computed them.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardlib.core.errors import ShardingError
from shardlib.core.layout import constrain
from shardlib.core.mesh import Axis
from shardlib.parallel import offload_grads, zeropp
from shardlib.parallel.layer_loop import cast_params
from shardlib.parallel.pipeline import two_bw
from shardlib.parallel.pipeline.chimera import chimera_value_and_grad
from shardlib.parallel.pipeline.one_f_one_b import one_f_one_b_value_and_grad
from shardlib.parallel.pipeline.two_bw_loop import two_bw_loop

if TYPE_CHECKING:
    from shardlib.parallel.plan import ParallelPlan

TOKEN_NAMES = ("batch", None)  # a micro-batch of tokens [b, seq + 1]: seq never split


class StagedLoss(Protocol):
    """The trainer's loss, whole and in the parts a pipeline schedules apart
    (``train.decoder_loss.DecoderLoss``). Parameters handed to the parts are already in the
    compute dtype; the whole loss casts its fp32 masters itself."""

    def __call__(self, params, batch): ...  # -> loss, or (loss, metrics) with has_aux

    def split(self, batch):
        """(inputs [b, seq], targets [b, seq], positions [seq] or None, weights or None)
        in the order the model sees the tokens (the plan's ``split_tokens``)."""

    def embed(self, params, inputs_BL): ...  # -> x [b, seq, embed]

    def block(self, block_graph, positions_L):
        """``block_fn(layer_state, x)``: one block at these token positions."""

    def head(self, params, x_BLD, targets_BL, weights_BL):
        """(loss, metrics) of the last block's output: the trainer's loss and mask."""


@dataclass(frozen=True)
class StepLayout:
    """What the gradient path reads besides the plan and the loss: the model's graph and
    the layouts the plan's rules gave its parameters and batch (``TrainSetup.step_layout``)."""

    graphdef: Any
    """The model's ``nnx.GraphDef`` (the 1F1B schedule splits the stacked blocks off it)."""
    dtype: Any
    """Compute dtype; parameters arrive as fp32 master weights."""
    workload: Any
    """The model and step the plan was checked against (the remat policy reads it)."""
    mesh: Mesh
    param_specs: dict
    """``PartitionSpec`` per parameter (ZeRO++ gathers along them)."""
    param_shardings: dict
    """``NamedSharding`` per parameter (1F1B pins the non-block gradients to them)."""
    grad_shardings: dict | None
    """Layout of the gradient accumulation buffer (ZeRO-2/3: sharded); None: not pinned."""
    batch_spec: P
    """The batch's ``PartitionSpec`` (``[batch, seq + 1]``)."""
    batch_names: Any = None
    """Logical names of each batch array's dims, a tree like the batch's (a user's model:
    ``train.user_data.Batches.names``); None: token rows ``TOKEN_NAMES``."""
    stacked_layers: int = 0
    """The decoder's stacked blocks under ``params["blocks"]`` (``TrainSetup.stacked_layers``);
    0 (a user's model): their gradients cannot leave in the backward (``offload_grads``)."""


def value_and_grad(
    plan: ParallelPlan,
    loss_fn,
    layout: StepLayout,
    *,
    has_aux: bool = False,
    loss_scale=None,
):
    """``(params, batch) -> (loss, grads)`` of ``loss_fn`` on this plan (the module
    docstring's cases), averaged over ``plan.data.microbatches``. With ``has_aux`` the loss
    returns ``(loss, metrics)`` and so does the result (the 1F1B schedule reports none)."""
    fn = _with_aux(loss_fn, has_aux, loss_scale)
    spec = plan.pipeline_spec()
    shardings = layout.grad_shardings
    if plan.data.onebit_momentum:  # inside the step's shard_map: this device's gradient
        grad_fn, shardings = jax.value_and_grad(fn, has_aux=True), None
    elif plan.data.zeropp:
        grad_fn = zeropp.value_and_grad(plan, fn, layout)
    elif spec is not None and spec.fused:
        grad_fn = _one_f_one_b(plan, loss_fn, layout, loss_scale)
    elif offload_grads.step_sends_grads_to_host(plan, layout.stacked_layers):  # blocks' to host
        layouts = layout.grad_shardings or layout.param_shardings
        grad_fn = offload_grads.value_and_grad(fn, layouts[offload_grads.BLOCKS])
    else:
        grad_fn = jax.value_and_grad(fn, has_aux=True)
    grad_fn = accumulate(grad_fn, fn, plan.data.microbatches, shardings, layout.batch_names)
    if has_aux:
        return grad_fn

    def loss_only(params, batch):
        (loss, _), grads = grad_fn(params, batch)
        return loss, grads

    return loss_only


def _with_aux(loss_fn, has_aux: bool, loss_scale) -> Callable:
    """``loss_fn`` as ``(params, batch) -> (loss * loss_scale, metrics)``."""

    def fn(params, batch):
        out = loss_fn(params, batch)
        loss, metrics = out if has_aux else (out, {})
        return (loss if loss_scale is None else loss * loss_scale), metrics

    return fn


_MICRO_BATCH: contextvars.ContextVar = contextvars.ContextVar("shardlib_micro_batch", default=None)


def micro_batch_index():
    """The index of the micro-batch being traced inside ``accumulate`` (a traced int32), or
    None outside it: a loss that draws random numbers (a user's model's dropout) folds it
    into its keys so that each micro-batch draws its own."""
    return _MICRO_BATCH.get()


def accumulate(grad_fn, loss_fn, microbatches: int, grad_shardings=None, names=None):
    """``grad_fn`` averaged over ``microbatches`` sequential slices of the batch.

    Every array of the batch is cut along its first dim, whatever its rank; ``names`` (a
    tree like the batch's of logical-name tuples, None: ``TOKEN_NAMES`` for every array)
    pins each micro-batch to the batch's own layout.
    Micro-batch i takes rows i, i + m, i + 2m, ...: reshaping [B] to [B/m, m] keeps every
    device's contiguous block of rows inside each micro-batch, so no data moves. Each
    micro-batch has the same size, so the mean of means is the full-batch mean exactly (a
    packed batch's dict is cut alike, field by field; its weights are normalised over the
    whole batch first, ``train.decoder_loss.normalise_weights``, so the masked mean stays
    global).
    ``loss_fn`` gives the shapes of the summed ``(loss, metrics)``; the sum of gradients is
    pinned to ``grad_shardings`` (ZeRO-2/3: reduce-scattered per micro-batch) where given.
    Each micro-batch is traced with its index set (``micro_batch_index``); a loss that does
    not read it (the decoder's) compiles as before.
    """
    if microbatches == 1:
        return grad_fn

    def cut(x_B):  # [B, ...] -> [m, B/m, ...]
        b, rest = x_B.shape[0], x_B.shape[1:]
        return x_B.reshape(b // microbatches, microbatches, *rest).swapaxes(0, 1)

    def pin(batch_mb):
        if names is None:
            return jax.tree.map(lambda x: constrain(x, TOKEN_NAMES), batch_mb)
        return jax.tree.map(
            lambda n, x: constrain(x, n), names, batch_mb, is_leaf=lambda n: isinstance(n, tuple)
        )

    def accumulated(params, batch):
        micro = jax.tree.map(cut, batch)  # a packed batch's every array alike

        def body(carry, indexed):
            loss_sum, grad_sum = carry
            index, batch_mb = indexed
            batch_mb = pin(batch_mb)
            token = _MICRO_BATCH.set(index)
            try:
                loss, grads = grad_fn(params, batch_mb)
            finally:
                _MICRO_BATCH.reset(token)
            loss_sum = jax.tree.map(jnp.add, loss_sum, loss)
            grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
            if grad_shardings is not None:
                grad_sum = jax.lax.with_sharding_constraint(grad_sum, grad_shardings)
            return (loss_sum, grad_sum), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        first = jax.tree.map(lambda x: x[0], micro)
        loss_zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(loss_fn, params, first))
        indexed = (jnp.arange(microbatches, dtype=jnp.int32), micro)
        (loss_sum, grad_sum), _ = jax.lax.scan(body, (loss_zeros, zeros), indexed)
        return jax.tree.map(lambda g: g / microbatches, (loss_sum, grad_sum))

    return accumulated


def _one_f_one_b(plan: ParallelPlan, loss: StagedLoss, layout: StepLayout, loss_scale):
    """The 1F1B schedule's ``(params, tokens) -> ((loss, {}), grads)`` from the loss's parts.

    The stacked blocks stay fp32 master weights (each stage casts its own per trip, so the
    per-micro-batch gradients accumulate in fp32); every other parameter is cast once. The
    blocks see the token positions of the loss's token order (``split_tokens``).
    """
    spec = plan.pipeline_spec()
    parts = ("split", "embed", "block", "head")
    if not all(hasattr(loss, name) for name in parts):
        raise ShardingError(
            f"pipeline_schedule={spec.schedule} runs the loss in parts (token order, embedding, "
            "blocks, "
            f"head and loss), but this loss is a plain function ({loss!r}). Fix: the "
            "trainer's loss (train.decoder_loss.make_loss_fn), or pipeline_schedule=gpipe."
        )
    schedule = chimera_value_and_grad if spec.schedule == "chimera" else one_f_one_b_value_and_grad
    rest_shardings = {k: v for k, v in layout.param_shardings.items() if k != "blocks"}
    # a user's model's batch: a tree of arrays with their names (1F1B; Chimera: token rows)
    named = {} if layout.batch_names is None else {"batch_names": layout.batch_names}

    def value_and_grad(params, tokens_BL1):
        rest, blocks_state, parts = _staged_parts(spec, loss, layout, params, tokens_BL1)
        run = schedule(spec, **parts, **named)
        with plan.ops():  # the attention kernel (and exchange) the plan picks, as in the loss
            value, g_rest, g_blocks = run(
                rest, blocks_state, tokens_BL1, rest_shardings, loss_scale
            )
        grads = {**g_rest, "blocks": nnx.to_pure_dict(g_blocks)}
        return (value, {}), jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)

    return value_and_grad


def _staged_parts(spec, loss: StagedLoss, layout: StepLayout, params, tokens_BL1):
    """``(rest, blocks_state, parts)``: the parameters as a fused schedule runs them and the
    loss's parts (``block_fn``, ``embed``, ``head_loss``, ``split_tokens``) on them. The
    stacked blocks stay fp32 master weights (each stage casts its own per trip, so the
    per-micro-batch gradients accumulate in fp32); every other parameter is cast once. The
    blocks see the token positions of the loss's token order (``split_tokens``)."""
    if isinstance(tokens_BL1, dict) and layout.batch_names is None:
        raise ShardingError(
            f"pipeline_schedule={spec.schedule} with a packed batch (a prepared dataset): each "
            "micro-batch's document positions would have to travel with it through the "
            "stages, which the schedule does not carry. Fix: a flat token file, or a mesh "
            "without a stage axis."
        )
    cast = cast_params(params, layout.dtype, keep_blocks=True)  # blocks: cast per stage
    block_graph, blocks_state = nnx.split(nnx.merge(layout.graphdef, cast).blocks)
    rest = {k: v for k, v in cast.items() if k != "blocks"}

    def whole(r):
        return {**r, "blocks": cast["blocks"]}

    positions_L = loss.split(tokens_BL1)[2]  # the token order's true positions (constant)
    parts = dict(
        block_fn=loss.block(block_graph, positions_L),  # the schedule decides what is saved
        embed=lambda r, inputs_BL: loss.embed(whole(r), inputs_BL, positions_L),
        head_loss=lambda r, x_BLD, targets_BL: loss.head(whole(r), x_BLD, targets_BL, None)[0],
        split_tokens=lambda t_BL1: loss.split(t_BL1)[:2],
    )
    return rest, blocks_state, parts


def no_flush(plan: ParallelPlan, loss: StagedLoss, layout: StepLayout, loss_scale=None):
    """PipeDream-2BW's loop (``pipeline.two_bw_loop``) as ``(init_carry(params, tokens) ->
    carry, step(params, prev_params, carry, tokens) -> (loss, grads, carry))``: the
    previous batch's loss and gradients, taken at ``prev_params`` (the weights its work
    started on), and the pipeline's in-flight work for the next step."""
    spec = plan.pipeline_spec()
    rest_shardings = {k: v for k, v in layout.param_shardings.items() if k != "blocks"}

    def loop(params, tokens_BL1):
        rest, blocks_state, parts = _staged_parts(spec, loss, layout, params, tokens_BL1)
        return rest, blocks_state, two_bw_loop(spec, **parts)

    def init_carry(params, tokens_BL1):
        rest, blocks_state, (init, _) = loop(params, tokens_BL1)
        return init(rest, blocks_state, tokens_BL1)

    def step(params, prev_params, carry, tokens_BL1):
        rest, blocks_state, (_, run) = loop(params, tokens_BL1)
        prev_rest, prev_blocks, _ = loop(prev_params, tokens_BL1)
        scale = 1.0 if loss_scale is None else loss_scale
        with plan.ops():
            value, g_rest, g_blocks, carry = run(
                rest, blocks_state, prev_rest, prev_blocks, carry, tokens_BL1, scale,
                rest_shardings,
            )  # fmt: skip
        grads = {**g_rest, "blocks": nnx.to_pure_dict(g_blocks)}
        return value, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params), carry

    return init_carry, step


def check(plan: ParallelPlan) -> None:
    """The gradient path's refusals that span sections: 1-bit momentum runs on a plain
    data-parallel mesh with replicated state (DeepSpeed: 1-bit Adam does not combine with
    ZeRO), since its step maps the ``data`` axis alone and keeps one error buffer per device."""
    two_bw.check(plan)  # 2bw's stale weights live beside the parameters, in the trainer's step
    if not plan.data.onebit_momentum:
        return
    others = {a: s for a, s in plan.mesh_axes.items() if a != Axis.DATA and s > 1}
    problems = [f"mesh axes {others} besides {Axis.DATA!r}"] if others else []
    if plan.data.zero:
        problems.append(f"zero={plan.data.zero}")
    if plan.data.zeropp:
        problems.append("ZeRO++ (quantized_weights / hpz / quantized_gradients)")
    if plan.offload.optimizer or plan.offload.params:
        problems.append("offload")
    if problems:
        raise ShardingError(
            "1-bit Adam / LAMB (optimizer=onebit_adam or onebit_lamb, i.e. "
            "parallel.data.onebit_momentum) exchanges "
            f"the momentum over the {Axis.DATA!r} axis of a plain data-parallel mesh with "
            f"replicated state, but this plan has {', '.join(problems)}. Fix: a mesh data=N "
            "with zero=0 and no offload (as in DeepSpeed, 1-bit Adam does not combine with "
            "ZeRO), or optimizer=adamw (lamb) without onebit_momentum."
        )
