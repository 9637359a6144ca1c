"""Pipeline parallelism as a jitted SPMD transform of the stacked-layer loop (GSPMD style).

The model keeps its parameters stacked as ``[layers, ...]``; the ``layers`` rule maps that
dim to the ``stage`` mesh axis, so device s stores the contiguous block of layers
``[s·L/p, (s+1)·L/p)`` and per-device parameter bytes fall as 1/p. Inside the step the
stack is viewed as ``[p, v, k, ...]`` (p stages, v virtual stages per device, k layers per
virtual stage, L = p·v·k) and the pipeline runs as one ``lax.scan``:

* a state buffer ``[p, b, seq, embed]`` holds the micro-batch each stage works on; all
  stages run at once under ``vmap`` (``spmd_axis_name`` keeps the stage dim on its axis);
* after each iteration the buffer shifts by one stage (``jnp.roll`` on the stage-sharded
  dim, which XLA lowers to a collective-permute);
* stage 0 reads its input from, and stage p-1 writes its output to, one ``[m, b, ...]``
  buffer of micro-batches, so a micro-batch that leaves the last stage re-enters stage 0
  for its next round (circular schedule) or is done (GPipe, v = 1).

GPipe (v = 1) runs m + p - 1 iterations: the bubble is (p-1)/m of the ideal compute and
shows up as extra FLOPs. Circular (v > 1, layers assigned round-robin: virtual stage j =
r·p + s runs on device s) runs v·m + p - 1 iterations of L/v layers: bubble (p-1)/(m·v).
It needs m >= p so that a micro-batch is back in the buffer before stage 0 reads it.
Device s then needs layers that are not contiguous in the model's order, so the trainer
stores the stacked rows in stage order (``pipeline/storage.py``) and no weight moves.

The backward pass is ``jax.grad`` of the scan: GPipe keeps the residuals of every
iteration, so activation memory grows with m. ``pipeline/one_f_one_b.py`` has the schedule whose
memory does not ((interleaved) 1F1B, bubble (p-1)/(m·v) too). Every schedule runs once per
data replica under ``vmap`` (``pipeline/replicas.py``): gradients accumulate per replica in
the loop and are reduced over ``data`` once per step. Any m >= p that divides the
per-replica batch works (m >= p only for circular). Layers that do not divide into p·v
stages are padded with identity slots (``partition.py``). The ``[p, v, k, ...]``
views and micro-batch cuts both schedules share are in ``views.py``.

Blocks that return statistics (an MoE router's losses) have them carried with their
micro-batch (``stats.py``; such models run without data replicas, see ``layers``). A
sequence split splits the seq dim of the state and buffer like every activation's, and
attention kernels written with ``shard_map`` run inside the stage ``vmap``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from shardlib.core.errors import ShardingError
from shardlib.core.layout import constrain
from shardlib.core.mesh import Axis
from shardlib.core.resolve import resolve_spec
from shardlib.core.rules import Rules
from shardlib.parallel.pipeline.partition import balanced_stages, masked, pad_stages
from shardlib.parallel.pipeline.replicas import GATHER_WEIGHTS, replicas
from shardlib.parallel.pipeline.spec import SCHEDULE_ALIASES, SCHEDULES, PipelineSpec
from shardlib.parallel.pipeline.stats import (
    check_block_stats,
    join_carry,
    split_carry,
    stats_mean,
    stats_slots,
)
from shardlib.parallel.pipeline.storage import LayerOrder
from shardlib.parallel.pipeline.terapipe import check_terapipe
from shardlib.parallel.pipeline.views import (
    merge_microbatches,
    split_microbatches,
    stage_axes,
    stage_mask,
    stage_state,
    to_replicas,
    to_stages,
)

STATE_NAMES = ("stage", "batch", "seq", "embed")  # [p, b, seq, embed]
BUFFER_NAMES = (None, "batch", "seq", "embed")  # [m, b, seq, embed]
_PICKED = "pipeline_round_weights"  # a stage's layer, picked from [v, k, ...] per trip


_REARRANGE = frozenset(
    ("concatenate", "stack", "split", "reshape", "transpose", "squeeze", "expand_dims")
    + ("broadcast_in_dim", "dynamic_slice", "slice", "gather")
)


def _round_policy(prim, *_, **params) -> bool:
    """What a pipeline stage saves for its backward pass: everything it computes, but not
    its picked weights (``_PICKED``) nor what only rearranges values.

    A circular round's weights differ per loop trip, so any form of them the backward
    pass needs (a block's fused q/k/v or gate/up ``concatenate``, a reshaped matrix) would
    otherwise be saved once per trip: v·m + p - 1 copies of a round's weights (llama-small,
    8 devices: 230 MiB with them, 202 MiB without). Not saved, each is rebuilt in the
    backward pass from the master weights, which the loop keeps anyway.
    Rearranged activations are rebuilt from their (saved) inputs: the same bytes.
    """
    if str(prim) == "name":
        return params["name"] != _PICKED
    return str(prim) not in _REARRANGE


def pipeline_rules(*, axis: str = Axis.STAGE) -> Rules:
    """Stacked ``layers`` of parameters over ``axis``; the staged ``stage`` dim likewise."""
    return Rules(params={"layers": (axis,), "stage": (axis,)}, activations={"stage": (axis,)})


@dataclass(frozen=True)
class PipelineParallel:
    """``[parallel.pipeline]``: how the stacked layers run when the mesh has a ``stage`` axis."""

    axes: ClassVar[dict[str, str]] = {Axis.STAGE: "pipeline stages: layers split"}
    logical_names: ClassVar[dict[str, str]] = {
        "stage": "pipeline stages (leading dim of staged weights and of the state buffer)"
    }

    schedule: str = "gpipe"
    """gpipe | circular | 1f1b (1F1B; interleaved 1F1B with virtual_stages > 1; also spelled
    pipedream-flush) | chimera (bidirectional, ``pipeline/chimera.py``) | terapipe (token
    slices of the sequence, ``pipeline/terapipe.py``; microbatches = slices) | 2bw
    (PipeDream-2BW: no flush between steps, one step of weight staleness,
    ``pipeline/two_bw.py``); used when the mesh has a stage axis > 1."""
    microbatches: int = 0
    """Micro-batches streamed through the pipeline per batch (terapipe: token slices of the
    sequence); 0 = one per stage."""
    virtual_stages: int = 1
    """Circular or 1f1b (interleaved 1F1B) schedule: layer groups per device (v); the
    bubble falls to (p-1)/(m·v). 1f1b with v > 1 needs micro-batches a multiple of p."""
    stage_layers: tuple[int, ...] = ()
    """Real layers per (virtual) stage, first to last; () = L/(p·v) each, or, when that does
    not divide, ``pipeline.partition.balanced_stages`` (set by ``for_layers``). Uneven
    stages run identity slots up to the largest count and keep the stacked weights
    replicated over ``stage`` (a stage's slots are sliced from them: no regrouping, but
    p x the block memory)."""
    split_saved_inputs: bool = False
    """1f1b: keep each layer's saved input split over ``tensor`` until its backward (1/t of
    the ring of saved inputs, for one all-gather over ``tensor`` per layer and micro-batch
    in the backward: ``pipeline/stage_work.py``). Off: Megatron's 6-all-reduce count."""
    gather_weights: str = "microbatch"
    """microbatch | step: with an ``fsdp`` axis (or ZeRO-3), all-gather a stage's weights for
    every micro-batch (least memory; gradients are then reduce-scattered per micro-batch
    too), or once per step and keep them for all micro-batches (one gather and one gradient
    reduce-scatter per step, for a full copy of the stage's weights and gradients)."""

    def __post_init__(self) -> None:
        if self.schedule in SCHEDULE_ALIASES:  # the spelling users typed before the rename
            object.__setattr__(self, "schedule", SCHEDULE_ALIASES[self.schedule])
        if self.schedule not in SCHEDULES:
            raise ShardingError(
                f"pipeline_schedule={self.schedule!r}. Fix: one of {', '.join(SCHEDULES)}."
            )
        layers = self.stage_layers  # "1,2,2,1" on the command line, a list in TOML
        if isinstance(layers, str):
            layers = [x for x in layers.replace(" ", "").split(",") if x]
        try:
            object.__setattr__(self, "stage_layers", tuple(int(n) for n in layers))
        except (TypeError, ValueError):
            raise ShardingError(
                f"pipeline_stage_layers={self.stage_layers!r}. Fix: layers per stage, e.g. "
                "1,2,2,1 (or leave it empty)."
            ) from None
        if self.gather_weights not in GATHER_WEIGHTS:
            raise ShardingError(
                f"pipeline_gather_weights={self.gather_weights!r}. Fix: one of "
                f"{', '.join(GATHER_WEIGHTS)}."
            )

    def for_layers(self, layers: int, mesh_axes) -> PipelineParallel:
        """These settings for a model of ``layers`` blocks: the balanced uneven split when
        the layers do not divide into the stages (an explicit ``stage_layers`` is kept)."""
        groups = mesh_axes.get(Axis.STAGE, 1) * self.virtual_stages
        if groups == 1 or self.stage_layers or layers % groups == 0 or layers < groups:
            return self
        if self.virtual_stages > 1:  # refused by ``PipelineSpec.check``, with the reason
            return self
        return dataclasses.replace(self, stage_layers=balanced_stages(layers, groups))

    def rules(self, mesh_axes) -> list[Rules]:
        if Axis.STAGE not in mesh_axes:
            return []
        rules = pipeline_rules(axis=Axis.STAGE)
        if len(set(self.stage_layers)) > 1:  # uneven: the stored stack stays whole
            rules = rules.replace(params={"layers": ()})
        return [rules]

    def spec(self, mesh_axes) -> PipelineSpec | None:
        """The pipeline on this mesh, or None when it has no ``stage`` axis of size > 1."""
        p = mesh_axes.get(Axis.STAGE, 1)
        if p == 1:
            return None
        return PipelineSpec(
            stages=p,
            microbatches=self.microbatches or p,
            virtual_stages=self.virtual_stages,
            schedule=self.schedule,
            gather_weights=self.gather_weights,
            stage_layers=self.stage_layers,
            split_saved_inputs=self.split_saved_inputs,
        )

    def check(self, mesh_axes, rules: Rules, workload) -> None:
        """Schedule, divisibility and what a pipeline cannot carry, before compiling."""
        spec = self.spec(mesh_axes)
        if spec is None:
            return
        if workload.block_stats:  # an MoE router's losses: GPipe/circular carry them
            check_block_stats(spec.schedule)
        spec.check(workload.blocks, workload.micro_batch)
        if spec.schedule == "terapipe":  # slices of the sequence, not micro-batches
            stats, context = bool(workload.block_stats), mesh_axes.get(Axis.CONTEXT, 1)
            check_terapipe(spec, seq=workload.seq, block_stats=stats, context=context)
            what = f"terapipe slice ({workload.seq} tokens / {spec.microbatches})"
            n = workload.seq // spec.microbatches
            resolve_spec(
                what, (workload.micro_batch, n), ("batch", "seq"), rules, mesh_axes, "activations"
            )
            return
        b = workload.micro_batch // spec.microbatches
        what = f"pipeline micro-batch ({workload.micro_batch} sequences / {spec.microbatches})"
        resolve_spec(what, (b, workload.seq), ("batch", "seq"), rules, mesh_axes, "activations")


