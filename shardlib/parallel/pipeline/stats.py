"""What a pipeline's stage loop carries besides the residual stream: the blocks' statistics.

A model whose blocks return ``(x, stats)`` (an MoE router's losses and loads) hands the layer
loop the carry ``(x_BLD, totals)`` (``shardlib.core.ops.run_blocks``), and the loss adds the
model's ``aux(totals)``. Under a pipeline the statistics of a micro-batch ride through the
stages with its activations: a ``[p, ...]`` slot per stage (the stage's blocks add to it, the
shift moves it on with the state) and an ``[m, ...]`` slot per micro-batch beside the
activation buffer (a circular round resumes from it). What a bubble iteration computes is
never handed over to the buffer, statistics included, so bubbles are masked by
construction.

The total is the mean over micro-batches (``stats_mean``), what gradient accumulation over
the same m micro-batches reports on one device: the pipeline's micro-batches take the place
of accumulation's (``shardlib/parallel/layer_loop.py``). GPipe and circular use these helpers
(``pipeline.pipeline_layers``); the 1F1B schedule computes its own per-stage vjp and
does not carry statistics yet (``PipelineParallel.check`` refuses such models there), and
would call the same helpers to do so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from shardlib.core.errors import ShardingError
from shardlib.core.layout import constrain
from shardlib.parallel.pipeline.spec import FUSED_SCHEDULES

if TYPE_CHECKING:
    from shardlib.parallel.pipeline.spec import PipelineSpec


def check_block_stats(schedule: str) -> None:
    """Refuse what cannot carry block statistics (the trainer's and the planner's refusal:
    one text): the 1F1B schedule. (Per-replica pipelines carry them: the replicas complete
    the statistics' batch means, ``ops.batch_mean``.)"""
    if schedule in FUSED_SCHEDULES:
        raise ShardingError(
            "this model's blocks return statistics (an MoE router's aux and z losses) and "
            f"pipeline_schedule={schedule} computes its own per-stage vjp, which does not yet "
            "carry block statistics between stages (pipeline/stats.py). Fix: "
            "pipeline_schedule=gpipe or circular (they carry them), or drop the stage axis."
        )


def split_carry(carry) -> tuple[jax.Array, dict]:
    """``(x, stats)`` of a layer-loop carry; ``stats`` is {} when the blocks return none."""
    return carry if isinstance(carry, tuple) else (carry, {})


def join_carry(x, stats, like):
    """The carry in the form ``like`` has: ``x`` alone, or ``(x, stats)``."""
    return (x, stats) if isinstance(like, tuple) else x


def stats_slots(stats, n: int, *, lead: str | None = None):
    """``n`` zeroed copies of every statistic, ``[n, ...]``; ``lead="stage"`` puts the dim
    on the stage axis (one slot per stage), None keeps it replicated (per micro-batch)."""

    def slots(s):
        out = jnp.zeros((n, *s.shape), s.dtype)
        return constrain(out, (lead, *([None] * s.ndim)), what="pipeline statistics")

    return jax.tree.map(slots, stats)


def stats_mean(stats_M):
    """One set of statistics from the m micro-batches' ``[m, ...]``: their mean, as gradient
    accumulation averages its micro-batches' losses and metrics. The blocks' statistics need
    not be linear in the batch (an MoE's load-balancing loss is a product of two batch means),
    so a pipeline of m micro-batches reports what ``data.microbatches = m`` does."""
    return jax.tree.map(lambda s_M: s_M.mean(0), stats_M)


def stats_tokens(spec: PipelineSpec | None, tokens: int) -> int:
    """Tokens one set of block statistics covers (the model's ``aux(totals, tokens)``): a
    micro-batch's under GPipe/circular (``stats_mean``), the batch's otherwise."""
    if spec is None or spec.fused:
        return tokens
    return tokens // spec.microbatches
