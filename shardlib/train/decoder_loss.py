"""The decoder's loss: next-token cross-entropy through the decoder protocol, the one loss
every layout and pipeline schedule trains on (``DecoderLoss``), and how a batch becomes its
inputs, targets and weights (``split_batch``, ``normalise_weights``).

Apart from the step (``train.step``) because the schedules run its parts apart: the 1F1B,
2BW and Chimera loops call ``embed``, ``block`` and ``head`` themselves
(``parallel.gradients``), the evaluation step and the NVMe tier call it whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from shardlib.core.model import embed_takes_positions
from shardlib.core.ops import Packed, run_blocks, use_matmul
from shardlib.parallel.layer_loop import cast_params, master_blocks
from shardlib.parallel.loss import chunked_cross_entropy
from shardlib.parallel.pipeline.stats import stats_tokens
from shardlib.train import fp8
from shardlib.train.optim import frozen_base

if TYPE_CHECKING:
    from shardlib.parallel.plan import ParallelPlan
    from shardlib.train.setup import TrainSetup


def split_batch(plan, batch):
    """(inputs [b, seq], targets [b, seq], positions, weights [b, seq] or None) of a batch.

    A batch is [b, seq + 1] token ids (the plain path: every target counts), or a prepared
    dataset's packed dict (``shardlib.dataset.loader``): ``tokens`` [b, seq + 1], ``weights``,
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


@dataclass(frozen=True, eq=False)
class DecoderLoss:
    """Mean next-token cross-entropy of one batch of [b, seq + 1] tokens (``split_batch``;
    a packed batch's is the weighted mean, its weights normalised by ``normalise_weights``).

    The model is driven through the decoder protocol: ``embed``, the plan's layer loop over
    the stacked ``blocks`` (remat, pipeline, offload) and ``head``. Blocks that return
    statistics besides the residual (an MoE router's) have them summed over the layers and
    handed to the model's ``aux``; its ``"loss"`` entry joins the objective and every entry
    is reported. Called whole, the loss is ``(params, batch) -> loss``, or ``(loss,
    metrics)`` with ``with_metrics`` (for ``has_aux=True``). Its parts (``split``, ``embed``,
    ``block``, ``head``) are what the 1F1B schedule runs apart (``parallel.gradients``), so
    every schedule trains on this one loss, its token order and its mask.
    """

    plan: ParallelPlan
    graphdef: nnx.GraphDef
    dtype: Any
    """Compute dtype; ``__call__`` casts the fp32 master weights to it once."""
    layers: Callable
    """The plan's layer loop (``ParallelPlan.layer_loop``)."""
    with_metrics: bool = False
    lora_rank: int = 0
    """With LoRA, the base weights are constants (``optim.frozen_base``)."""
    matmul: Callable | None = None
    """The blocks' projections' form (``ops.MatmulForm``): FP8's, or None (``jnp.einsum``).
    With FP8 ``params`` carries the scales under ``fp8.KEY`` (``fp8.with_meta``)."""

    def __call__(self, params, batch):
        params, meta = fp8.split_meta(params)
        params = frozen_base(params, self.lora_rank)
        params = cast_params(params, self.dtype, keep_blocks=master_blocks(self.plan))
        inputs_BL, targets_BL, positions_L, weights_BL = self.split(batch)
        block_graph, blocks_state = nnx.split(nnx.merge(self.graphdef, params).blocks)
        # the attention kernel and MoE exchange the plan picks; the precision's products
        with self.plan.ops(), use_matmul(self.matmul):
            x_BLD = self.embed(params, inputs_BL, positions_L)
            x_BLD, totals = run_blocks(
                block_graph, blocks_state, x_BLD, positions_L, layers=self.layers,
                layer_extras=meta,
            )  # fmt: skip
            loss, metrics = self.head(params, x_BLD, targets_BL, weights_BL, totals)
        return (loss, metrics) if self.with_metrics else loss

    def split(self, batch):
        return split_batch(self.plan, batch)

    def embed(self, params, inputs_BL, positions_L=None):
        """The model's embedding; the tokens' true positions go to a model whose embedding
        reads them (learned absolute positions: ``core.model.embed_takes_positions``)."""
        model = nnx.merge(self.graphdef, params)
        if positions_L is not None and embed_takes_positions(model):
            return model.embed(inputs_BL, positions_L=positions_L, dtype=self.dtype)
        return model.embed(inputs_BL, dtype=self.dtype)

    def block(self, block_graph, positions_L):
        def block_fn(layer_state, x):
            return nnx.merge(block_graph, layer_state)(x, positions_L)

        return block_fn

    def head(self, params, x_BLD, targets_BL, weights_BL, totals=None):
        """(loss, metrics): the cross-entropy (weighted where the batch carries weights)
        plus the router's auxiliary loss where the blocks returned statistics."""
        model = nnx.merge(self.graphdef, params)
        # under GPipe/circular ``totals`` are a micro-batch's (their mean over micro-batches)
        tokens = stats_tokens(self.plan.pipeline_spec(), x_BLD.shape[0] * x_BLD.shape[1])
        aux = {} if totals is None else model.aux(totals, tokens)
        ce = self.cross_entropy(params, x_BLD, targets_BL, weights_BL)
        metrics = {("aux_loss" if k == "loss" else k): v for k, v in aux.items()}
        if aux:
            metrics["ce_loss"] = ce
        return (ce + aux["loss"] if "loss" in aux else ce), metrics

    def cross_entropy(self, params, x_BLD, targets_BL, weights_BL) -> jax.Array:
        """Mean (weighted) cross-entropy of the model's head on ``x_BLD`` (``params`` in the
        compute dtype): whole, or in slices of the sequence with ``parallel.loss.chunk``."""
        chunk = self.plan.loss.chunk
        if chunk:  # the weights besides the blocks handed over apart (the head's among them)
            rest = {k: v for k, v in params.items() if k != "blocks"}

            def head(weights, x_BCD):
                model = nnx.merge(self.graphdef, {**params, **weights})
                return model.head(x_BCD, dtype=self.dtype)

            return chunked_cross_entropy(head, rest, x_BLD, targets_BL, weights_BL, chunk=chunk)
        model = nnx.merge(self.graphdef, params)
        logits_BLV = model.head(x_BLD, dtype=self.dtype)  # [batch, seq, vocab] fp32
        ce_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL)
        return ce_BL.mean() if weights_BL is None else (ce_BL * weights_BL).mean()


def make_loss_fn(setup: TrainSetup, *, with_metrics: bool = False, lora: bool = False):
    """The trainer's loss for this setup (``DecoderLoss``); ``lora``: the base weights are
    constants when the config trains LoRA adapters (the train step's loss)."""
    plan, dtype = setup.plan, setup.compute_dtype
    return DecoderLoss(
        plan=plan,
        graphdef=setup.graphdef,
        dtype=dtype,
        layers=plan.layer_loop(setup.workload, dtype),  # remat, pipeline, param offload
        with_metrics=with_metrics,
        lora_rank=setup.cfg.lora.rank if lora else 0,
        matmul=fp8.qdq_matmul if fp8.enabled(setup.cfg.precision) else None,
    )
