"""How the train step runs the model's stack of layers: remat, pipeline, parameter offload.

Everything is derived from the plan's remat, pipeline and offload sections and the mesh,
in this one place:

* ``remat`` wraps the per-layer ``block_fn`` in ``jax.checkpoint`` (parallel/remat.py);
  ``full`` outside a pipeline keeps each block's input split over ``tensor`` where the
  residual stream is replicated there (``partition_saved_inputs``); ``segments:k``/``sqrt``
  nest that per-layer policy in checkpointed segments of layers (``parallel.segments``);
* a ``stage`` mesh axis of size p > 1 switches the pipeline on: GPipe and circular replace
  the model's ``layers`` function (``pipeline/gpipe.py``); the 1F1B schedule replaces
  ``jax.value_and_grad`` itself and runs the loss's parts (``parallel/gradients.py``,
  ``pipeline/one_f_one_b.py``), so its loss runs this plain loop. The pipeline's
  micro-batches take the place of gradient accumulation's; the loss is the same mean over
  all of them;
* ``offload.params`` keeps the stacked block weights (and their optimizer state) in
  ``pinned_host`` memory; each scan iteration fetches its layer to the device and the
  fetched copy is never saved for the backward pass (it is fetched again there);
* ``offload.optimizer`` (``offload_grads.plan_sends_grads_to_host``): the blocks enter as
  fp32 master weights, each trip casts its layer and taps it so that its gradient leaves
  for host memory as the backward produces it; with the weights in files
  (``offload_nvme_params``) each trip reads its layer instead, forward and backward;
* under a pipeline the stacked block weights also enter the layer loop as fp32 master
  weights and each stage casts its own per loop trip, so that the per-replica gradients
  accumulated across micro-batches (``pipeline/replicas.py``) are summed in fp32 (one
  fp32 copy of a stage's gradients: +2 bytes per held parameter over bf16).

``ParallelPlan.layer_loop`` hands this to the trainer's loss.
Models plug in through the decoder protocol (``shardlib.core.model.Decoder``): ``embed``, the
stacked ``blocks`` and ``head``; the layer loop runs the blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from shardlib.core.ops import scan_blocks
from shardlib.parallel import offload_grads, offload_nvme_params
from shardlib.parallel.pipeline.gpipe import pipeline_layers
from shardlib.parallel.pipeline.storage import LayerOrder
from shardlib.parallel.pipeline.terapipe import terapipe_layers
from shardlib.parallel.remat import partition_saved_inputs, remat_block
from shardlib.parallel.segments import scan_segments

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


def _cast(block_fn, dtype):
    """``block_fn`` casting its layer's master weights to ``dtype`` first."""
    return lambda w, x: block_fn(jax.tree.map(lambda a: a.astype(dtype), w), x)


def _tapped(block_fn, dtype):
    """``block_fn`` of ``(layer weights, their gradient sink's row)``: the weights' gradient
    leaves for host memory as the backward produces it (``offload_grads``), in fp32."""

    def tapped(layer_and_sink, x):
        return block_fn(offload_grads.tap_layer(*layer_and_sink, dtype), x)

    return tapped


def _from_files(block_fn, dtype, files, treedef):
    """``block_fn`` of ``(layer index, gradient sink row)``: the layer's weights read from
    ``files`` (``offload_nvme_params``), never saved for the backward (read again there)."""

    def read(index_and_sink, x):
        i, sink_row = index_and_sink
        layer = offload_nvme_params.read(files, i, treedef)
        layer = jax.tree.map(lambda w: checkpoint_name(w, FETCHED), layer)
        return block_fn(offload_grads.tap_layer(layer, sink_row, dtype), x)

    return read


def master_blocks(plan) -> bool:
    """Whether the stacked blocks enter the layer loop as master weights: offloaded ones are
    cast per layer, pipelined ones per stage and loop trip (their per-replica gradients
    then accumulate in fp32 across micro-batches), and so are those whose gradients leave
    for host memory in the backward (``offload_grads``: fp32 gradients, as the update's)."""
    return (
        plan.offload.params
        or plan.pipeline_spec() is not None
        or offload_grads.plan_sends_grads_to_host(plan)
    )


def layer_loop(plan, workload, dtype):
    """The function that runs the model's blocks, for GPipe/circular/no pipeline."""
    remat = plan.remat.spec(workload)
    offload = plan.offload.params
    to_host = offload_grads.plan_sends_grads_to_host(plan)

    def stage_layers(block_fn, blocks_state, x):
        if offload:
            block_fn = _fetch(block_fn, dtype)
        files = offload_nvme_params.active() if to_host else None
        if to_host:  # within value_and_grad: the weights' gradients go to host memory
            blocks_state, sink = offload_grads.tapped_blocks(blocks_state)
            if sink is None:  # evaluation, or a loss traced outside the gradient
                block_fn = _cast(block_fn, dtype)
            elif files is not None:  # the weights in files: each trip reads its layer
                block_fn = _from_files(block_fn, dtype, files, jax.tree.structure(blocks_state))
                blocks_state = (jnp.arange(jax.tree.leaves(sink)[0].shape[0]), sink)
            else:
                block_fn, blocks_state = _tapped(block_fn, dtype), (blocks_state, sink)
        never_save = (FETCHED,) if offload or files is not None else ()
        if remat.mode == "full" and not never_save and spec is None and not remat.segments:
            block_fn = partition_saved_inputs(block_fn)  # split over tensor where replicated
        else:
            block_fn = remat_block(block_fn, remat, never_save=never_save)
        if remat.segments:
            return scan_segments(block_fn, blocks_state, x, remat.segments)
        return scan_blocks(block_fn, blocks_state, x)

    spec = plan.pipeline_spec()
    if spec is None:
        return stage_layers
    if spec.fused:  # evaluation: a plain scan, over the rows in layer order
        return in_layer_order(LayerOrder.of_spec(spec), stage_layers)
    if spec.schedule == "terapipe":
        return terapipe_layers(spec, stage_layers)
    return pipeline_layers(spec, stage_layers)


def in_layer_order(order: LayerOrder, stage_layers):
    """``stage_layers`` reading stage-ordered rows (``pipeline.storage``) in layer order: one
    regrouping per call, which only 1F1B's evaluation pays (its training loop is its own)."""
    if order.natural:
        return stage_layers

    def ordered(block_fn, blocks_state, x):
        return stage_layers(block_fn, jax.tree.map(order.natural_rows, blocks_state), x)

    return ordered


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
