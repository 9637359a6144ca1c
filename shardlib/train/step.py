"""The jitted, donated train step: loss, gradient accumulation, optax update.

The step is written once for every layout. Its gradient comes from the plan
(``ParallelPlan.value_and_grad``: plain, ZeRO++, the 1F1B schedule or 1-bit momentum's
per-device one, each fed ``train.decoder_loss.DecoderLoss``). Which collectives it runs is
decided by the shardings of its inputs and outputs and by the ``constrain`` calls in the
model: XLA's propagation fills in the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import optax

from shardlib.core.errors import ShardingError
from shardlib.core.layout import constrain, use_layout
from shardlib.dataset.tokens import BATCH_NAMES
from shardlib.parallel import gradients, offload_grads
from shardlib.parallel import state as layouts
from shardlib.parallel.gradients import accumulate
from shardlib.parallel.layer_loop import on_device
from shardlib.parallel.offload import DEVICE_MEMORY
from shardlib.parallel.offload_stream import grad_norm as streamed_grad_norm
from shardlib.parallel.offload_stream import streamed_update, streams
from shardlib.parallel.pipeline import two_bw
from shardlib.parallel.pipeline.storage import map_blocks
from shardlib.train import fp8, precision
from shardlib.train.decoder_loss import (  # noqa: F401  (the step's loss, imported from here too)
    DecoderLoss,
    make_loss_fn,
    normalise_weights,
    split_batch,
)
from shardlib.train.user_state import MODEL_STATE

if TYPE_CHECKING:
    from shardlib.train.setup import TrainSetup


def global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def grad_function(
    setup: TrainSetup, loss_fn, *, has_aux: bool = False, loss_scale=None, stored: bool = False
):
    """The plan's ``(params, batch) -> (loss, grads)`` for this setup's model and layout
    (``ParallelPlan.value_and_grad``), averaged over ``parallel.data.microbatches``.

    ``loss_scale``: the fp16 scale; the loss and gradients come back scaled by it.
    ``stored``: parameters and gradients in the trainer's layer order (``setup.layer_order``,
    as the train state holds them); by default in the model's natural order, regrouped
    around the step where an interleaved pipeline stores them in stage order."""
    grad_fn = setup.plan.value_and_grad(
        loss_fn, setup.step_layout, has_aux=has_aux, loss_scale=loss_scale
    )
    order, rows = setup.layer_order, setup.workload.blocks
    if stored or order.natural:
        return grad_fn

    def natural_in_and_out(params, batch):
        out, grads = grad_fn(map_blocks(order.store_rows, params, rows), batch)
        return out, map_blocks(order.natural_rows, grads, rows)

    return natural_in_and_out


def accumulate_grads(
    loss_fn,
    params,
    tokens_BL1,
    microbatches: int,
    grad_shardings,
    grad_fn=None,
    *,
    has_aux: bool = False,
):
    """Mean loss and gradient over ``microbatches`` sequential slices of the batch
    (``parallel.gradients.accumulate``, which ``ParallelPlan.value_and_grad`` applies
    itself); ``grad_fn`` replaces ``jax.value_and_grad(loss_fn)``."""
    grad_fn = grad_fn or jax.value_and_grad(loss_fn, has_aux=has_aux)
    return accumulate(grad_fn, loss_fn, microbatches, grad_shardings)(params, tokens_BL1)


def build_eval_step(setup: TrainSetup):
    """``eval(params, batch) -> (loss, weight)``: one held-out batch's (masked) mean
    cross-entropy and the weight it carries, so that evaluation combines batches as
    ``sum(loss * weight) / sum(weight)``, a mean over all held-out tokens that count.
    ``params`` is ``fp8.eval_params(state)``: with FP8, the scales too (used, not updated);
    the stacked rows in the trainer's ``setup.layer_order``, as the state holds them."""
    loss_fn = make_loss_fn(setup, with_metrics=True)

    def eval_step(params, batch):
        with use_layout(setup.mesh, setup.rules):
            batch = jax.tree.map(lambda x: constrain(x, BATCH_NAMES), batch)
            if isinstance(batch, dict):
                weight = jnp.sum(batch["weights"])
            else:
                weight = jnp.float32(batch[:, 1:].size)
            loss, metrics = loss_fn(params, normalise_weights(batch))
        return metrics.get("ce_loss", loss), weight  # without a router's auxiliary loss

    params_shardings = fp8.with_meta(setup.param_shardings, setup.fp8_shardings)
    return jax.jit(eval_step, in_shardings=(params_shardings, setup.batch_sharding))


