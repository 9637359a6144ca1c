"""How the train step runs the model's stack of layers: remat, pipeline, parameter offload.

Everything is derived from the plan's remat, pipeline and offload sections and the mesh,
in this one place:

* ``remat`` wraps the per-layer ``block_fn`` in ``jax.checkpoint`` (strategies/remat.py);
  ``full`` outside a pipeline keeps each block's input split over ``tensor`` where the
  residual stream is replicated there (``partition_saved_inputs``);
* a ``stage`` mesh axis of size p > 1 switches the pipeline on: GPipe and circular replace
  the model's ``layers`` function (strategies/pipeline.py), the 1F1B schedule replaces
  ``jax.value_and_grad`` itself (strategies/pipeline_1f1b.py). The pipeline's micro-batches
  take the place of gradient accumulation's; the loss is the same mean over all of them;
* ``offload.params`` keeps the stacked block weights (and their optimizer state) in
  ``pinned_host`` memory; each scan iteration fetches its layer to the device and the
  fetched copy is never saved for the backward pass (it is fetched again there);
* under a pipeline the stacked block weights also enter the layer loop as fp32 master
  weights and each stage casts its own per loop trip, so that the per-replica gradients
  accumulated across micro-batches (``strategies/pipeline_replicas.py``) are summed in
  fp32 (one fp32 copy of a stage's gradients: +2 bytes per held parameter over bf16).

``ParallelPlan.layer_loop`` and ``ParallelPlan.value_and_grad`` hand these to the trainer.
Models plug in through the decoder protocol (``shardlib.core.model.Decoder``): ``embed``, the
stacked ``blocks`` and ``head``; the layer loop runs the blocks.
"""

from __future__ import annotations

import jax
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from shardlib.core.ops import scan_blocks
from shardlib.parallel.pipeline.gpipe import PipelineSpec, pipeline_layers
from shardlib.parallel.pipeline.one_f_one_b import one_f_one_b_value_and_grad
from shardlib.parallel.remat import partition_saved_inputs, remat_block

FETCHED = "fetched_param"  # checkpoint name of a layer's weights fetched from host


def _fetch(block_fn, dtype):
    """``block_fn`` reading its layer's weights from host memory into the device."""

    def fetched(layer_state, x):
        layer_state = jax.tree.map(
            lambda w: checkpoint_name(
                jax.device_put(w, jax.memory.Space.Device).astype(dtype), FETCHED
            ),
            layer_state,
        )
        return block_fn(layer_state, x)

    return fetched


def master_blocks(plan) -> bool:
    """Whether the stacked blocks enter the layer loop as master weights: offloaded ones are
    cast per layer, pipelined ones per stage and loop trip (their per-replica gradients
    then accumulate in fp32 across micro-batches)."""
    return plan.offload.params or plan.pipeline_spec() is not None


def layer_loop(plan, target, dtype):
    """The function that runs the model's blocks, for GPipe/circular/no pipeline."""
    remat = plan.remat.spec(target)
    offload = plan.offload.params

    def stage_layers(block_fn, blocks_state, x):
        if offload:
            block_fn = _fetch(block_fn, dtype)
        if remat.mode == "full" and not offload and spec is None:
            block_fn = partition_saved_inputs(block_fn)  # split over tensor where replicated
        else:
            block_fn = remat_block(block_fn, remat, never_save=(FETCHED,) if offload else ())
        return scan_blocks(block_fn, blocks_state, x)

    spec = plan.pipeline_spec()
    if spec is None or spec.schedule == "1f1b":
        return stage_layers
    return pipeline_layers(spec, stage_layers)


def cast_params(params, dtype, *, keep_blocks: bool = False):
    """Master weights to the compute dtype; with ``keep_blocks`` (``master_blocks``) the
    stacked blocks are cast inside the layer loop instead (per layer or per stage)."""
    keep = {"blocks"} if keep_blocks else set()
    return {
        k: v if k in keep else jax.tree.map(lambda p: p.astype(dtype), v) for k, v in params.items()
    }


def on_device(tree):
    """The optimizer update runs on device memory (XLA cannot compute on pinned_host)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)


def make_grad_fn(
    plan,
    loss_fn,
    *,
    graphdef,
    dtype,
    target,
    rest_shardings=None,
    has_aux=False,
    loss_scale=None,
):
    """``(params, tokens) -> (loss, grads)``: ``jax.value_and_grad`` or the 1F1B pipeline.

    The 1F1B schedule computes its own gradients from the model's parts (``graphdef``:
    embed, blocks, head); ``rest_shardings`` pins the layout of the parameters outside the
    blocks. With ``has_aux`` the loss is ``(loss, metrics)``; the 1F1B schedule reports none.
    ``loss_scale`` (fp16): ``loss_fn`` already returns the scaled loss, which
    ``jax.value_and_grad`` differentiates as it is; the 1F1B schedule never calls
    ``loss_fn``, so it seeds its cotangents with the scale itself and returns the scaled
    loss and gradients the same way (the trainer unscales and checks them).
    """
    spec = plan.pipeline_spec()
    if spec is None or spec.schedule != "1f1b":
        return jax.value_and_grad(loss_fn, has_aux=has_aux)
    remat = plan.remat.spec(target)
    grad_fn = _one_f_one_b_grad_fn(spec, graphdef, dtype, remat, rest_shardings, loss_scale)
    if not has_aux:
        return grad_fn

    def with_aux(params, tokens_BL1):
        loss, grads = grad_fn(params, tokens_BL1)
        return (loss, {}), grads

    return with_aux


def _one_f_one_b_grad_fn(spec: PipelineSpec, graphdef, dtype, remat, rest_shardings, loss_scale):
    def value_and_grad(params, tokens_BL1):
        cast = cast_params(params, dtype, keep_blocks=True)  # blocks: cast per stage
        block_graph, blocks_state = nnx.split(nnx.merge(graphdef, cast).blocks)
        rest = {k: v for k, v in cast.items() if k != "blocks"}

        def model(r):
            return nnx.merge(graphdef, {**r, "blocks": cast["blocks"]})

        def embed(r, tokens_BL):
            return model(r).embed(tokens_BL, dtype=dtype)

        def head_loss(r, x_BLD, targets_BL):
            logits_BLV = model(r).head(x_BLD, dtype=dtype)
            return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL).mean()

        def block_fn(layer_state, x):
            return nnx.merge(block_graph, layer_state)(x, None)

        run = one_f_one_b_value_and_grad(
            spec,
            block_fn=remat_block(block_fn, remat),
            stage_layers=scan_blocks,
            embed=embed,
            head_loss=head_loss,
        )
        loss, g_rest, g_blocks = run(rest, blocks_state, tokens_BL1, rest_shardings, loss_scale)
        grads = {**g_rest, "blocks": nnx.to_pure_dict(g_blocks)}
        return loss, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)

    return value_and_grad
