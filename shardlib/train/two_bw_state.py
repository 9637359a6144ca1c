"""PipeDream-2BW's carry in the train state: its shapes, its layout, its empty value.

The no-flush loop (``parallel/pipeline/two_bw_loop.py``) hands the next step what is in
flight at the step boundary: hand-overs, the ring of saved layer inputs, the unfinished
batch's gradient sums, loss and tokens, and the ring's slot offset. The trainer keeps it
in the state under ``two_bw.CARRY`` (beside ``prev_params``), so that orbax checkpoints it
and a resumed run continues exactly. Its own module because ``TrainSetup`` only needs to
ask for it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.core.layout import mesh_axes, use_layout
from shardlib.core.mesh import Axis
from shardlib.core.rules import entry_axes
from shardlib.parallel.gradients import no_flush
from shardlib.parallel.pipeline.replicas import replicas

if TYPE_CHECKING:
    from shardlib.train.setup import TrainSetup


def carry_init(setup: TrainSetup):
    """``init_carry(params, tokens)``: an empty pipeline (``parallel.gradients.no_flush``);
    call it under the setup's layout (per data replica: a leading [R] dim)."""
    from shardlib.train.step import make_loss_fn

    return no_flush(setup.plan, make_loss_fn(setup), setup.step_layout)[0]


def carry_shapes(setup: TrainSetup) -> dict:
    """The carry's ShapeDtypeStructs for this setup's batch."""
    b, s = setup.cfg.dataset.batch, setup.cfg.dataset.seq
    tokens = jax.ShapeDtypeStruct((b, s + 1), jnp.int32)
    with use_layout(setup.mesh, setup.rules):
        return jax.eval_shape(carry_init(setup), setup.param_shapes, tokens)


def carry_shardings(setup: TrainSetup) -> dict:
    """The carry laid out as the loop computes it: a leading replica dim over the data
    replica axes (``pipeline.replicas``), [p, ...] over ``stage``, each gradient sum
    inside a stage as its parameter, the micro-batch rows over the batch's remaining axes
    (where they divide), the loss per stage."""
    mesh, shapes = setup.mesh, setup.carry_shapes
    with use_layout(mesh, setup.rules):
        reps = replicas(gather_weights=setup.plan.pipeline.gather_weights)
    lead = 0 if reps is None else 1  # the replica dim, over the replica axes
    batch = setup.batch_sharding.spec[0] if len(setup.batch_sharding.spec) else None
    inner = tuple(a for a in entry_axes(batch) if reps is None or a not in reps.axes)
    rows = shapes["fwd"].shape[lead + 1]
    sizes = mesh_axes(mesh)
    batch = inner if inner and rows % math.prod(sizes[a] for a in inner) == 0 else None

    def named(*spec):
        spec = P(*spec)
        return NamedSharding(mesh, spec if reps is None else reps.spec(spec))

    def staged_like(sharding, acc, w):  # [p, k, ...] laid out as its [L, ...] parameter
        whole = (acc.shape[lead] * acc.shape[lead + 1], *acc.shape[lead + 2 :])
        return (
            named(Axis.STAGE, None, *sharding.spec[1:]) if whole == w.shape else named(Axis.STAGE)
        )

    g_blocks = [
        staged_like(s, a, w)
        for s, a, w in zip(
            jax.tree.leaves(setup.param_shardings["blocks"]),
            shapes["g_blocks"],
            jax.tree.leaves(setup.param_shapes["blocks"]),
            strict=True,
        )
    ]
    rest = {k: v for k, v in setup.param_shardings.items() if k != "blocks"}
    tokens = named(None, batch)
    return {
        "fwd": named(Axis.STAGE, batch),
        "bwd": named(Axis.STAGE, batch),
        "ring": named(Axis.STAGE, None, None, batch),
        "g_blocks": g_blocks,
        "g_rest": jax.tree.map(lambda s: named(Axis.STAGE, *s.spec), rest),
        "loss": named(Axis.STAGE),
        "inputs": tokens,
        "targets": tokens,
        "slot0": named(),
    }