def _whole_update(setup: TrainSetup, grads, opt_state, params):
    """optax's update with the whole state in device memory (moved there if offloaded):
    ``(new params, new state, params, state, grads)``, the last three as the update read
    them (in device memory, the gradients in ``update_shardings``): a skipped fp16 step keeps
    those without mixing memory kinds, and the gradient norm is taken on the laid-out
    gradients (as the step always did: XLA then fuses the loss scalar into their sync)."""
    plan = setup.plan
    if plan.offload.params:  # the update runs in device memory (grads too: d/d host)
        grads, opt_state, params = on_device((grads, opt_state, params))
    grads = jax.lax.with_sharding_constraint(grads, setup.update_shardings)
    if plan.offload.optimizer:
        opt_state = layouts.to_memory(opt_state, setup.opt_state_shardings, DEVICE_MEMORY)
    updates, new_opt_state = setup.tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_opt_state, params, opt_state, grads


def build_train_step(setup: TrainSetup, *, record_grads: bool = False):
    """The decoder's step: ``build_step`` with ``DecoderLoss`` on [b, seq + 1] token rows
    (or a prepared dataset's packed dict, its weights normalised over the whole batch)."""
    loss_fn = make_loss_fn(setup, with_metrics=True, lora=True)
    if setup.plan.data.onebit_momentum:  # the optimizer's update communicates: shard_map
        from shardlib.train.onebit import build_onebit_step

        return build_onebit_step(setup, loss_fn)

    def prepare(tokens_BL1):
        tokens_BL1 = jax.tree.map(lambda x: constrain(x, BATCH_NAMES), tokens_BL1)
        return normalise_weights(tokens_BL1)  # packed: one global masked mean

    return build_step(setup, loss_fn, prepare, record_grads=record_grads)


