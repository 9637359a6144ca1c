"""The jitted, donated train step: loss, gradient accumulation, optax update.

The step is written once for every layout. Which collectives it runs is decided by the
shardings of its inputs and outputs and by the ``constrain`` calls in the model: XLA's
propagation fills in the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from shardlib.core.layout import constrain, use_layout
from shardlib.core.ops import Packed, run_blocks
from shardlib.data.tokens import BATCH_NAMES
from shardlib.parallel import state_layouts as layouts
from shardlib.parallel import zeropp
from shardlib.parallel.layer_loop import cast_params, master_blocks, on_device
from shardlib.parallel.offload import DEVICE_MEMORY
from shardlib.parallel.pipeline.stats import stats_tokens
from shardlib.train import precision
from shardlib.train.optim import stop_base_gradients

if TYPE_CHECKING:
    from shardlib.train.setup import TrainSetup


def global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def split_batch(plan, batch):
    """(inputs [b, seq], targets [b, seq], positions, weights [b, seq] or None) of a batch.

    A batch is [b, seq + 1] token ids (the plain path: every target counts), or a prepared
    dataset's packed dict (``shardlib.data.loader``): ``tokens`` [b, seq + 1], ``weights``,
    ``positions`` and ``segments`` [b, seq], the weights already normalised
    (``normalise_weights``).
    """
    if not isinstance(batch, dict):
        return (*plan.split_tokens(batch), None)
    tokens_BL1 = batch["tokens"]
    packed = Packed(positions=batch["positions"], segments=batch["segments"])
    return tokens_BL1[:, :-1], tokens_BL1[:, 1:], packed, batch["weights"]


def normalise_weights(batch):
    """Weights scaled so that ``mean(weights * ce)`` over the whole batch is the masked mean
    ``sum(w * ce) / sum(w)``.

    Normalising once, over the global batch, before micro-batches are cut makes every
    micro-batch's plain mean a share of the one global masked mean: the accumulated loss is
    the same however the batch is split over devices or micro-batches (not a mean of means).
    """
    if not isinstance(batch, dict):
        return batch
    w_BL = batch["weights"]
    scale = w_BL.size / jnp.maximum(jnp.sum(w_BL), 1.0)
    return {**batch, "weights": w_BL * scale}


def make_loss_fn(setup: TrainSetup, *, with_metrics: bool = False):
    """Mean next-token cross-entropy of one batch of [b, seq + 1] tokens (``split_batch``;
    a packed batch's is the weighted mean, its weights normalised by ``normalise_weights``).

    The model is driven through the decoder protocol: ``embed``, the plan's layer loop over
    the stacked ``blocks`` (remat, pipeline, offload) and ``head``. Blocks that return
    statistics besides the residual (an MoE router's) have them summed over the layers and
    handed to the model's ``aux``; its ``"loss"`` entry joins the objective and every entry
    is reported. ``with_metrics`` returns ``(loss, metrics)`` for
    ``jax.value_and_grad(..., has_aux=True)``.
    """
    graphdef, dtype, plan = setup.graphdef, setup.compute_dtype, setup.plan
    layers = plan.layer_loop(setup.target, dtype)  # remat, pipeline schedule, param offload

    def loss_fn(params, batch):
        # fp32 master weights are cast once here; the model computes in ``dtype``.
        params = cast_params(params, dtype, keep_blocks=master_blocks(plan))
        model = nnx.merge(graphdef, params)
        inputs_BL, targets_BL, positions_L, weights_BL = split_batch(plan, batch)
        block_graph, blocks_state = nnx.split(model.blocks)
        with plan.ops():  # the attention kernel and MoE exchange the plan picks
            x_BLD = model.embed(inputs_BL, dtype=dtype)
            x_BLD, totals = run_blocks(block_graph, blocks_state, x_BLD, positions_L, layers=layers)
            logits_BLV = model.head(x_BLD, dtype=dtype)
        # under GPipe/circular ``totals`` are a micro-batch's (their mean over micro-batches)
        tokens = stats_tokens(plan.pipeline_spec(), inputs_BL.size)
        aux = {} if totals is None else model.aux(totals, tokens)
        ce_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL)
        ce = ce_BL.mean() if weights_BL is None else (ce_BL * weights_BL).mean()
        metrics = {("aux_loss" if k == "loss" else k): v for k, v in aux.items()}
        if aux:
            metrics["ce_loss"] = ce
        loss = ce + aux.get("loss", 0.0)
        return (loss, metrics) if with_metrics else loss

    return loss_fn


def grad_function(setup: TrainSetup, loss_fn, *, has_aux: bool = False, loss_scale=None):
    """The plan's ``(params, tokens) -> (loss, grads)`` for this setup's model and layout.

    ``loss_scale``: the fp16 scale ``loss_fn`` multiplies its loss by (the 1F1B pipeline,
    which computes its own gradients, applies it itself)."""
    rest = {k: v for k, v in setup.param_shardings.items() if k != "blocks"}
    return setup.plan.value_and_grad(
        loss_fn,
        graphdef=setup.graphdef,
        dtype=setup.compute_dtype,
        target=setup.target,
        rest_shardings=rest,
        has_aux=has_aux,
        loss_scale=loss_scale,
    )


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
    """Mean loss and gradient over ``microbatches`` sequential slices of the batch.

    Micro-batch i takes rows i, i + m, i + 2m, ...: reshaping [B] to [B/m, m] keeps every
    device's contiguous block of rows inside each micro-batch, so no data moves. Each
    micro-batch has the same size, so the mean of means is the full-batch mean exactly (a
    packed batch's dict is cut alike, field by field; its weights are normalised over the
    whole batch first, ``normalise_weights``, so the masked mean stays global too).
    With ``has_aux`` the loss is ``(loss, metrics)`` and metrics are averaged the same way.
    ``grad_fn`` replaces ``jax.value_and_grad(loss_fn)`` (the 1F1B pipeline schedule).
    """
    grad_fn = grad_fn or jax.value_and_grad(loss_fn, has_aux=has_aux)
    if microbatches == 1:
        return grad_fn(params, tokens_BL1)

    def cut(x_BL):  # [B, L] -> [m, B/m, L]
        b, l1 = x_BL.shape
        return x_BL.reshape(b // microbatches, microbatches, l1).swapaxes(0, 1)

    micro_MBL1 = jax.tree.map(cut, tokens_BL1)  # a packed batch's every array alike

    def body(carry, tokens_mb):
        loss_sum, grad_sum = carry
        tokens_mb = jax.tree.map(lambda x: constrain(x, BATCH_NAMES), tokens_mb)
        loss, grads = grad_fn(params, tokens_mb)
        loss_sum = jax.tree.map(jnp.add, loss_sum, loss)
        grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
        return (loss_sum, jax.lax.with_sharding_constraint(grad_sum, grad_shardings)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    first = jax.tree.map(lambda x: x[0], micro_MBL1)
    loss_zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(loss_fn, params, first))
    (loss_sum, grad_sum), _ = jax.lax.scan(body, (loss_zeros, zeros), micro_MBL1)
    return jax.tree.map(lambda g: g / microbatches, (loss_sum, grad_sum))


def build_eval_step(setup: TrainSetup):
    """``eval(params, batch) -> (loss, weight)``: one held-out batch's (masked) mean
    cross-entropy and the weight it carries, so that evaluation combines batches as
    ``sum(loss * weight) / sum(weight)``, a mean over all held-out tokens that count."""
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

    return jax.jit(eval_step, in_shardings=(setup.param_shardings, setup.batch_sharding))


def build_train_step(setup: TrainSetup):
    """``step(state, tokens) -> (state, metrics)``, jitted with the state donated.

    Gradients accumulate in ``setup.grad_shardings`` and enter the optimizer in
    ``setup.update_shardings`` (the ZeRO stage decides both). With ``offload_optimizer`` the
    optimizer state arrives in host memory, is moved to the device for the update and leaves
    to host memory again (the output shardings say so). With fp16 the loss is scaled, and a
    step with non-finite gradients changes neither parameters nor optimizer state.
    """
    if setup.cfg.optimizer.name == "onebit_adam":  # its update communicates: shard_map
        from shardlib.train.onebit import build_onebit_step

        return build_onebit_step(setup, make_loss_fn(setup, with_metrics=True))
    loss_fn = stop_base_gradients(make_loss_fn(setup, with_metrics=True), setup.cfg.lora.rank)
    tx, sched, cfg, plan = setup.tx, setup.schedule, setup.cfg, setup.plan
    scaled = precision.uses_loss_scale(cfg.precision)

    def train_step(state, tokens_BL1):
        with use_layout(setup.mesh, setup.rules):
            params = state["params"]
            tokens_BL1 = jax.tree.map(lambda x: constrain(x, BATCH_NAMES), tokens_BL1)
            tokens_BL1 = normalise_weights(tokens_BL1)  # packed: one global masked mean
            scale = state["loss_scale"]["scale"] if scaled else None

            def fn(p, t):
                loss, extra = loss_fn(p, t)
                return (loss * scale if scaled else loss), extra

            if plan.data.zeropp:  # quantized / hierarchical ZeRO-3 collectives
                grad_fn = zeropp.value_and_grad(setup, fn)
            else:  # the 1F1B pipeline computes its own (scaled) gradients
                grad_fn = grad_function(setup, fn, has_aux=True, loss_scale=scale)
            (loss, extra), grads = accumulate_grads(
                fn,
                params,
                tokens_BL1,
                plan.data.microbatches,
                setup.grad_shardings,
                grad_fn,
                has_aux=True,
            )
            if scaled:
                loss = loss / scale
                grads = jax.tree.map(lambda g: g / scale, grads)
            opt_state = state["opt_state"]
            if plan.offload.params:  # the update runs in device memory (grads too: d/d host)
                grads, opt_state, params = on_device((grads, opt_state, params))
            grads = jax.lax.with_sharding_constraint(grads, setup.update_shardings)
            if plan.offload.optimizer:
                opt_state = layouts.to_memory(opt_state, setup.opt_state_shardings, DEVICE_MEMORY)
            updates, new_opt_state = tx.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": global_norm(grads), "lr": sched(state["step"])}
        metrics.update(extra)  # what the model reports besides its logits (empty for Llama)
        new_state = {"params": new_params, "opt_state": new_opt_state, "step": state["step"] + 1}
        if scaled:
            finite = precision.all_finite(grads)
            new_state["params"] = precision.keep_if(finite, new_params, params)
            new_state["opt_state"] = precision.keep_if(finite, new_opt_state, opt_state)
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