def pipeline_layers(spec: PipelineSpec, stage_layers):
    """A ``layers(block_fn, blocks_state, carry)`` running GPipe or circular over
    ``spec.stages``; ``carry`` is ``x_BLD`` or ``(x_BLD, totals)`` (block statistics).

    ``stage_layers`` applies k stacked blocks on one stage (``shardlib.core.ops.scan_blocks``,
    with a remat policy already around ``block_fn``).
    """
    p, m, v = spec.stages, spec.microbatches, spec.virtual_stages
    if spec.fused:
        raise ValueError(f"the {spec.schedule} schedule is a value_and_grad (one_f_one_b, chimera)")

    def layers(block_fn, blocks_state, carry):
        """One copy of the weights per data replica (one gradient reduction per step).

        With block statistics too: a replica's micro-batch holds only its own rows, but the
        model takes a statistic's batch means through ``ops.batch_mean`` (an MoE's
        load-balancing loss is a product of two), which the replicas complete over the
        whole batch; every replica then carries the same statistics, and one copy is kept.
        """
        reps = replicas(gather_weights=spec.gather_weights)
        if reps is None:
            return run(block_fn, blocks_state, carry)
        x_BLD, stats = split_carry(carry)
        x_spec = reps.outer.spec(("batch", "seq", "embed"))
        stats_R = jax.tree.map(lambda s: jnp.broadcast_to(s[None], (reps.count, *s.shape)), stats)
        out_R = reps.vmap(lambda w, x, st: run(block_fn, w, join_carry(x, st, carry)))(
            to_replicas(reps, blocks_state), reps.split_batch(x_BLD, x_spec), stats_R
        )
        x_R, stats_R = split_carry(out_R)
        stats = jax.tree.map(lambda s_R: jnp.mean(s_R, 0), stats_R)  # the replicas agree
        return join_carry(reps.merge_batch(x_R, x_spec), stats, carry)

    def pin_state(state):  # (x [p, b, seq, embed], stats [p, ...]) on their layouts
        x, stats = state
        return constrain(x, STATE_NAMES), jax.tree.map(
            lambda s: constrain(s, ("stage", *[None] * (s.ndim - 1))), stats
        )

    def run(block_fn, blocks_state, carry):
        x_BLD, stats = split_carry(carry)
        blocks_state, keep = pad_stages(blocks_state, spec.stage_layers)
        # every leaf [p, v, k, ...]: a local reshape of the trainer's stage-ordered rows
        staged = stage_state(blocks_state, p, v, stored=not LayerOrder.of_spec(spec).natural)
        if keep is not None:  # uneven stages: (weights, keep) slots
            staged, block_fn = (staged, to_stages(keep, None, p, v)), masked(block_fn)

        def run_stage(w_vk, repeat, stage_carry):
            # fp32 master weights in (their gradients accumulate in fp32), compute dtype here
            dtype = split_carry(stage_carry)[0].dtype

            # layer j of this trip's round, picked inside the block: not as the layer loop's
            # xs, whose slices (and the forms the block derives from them) the loop would
            # save per trip under circular, and whose loop-invariant forms it would hoist
            # and accumulate gradients for in that form under GPipe (39B-class width,
            # 8 layers, 8 devices: 27.1 GiB as xs, 24.5 GiB picked)
            def block(j, x):
                def pick(w):
                    w = jax.lax.dynamic_index_in_dim(w, repeat, 0, False)
                    w = jax.lax.dynamic_index_in_dim(w, j, 0, False)
                    return checkpoint_name(w.astype(dtype), _PICKED)

                return block_fn(jax.tree.map(pick, w_vk), x)

            # inside the remat policy's checkpoint (``stage_layers`` wraps the block): of two
            # nested checkpoints JAX follows the outer policy, so this one decides only
            # under remat=none (GPipe: repeat is always 0)
            block = jax.checkpoint(block, policy=_round_policy, prevent_cse=False)
            k = jax.tree.leaves(w_vk)[0].shape[1]
            return stage_layers(block, jnp.arange(k), stage_carry)

        all_stages = jax.vmap(run_stage, spmd_axis_name=stage_axes())
        # micro-batches: activations [m, b, seq, embed], statistics [m, ...] (from zero)
        buf = (constrain(split_microbatches(x_BLD, m), BUFFER_NAMES), stats_slots(stats, m))
        x_PBLD = jnp.zeros((p, *buf[0].shape[1:]), x_BLD.dtype)
        state = pin_state((x_PBLD, stats_slots(stats, p, lead="stage")))
        stage_ids = jnp.arange(p)

        def body(loop, t):
            state, buf = loop
            # stage 0 takes micro-batch t mod m: fresh input, or back for its next round
            take = jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, t % m, 0, False), buf)
            state = jax.tree.map(
                lambda s, b: jnp.where(stage_mask(p, s.ndim) == 0, b[None], s), state, take
            )
            repeat_P = jnp.clip((t - stage_ids) // m, 0, v - 1)
            out = pin_state(split_carry(all_stages(staged, repeat_P, join_carry(*state, carry))))
            # the last stage hands micro-batch (t - p + 1) mod m back to the buffer
            done = (t - (p - 1)) % m

            def hand_over(b, o):
                keep = jax.lax.dynamic_index_in_dim(b, done, 0, keepdims=False)
                new = jnp.where(t >= p - 1, o[p - 1], keep)
                return jax.lax.dynamic_update_index_in_dim(b, new, done, 0)

            buf = jax.tree.map(hand_over, buf, out)
            buf = (constrain(buf[0], BUFFER_NAMES), buf[1])
            # shift: stage s + 1 works next on what stage s just produced
            state = pin_state(jax.tree.map(lambda o: jnp.roll(o, 1, axis=0), out))
            return (state, buf), None

        (_, buf), _ = jax.lax.scan(body, (state, buf), jnp.arange(spec.iterations()))
        x_out = constrain(merge_microbatches(buf[0]), ("batch", "seq", "embed"))
        return join_carry(x_out, stats_mean(buf[1]), carry)

    return layers