def build_step(setup: TrainSetup, loss_fn, prepare: Callable, *, record_grads: bool = False):
    """``step(state, batch) -> (state, metrics)``, jitted with the state donated, for any
    ``loss_fn(params, batch) -> (loss, metrics)``: the decoder's (``build_train_step``) or a
    user's model's (``train.user_model``). ``prepare`` lays the batch out first.
    ``record_grads`` puts the applied gradients (stored layer order) in the metrics as
    ``"grads"``: parity reads them instead of compiling a gradient program beside the step.

    Gradients accumulate in ``setup.grad_shardings`` and enter the optimizer in
    ``setup.update_shardings`` (the ZeRO stage decides both). With ``offload_optimizer`` the
    optimizer state arrives in host memory and leaves to host memory again (the output
    shardings say so); the update moves it to the device one stacked layer at a time
    (``offload_stream``), or whole with ``offload.per_layer=false``. With fp16 the loss is
    scaled, and a step with non-finite gradients changes neither parameters nor optimizer
    state. A user's model state (``train.user_state``: BatchNorm statistics, RNG counts) is
    handed to the loss (``loss_fn.given``) and comes back from its forward pass in the
    metrics; the next state is ``loss_fn.next_state`` of it, outside the gradient.
    """
    if setup.plan.offload.nvme_path:
        raise ShardingError(
            f"offload.nvme_path={setup.plan.offload.nvme_path!r}: the update reads its state "
            "from files between device calls, outside one compiled step. Fix: take "
            "TrainSetup.train_step (shardlib.train.nvme.NvmeTrainStep), or drop nvme_path."
        )
    tx, sched, cfg, plan = setup.tx, setup.schedule, setup.cfg, setup.plan
    if setup.stale_weights and fp8.enabled(cfg.precision):
        raise ShardingError(
            "pipeline_schedule=2bw with FP8: its loop does not carry the delayed scales "
            "between steps. Fix: precision.compute=bf16 (or fp32), or pipeline_schedule=1f1b."
        )
    scaled = precision.uses_loss_scale(cfg.precision)
    # the streamed update walks the decoder's stacked blocks; a model without them (a user's
    # own, ``train.user_model``) takes the whole-state update, its state still kept on host
    stream = streams(plan) and setup.stacked_layers > 0

    def train_step(state, batch):
        with use_layout(setup.mesh, setup.rules):
            params, meta = state["params"], state.get(fp8.KEY)
            batch = prepare(batch)
            scale = state["loss_scale"]["scale"] if scaled else None
            # the plan's one gradient path: plain, ZeRO++ or 1F1B, over the micro-batches
            # a user's model state (BatchNorm statistics, RNG counts): read, not differentiated
            model_state = state.get(MODEL_STATE)
            fn = loss_fn if model_state is None else loss_fn.given(model_state)
            carry = state.get(two_bw.CARRY)
            if carry is None:
                grad_fn = grad_function(setup, fn, has_aux=True, loss_scale=scale, stored=True)
                (loss, extra), grads = grad_fn(fp8.with_meta(params, meta), batch)
            else:  # 2bw: the previous batch's gradient, at W(t-1), applied to W(t) below
                run_2bw = gradients.no_flush(plan, fn, setup.step_layout, scale)[1]
                loss, grads, carry = run_2bw(params, state[two_bw.PREV_PARAMS], carry, batch)
                # step 0's are an empty pipeline's (maybe not finite: no fp16 overflow)
                grads = two_bw.after_first(state["step"], grads, 0.0)
                extra = {}
            extra = dict(extra)
            forward_state = extra.pop(MODEL_STATE, None)  # what the forward pass wrote
            # FP8: the meta's "gradient" is its next value (delayed scaling), not an update
            grads, new_meta = fp8.split_meta(grads)
            if scaled:
                loss = loss / scale
                grads = jax.tree.map(lambda g: g / scale, grads)
            opt_state = state["opt_state"]
            finite = None
            if stream:  # offloaded state and weights visit the device one layer at a time
                if not plan.offload.params:  # (offloaded weights' gradients stay in host memory)
                    grads = offload_grads.pin_in_update_layout(
                        setup.plan, setup.stacked_layers, grads, setup.update_shardings
                    )
                grad_norm = streamed_grad_norm(grads, setup.workload.blocks)
                if scaled:  # offloaded gradients are in host memory: finite iff the norm is
                    finite = jnp.isfinite(grad_norm)
                new_params, new_opt_state, _ = streamed_update(
                    tx, grads, opt_state, params, layers=setup.workload.blocks,
                    state_shardings=setup.opt_state_shardings, clip_norm=cfg.optimizer.clip_norm,
                    state_on_host=plan.offload.optimizer, keep=finite, norm=grad_norm,
                )  # fmt: skip
            else:
                new_params, new_opt_state, params, opt_state, grads = _whole_update(
                    setup, grads, opt_state, params
                )
                if carry is not None:  # step 0 finished no batch: nothing to apply
                    new_params, new_opt_state = two_bw.after_first(
                        state["step"], (new_params, new_opt_state), (params, opt_state)
                    )
                if scaled:
                    finite = precision.all_finite(grads)
                grad_norm = global_norm(grads)
        if carry is not None:  # no batch's loss at step 0
            loss, grad_norm = two_bw.after_first(state["step"], (loss, grad_norm), jnp.nan)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": sched(state["step"])}
        metrics.update(extra)  # what the model (the user's loss) reports besides the loss
        if record_grads:
            metrics["grads"] = grads
        new_state = {"params": new_params, "opt_state": new_opt_state, "step": state["step"] + 1}
        if new_meta is not None:
            new_state[fp8.KEY] = new_meta
        if model_state is not None:  # the forward's statistics; never the optimizer's
            new_model_state = loss_fn.next_state(model_state, forward_state)
            if scaled:  # a skipped step keeps them too
                new_model_state = precision.keep_if(finite, new_model_state, model_state)
            new_state[MODEL_STATE] = new_model_state
        if scaled and not stream:  # (the streamed update kept them row by row)
            new_state["params"] = precision.keep_if(finite, new_params, params)
            new_state["opt_state"] = precision.keep_if(finite, new_opt_state, opt_state)
        keep = (lambda new, old: precision.keep_if(finite, new, old)) if scaled else None
        new_state = two_bw.advance(new_state, state, params, keep)  # 2bw: W(t) is next's stale
        if carry is not None:
            new_state[two_bw.CARRY] = carry
        if scaled:
            new_state["loss_scale"] = precision.update_loss_scale(
                cfg.precision, state["loss_scale"], finite
            )
            metrics.update(precision.metrics(new_state["loss_scale"], finite))
        return new_state, metrics

    return jax.jit(
        train_step,
        in_shardings=(setup.state_shardings, setup.batch_sharding),
        out_shardings=(setup.state_shardings, None),
        donate_argnums=0,
    )
