"""Memory-1F1B pipeline: (interleaved) 1F1B as one jitted SPMD program.

GPipe under ``jax.grad`` runs every forward before the first backward, so it keeps the
residuals of all m micro-batches. 1F1B (Narayanan et al., SC21, sec. 2.2) bounds memory by
starting a micro-batch's backward as soon as its forward has left the last stage. In one
SPMD program that means writing forward and backward into the *same* loop instead of
differentiating the loop. Device s holds v virtual stages (chunks) r·p + s, r = 0..v-1
(``to_stages``' [p, v, k, ...] view, round-robin as the circular schedule's):

* forward work items in Megatron's order, groups of p micro-batches: at iteration t device
  s runs item u = t - s (0 <= u < v·m): group g = u // vp, round r = (u mod vp) // p,
  micro-batch i = g·p + u mod p, chunk r. Device p-1's output of round r is device 0's
  input of round r+1 in the very next iteration, so one ``roll(+1)`` carries both;
* backward mirrors it with offset D = vp - 1: device s runs item u' = t - D - (p-1-s),
  round v-1 - (u' mod vp) // p, cotangents ``roll(-1)``. The last virtual stage's backward
  runs in the iteration of its forward, after the head and the loss;
* a stage keeps the *input of each of its layers* from forward to backward (at most
  2vp - 2 iterations later) in a ring of R = 2vp - 1 slots of k layer inputs (slot =
  forward time mod R), and its backward re-runs each layer's forward once from that input,
  right before the layer's own backward (``stage_work``): Megatron's full recompute, 6
  tensor all-reduces per layer and micro-batch (5 compiled: the recompute stops before the
  MLP's output), and live activations R·k·b·seq·embed per device (1/t of it with
  ``pipeline.split_saved_inputs``) plus one layer's residuals, whatever m is;
* hand-overs as lean as Megatron's (SC21 section 4.1): a stage's output and input
  cotangent move split over ``tensor`` and are all-gathered on arrival; every stage runs
  the head on its own output and the embedding's gradient on its own cotangent (only
  device p-1's and device 0's count), so nothing is broadcast over ``stage`` per trip.
  The stages' copies of the embedding and head gradients are summed once, after the
  loop, in the data-parallel reduction's all-reduce (over data x stage);
* three static phases, so no iteration executes work that is never used: warm-up
  (vp - 1 iterations, forward only), steady (vm + p - vp, forward and backward), cool-down
  (vp - 1, backward only). Each device executes (vm + p - 1) chunk forwards and backwards
  for vm useful ones: bubble (p-1)/(v·m), exactly; the head and loss run only in the p of
  every vp steady iterations in which device p-1 finishes round v-1, the embedding and its
  gradient only in those where device 0 runs round 0 (static flags per trip, alike trips
  in one loop: ``trips``; ``Schedule.heads``, ``embeds``, ``embeds_grad``);
* parameter gradients accumulate in fp32 in the loop carry; the carry holds one data
  replica's gradients (``pipeline.replicas``), so the data-parallel reduction runs once,
  after the loop. With fp16 the loss cotangent is seeded with loss_scale/m and the
  returned loss and gradients are scaled, as ``jax.value_and_grad`` of the scaled loss
  would be: the trainer unscales them and skips a non-finite step (``train/precision.py``).

Needs m % p == 0 when v > 1 (Megatron's rule); v = 1 takes any m. Costs one recomputed
forward per layer and micro-batch (~1.33x the FLOPs of the step without remat), whatever
the remat policy: the schedule decides what is saved. With v > 1 the trainer keeps the
stacked rows in stage order (``pipeline.storage``), so each device already holds its
chunks and no weight moves, as in Megatron; from natural order (``to_stages`` with
``stored=False``) the view would regroup them over ``stage`` every step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.core.layout import active_layout, constrain
from shardlib.core.rules import entry_axes
from shardlib.parallel.pipeline.gpipe import STATE_NAMES
from shardlib.parallel.pipeline.partition import pad_stages, unpad_stages
from shardlib.parallel.pipeline.replicas import replicas
from shardlib.parallel.pipeline.spec import PipelineSpec
from shardlib.parallel.pipeline.stage_work import (
    device_work,
    handover,
    one_trip,
    split,
)
from shardlib.parallel.pipeline.storage import LayerOrder
from shardlib.parallel.pipeline.timetable import Schedule
from shardlib.parallel.pipeline.views import (
    batch_tree_names,
    constrain_param,
    from_replicas,
    from_stages,
    is_names,
    microbatched,
    stage_axes,
    stage_mask,
    staged_names,
    to_replicas,
    to_stages,
    variable_names,
)

RING_NAMES = ("stage", None, None, "batch", "seq", "embed")  # [p, R, k, b, seq, embed]
ACCUMULATE = jnp.float32  # gradients summed over micro-batches in the loop carry
STAGE_SCOPE = "pipeline_stage"  # named scope of the chunks' work (in profiles and op names)


def sum_replicas_and_stages(reps, g_RP: jax.Array) -> jax.Array:
    """Mean over replicas of the sum over stages of [R, p, ...], as one all-reduce over the
    replica and stage axes together (merged into one dim first: two reductions, one per
    axis, would each move the whole tensor)."""
    axes = stage_axes()
    if axes is None:
        return jnp.sum(g_RP, (0, 1)) / reps.count
    stage = entry_axes(axes)
    merged = g_RP.reshape(-1, *g_RP.shape[2:])
    spec = P((*reps.axes, *stage), *([P.UNCONSTRAINED] * (merged.ndim - 1)))
    merged = jax.lax.with_sharding_constraint(merged, NamedSharding(reps.mesh, spec))
    return jnp.sum(merged, 0) / reps.count


def pin_rest_grads(tree_P, rest_shardings):
    """Per-stage [p, ...] copies of the non-block gradients: stage-split, and inside a stage
    laid out as the parameters (unconstrained where no layout is given)."""
    axes = stage_axes()
    if axes is None:
        return tree_P
    mesh = active_layout()[0]

    def one(g, s):
        inner = (P.UNCONSTRAINED,) * (g.ndim - 1) if s is None else tuple(s.spec)
        inner += (None,) * (g.ndim - 1 - len(inner))
        return jax.lax.with_sharding_constraint(g, NamedSharding(mesh, P(axes, *inner)))

    shardings = rest_shardings or jax.tree.map(lambda _: None, tree_P)
    return jax.tree.map(one, tree_P, shardings, is_leaf=lambda x: x is None)


def masked_add(acc_P, new_P, on_P):
    """acc + new where ``on`` (per stage [p]), in fp32."""
    return jax.tree.map(
        lambda a, b: (
            a + jnp.where(on_P.reshape(-1, *([1] * (b.ndim - 1))), b, 0).astype(ACCUMULATE)
        ),
        acc_P,
        new_P,
    )


def per_replica(spec: PipelineSpec, run, batch_names=None):
    """``value_and_grad(rest, blocks_state, tokens_BL1, rest_shardings=None, loss_scale=None)``
    from a fused schedule's ``run(rest, blocks_state, tokens, rest_shardings, scale,
    sum_stages=True) -> (loss, g_rest, g_blocks)``: run per data replica (one gradient
    reduction per step, after the loop), then the mean. Shared by 1F1B and Chimera.
    ``batch_names``: a tree of logical names like the batch's (None: token rows)."""

    def value_and_grad(rest, blocks_state, tokens_BL1, rest_shardings=None, loss_scale=None):
        """Per data replica (one gradient reduction per step, after the loop), then the mean."""
        scale = jnp.float32(1.0) if loss_scale is None else jnp.asarray(loss_scale, jnp.float32)
        reps = replicas(gather_weights=spec.gather_weights)
        if reps is None:
            return run(rest, blocks_state, tokens_BL1, rest_shardings, scale)
        if rest_shardings is None:  # replicated: what the propagation would pick anyway
            rest_shardings = jax.tree.map(lambda _: NamedSharding(reps.mesh, P()), rest)
        rest_R = jax.tree.map(lambda w, s: reps.broadcast(w, s.spec), rest, rest_shardings)
        inner = jax.tree.map(reps.inner_sharding, rest_shardings)
        tokens_R = jax.tree.map(
            lambda n, x: reps.split_batch(x, reps.outer.spec(n)),
            batch_tree_names(tokens_BL1, batch_names),
            tokens_BL1,
            is_leaf=is_names,
        )
        loss_R, g_rest_RP, g_blocks_R = reps.vmap(
            lambda r, b, t: run(r, b, t, inner, scale, sum_stages=False)
        )(rest_R, to_replicas(reps, blocks_state), tokens_R)
        # the per-stage copies (embedding on stage 0, head on p-1) summed and the replicas
        # averaged in one reduction over both axes: about the data-parallel one's bytes alone
        g_rest = jax.tree.map(lambda g: sum_replicas_and_stages(reps, g), g_rest_RP)
        g_rest = jax.lax.with_sharding_constraint(g_rest, rest_shardings)
        return jnp.mean(loss_R), g_rest, from_replicas(g_blocks_R, blocks_state)

    return value_and_grad


def one_f_one_b_value_and_grad(
    spec: PipelineSpec, *, block_fn, embed, head_loss, split_tokens=None, batch_names=None
):
    """``vg(rest, blocks_state, tokens_BL1, rest_shardings=None, loss_scale=None) -> (loss,
    grads_rest, grads_blocks_state)``, loss and gradients times ``loss_scale`` if given.

    ``split_tokens(tokens_BL1) -> (inputs_BL, targets_BL)`` puts a batch in the order the
    model sees it (default: the natural order); ``embed(rest, inputs_bl) -> x_bld`` runs
    before the blocks, ``head_loss(rest, x_bld, targets_bl) -> scalar mean loss`` after
    them; ``block_fn(layer_state, x) -> x`` is one plain block (no ``jax.checkpoint``: the
    schedule decides what is saved, ``stage_work``). ``rest`` are all parameters but the
    stacked blocks. The trainer passes its loss's own parts (``parallel.gradients``), traced
    under ``plan.ops()``. ``batch_names``: the logical names of a batch that is a tree of
    arrays (a user's model's: ``split_tokens`` then returns two such trees); None: token rows.
    """
    split_tokens = split_tokens or (lambda t_BL1: (t_BL1[:, :-1], t_BL1[:, 1:]))
    sched = Schedule(spec.stages, spec.microbatches, spec.virtual_stages)
    p, m, v = sched.p, sched.m, sched.v
    stored = not LayerOrder.of_spec(spec).natural  # rows in stage order (``storage``)

    def run(rest, blocks_state, tokens_BL1, rest_shardings, scale, sum_stages=True):
        blocks_state, keep = pad_stages(blocks_state, spec.stage_layers)  # [G·k, ...]
        keep_pvk = None if keep is None else to_stages(keep, None, p, v)
        names = variable_names(blocks_state)
        leaves, treedef = jax.tree.flatten(blocks_state)
        w_pvk = [to_stages(w, n, p, v, stored) for w, n in zip(leaves, names, strict=True)]
        pvk_names = [staged_names(n) for n in names]
        pk_names = [None if n is None else (n[0], *n[2:]) for n in pvk_names]
        axes = stage_axes()

        def pin(ws, ns, what):
            return [constrain_param(w, n, what) for w, n in zip(ws, ns, strict=True)]

        def pin_rest(tree_P):
            return pin_rest_grads(tree_P, rest_shardings)

        pick = jax.vmap(lambda a, j: jax.lax.dynamic_index_in_dim(a, j, 0, False))

        def put(a, x, j):
            return jax.lax.dynamic_update_index_in_dim(a, x, j, 0)

        def chunks(r_P):
            """Each device's chunk r_P[s] of [p, v, k, ...] as [p, k, ...] (static: v = 1)."""
            ws = [w[:, 0] if v == 1 else pick(w, r_P) for w in w_pvk]
            kp = None if keep_pvk is None else keep_pvk[:, 0] if v == 1 else pick(keep_pvk, r_P)
            return pin(ws, pk_names, "stage weights"), kp

        # the fp32 gradient accumulator: [p, v, k, ...], or [p, k, ...] for v = 1 (a slice
        # and an update of a [p, 1, k] one would copy all of it every trip)
        acc_names = pk_names if v == 1 else pvk_names

        def acc_chunk(g_acc, r_P):
            """Device s's chunk r_P[s] of the accumulator, [p, k, ...]."""
            return g_acc if v == 1 else pick(g_acc, r_P)

        def put_chunk(g_acc, g_pk, r_P):
            return g_pk if v == 1 else jax.vmap(put)(g_acc, g_pk, r_P)

        split_saved = spec.split_saved_inputs
        seed = scale / m  # d(scaled mean loss) / d(one micro-batch's mean loss)
        fwd_one, bwd_one, head_one, embed_grad = device_work(
            block_fn, treedef, embed, head_loss, split_saved=split_saved, seed=seed
        )

        fwd_all = jax.vmap(fwd_one, in_axes=(0, 0, 0, 0, None), spmd_axis_name=axes)
        bwd_all = jax.vmap(bwd_one, spmd_axis_name=axes)
        # each stage's own targets (in_axes=0), as Chimera's: the head backward's one-hot
        # then has the stage dim and adds in place into the softmax's gradient (2 fp32
        # logits-sized buffers live, not 4 as with one micro-batch's targets shared)
        head_all = jax.vmap(head_one, in_axes=(None, 0, 0), spmd_axis_name=axes)
        embed_grad_all = jax.vmap(embed_grad, in_axes=(None, 0, None), spmd_axis_name=axes)
        # every device embeds its own stage's tokens (only device 0's is kept), as Chimera's:
        # one micro-batch's embedding, replicated over ``stage``, XLA split over the stage
        # devices and all-reduced there in every trip (twice a hand-over's bytes on ``stage``)
        embed_all = jax.vmap(embed, in_axes=(None, 0), spmd_axis_name=axes)

        inputs_MBL, targets_MBL = (
            microbatched(t_BL, batch_names, m) for t_BL in split_tokens(tokens_BL1)
        )
        x_aval = jax.eval_shape(embed, rest, jax.tree.map(lambda t: t[0], inputs_MBL))
        k = w_pvk[0].shape[2]
        zeros_PBLD = handover(jnp.zeros((p, *x_aval.shape), x_aval.dtype), "stage hand-over")

        def saved(x, names):  # the layer inputs' layout while saved
            return split(x, names, "saved inputs") if split_saved else constrain(x, names)

        ring = saved(jnp.zeros((p, sched.ring_slots, k, *x_aval.shape), x_aval.dtype), RING_NAMES)
        first, last = stage_mask(p, 4) == 0, stage_mask(p, 4) == p - 1
        is_last = jnp.arange(p) == p - 1

        def micro(tokens_M, i):  # micro-batch i of every array
            i = jnp.clip(i, 0, m - 1)
            return jax.tree.map(lambda t: jax.lax.dynamic_index_in_dim(t, i, 0, False), tokens_M)

        def per_stage(tokens_M, i_P):  # [p, b, ...]: micro-batch i_P[s] of stage s
            return jax.tree.map(lambda t: t[jnp.clip(i_P, 0, m - 1)], tokens_M)

        def body(carry, t, *, fwd_on, bwd_on, head_on, embed_on, embed_grad_on):
            fwd, bwd, ring, g_w, g_rest, loss_sum = carry
            if fwd_on:
                fi = sched.forward(t)
                # device 0 embeds in round 0; in later rounds it takes device p-1's output
                x = fwd
                if embed_on:  # only in the trips where device 0 runs round 0
                    x0 = embed_all(rest, per_stage(inputs_MBL, fi.micro))
                    x = jnp.where(first & (fi.round == 0).reshape(p, 1, 1, 1), x0, fwd)
                x = constrain(x, STATE_NAMES)
                w_pk, keep_pk = chunks(fi.round)
                with jax.named_scope(STAGE_SCOPE):
                    y, ring = fwd_all(w_pk, keep_pk, x, ring, t % sched.ring_slots)
                y = constrain(y, STATE_NAMES)
                ring = saved(ring, RING_NAMES)
                fwd = handover(jnp.roll(handover(y, "stage output"), 1, axis=0), "stage input")
            if head_on:  # device p-1 has just finished round v-1 of micro-batch i
                targets_P = per_stage(targets_MBL, fi.micro)  # stage p-1's: the live one
                loss_P, g_head_P, dy_head = head_all(rest, y, targets_P)
                g_rest = pin_rest(masked_add(g_rest, g_head_P, is_last))
                loss_sum = loss_sum + jnp.where(is_last, loss_P, 0)
            if bwd_on:
                bi = sched.backward(t)
                dy = bwd
                if head_on:  # device p-1 is in round v-1: the head's cotangent
                    dy = jnp.where(last, dy_head, dy)
                dy = jnp.where(bi.live.reshape(p, 1, 1, 1), dy, 0)
                w_pk, keep_pk = chunks(bi.round)
                with jax.named_scope(STAGE_SCOPE):
                    acc = pin([acc_chunk(g, bi.round) for g in g_w], pk_names, "chunk gradient")
                    dy = constrain(dy, STATE_NAMES)  # the inputs its forward saved: ring[bi.slot]
                    acc, dx = bwd_all(w_pk, keep_pk, ring, bi.slot, dy, acc)
                g_w = pin(
                    [put_chunk(a, b, bi.round) for a, b in zip(g_w, acc, strict=True)],
                    acc_names,
                    "stage gradient",
                )
                if embed_grad_on:  # device 0's round-0 input cotangent, into the embedding
                    to_embed = bi.live & (bi.round == 0) & (jnp.arange(p) == 0)
                    dx_embed = jnp.where(to_embed.reshape(p, 1, 1, 1), dx, 0)
                    g_embed_P = embed_grad_all(rest, dx_embed, micro(inputs_MBL, bi.micro[0]))
                    g_rest = pin_rest(masked_add(g_rest, g_embed_P, to_embed))
                bwd = handover(jnp.roll(handover(dx, "stage cotangent"), -1, axis=0), "stage dy")
            return (fwd, bwd, ring, g_w, g_rest, loss_sum), None

        def phase(carry, start, length, **flags):
            if length == 0:
                return carry
            if length == 1:  # v·p = 2: the ramps are one trip each; keep them loops
                return one_trip(lambda t, c: body(c, t, **flags)[0], carry, start)
            step = lambda c, t: body(c, t, **flags)  # noqa: E731
            return jax.lax.scan(step, carry, start + jnp.arange(length, dtype=jnp.int32))[0]

        def trips(carry, start, first, count, **on):
            """Trips ``start`` .. ``start + count - 1`` (``start`` may be traced; ``first``
            is a static trip with the same offsets mod vp), each with only the work some
            device has in it: the head, the embedding and its gradient run in the trips
            ``Schedule`` names (all of them for v = 1), consecutive alike trips in one loop."""
            runs: list[list] = []
            for o in range(count):
                t = first + o
                flags = dict(
                    on,
                    head_on=on["fwd_on"] and on["bwd_on"] and sched.heads(t),
                    embed_on=on["fwd_on"] and sched.embeds(t),
                    embed_grad_on=on["bwd_on"] and sched.embeds_grad(t),
                )
                if runs and runs[-1][2] == flags:
                    runs[-1][1] += 1
                else:
                    runs.append([o, 1, flags])
            for o, n, flags in runs:
                carry = phase(carry, start + o, n, **flags)
            return carry

        def steady(carry):
            """v·m + p - vp trips: one of m for v = 1, else m/p groups of vp alike trips."""
            start = sched.warmup
            if v == 1:
                return trips(carry, start, start, sched.steady, fwd_on=True, bwd_on=True)
            vp = v * p

            def group(c, g):
                return trips(c, start + g * vp, start, vp, fwd_on=True, bwd_on=True), None

            groups = m // p
            if groups > 1:
                carry = jax.lax.scan(group, carry, jnp.arange(groups - 1, dtype=jnp.int32))[0]
            last = start + (groups - 1) * vp  # the last group's first p trips: v·m + p - vp
            return trips(carry, last, last, sched.steady - (groups - 1) * vp, fwd_on=True,
                         bwd_on=True)  # fmt: skip

        carry = (
            zeros_PBLD,
            zeros_PBLD,
            ring,
            pin(
                [
                    jnp.zeros(w.shape[:1] + w.shape[2:] if v == 1 else w.shape, ACCUMULATE)
                    for w in w_pvk
                ],
                acc_names,
                "stage gradient",
            ),
            pin_rest(jax.tree.map(lambda r: jnp.zeros((p, *r.shape), ACCUMULATE), rest)),
            jnp.zeros((p,), jnp.float32),
        )
        carry = trips(carry, 0, 0, sched.warmup, fwd_on=True, bwd_on=False)
        carry = steady(carry)
        cool = sched.cooldown_start
        carry = trips(carry, cool, cool, sched.warmup, fwd_on=False, bwd_on=True)
        _, _, _, g_w, g_rest_P, loss_sum = carry
        g_w = [g[:, None] if v == 1 else g for g in g_w]  # [p, v, k, ...]
        g_blocks = [
            constrain_param(unpad_stages(from_stages(g, n, stored), spec.stage_layers), n, "grad")
            for g, n in zip(g_w, names, strict=True)
        ]
        g_rest = g_rest_P
        if sum_stages:  # one reduction per step
            g_rest = jax.tree.map(lambda g: jnp.sum(g, 0), g_rest_P)
            if rest_shardings is not None:
                g_rest = jax.lax.with_sharding_constraint(g_rest, rest_shardings)
        return jnp.sum(loss_sum) / m * scale, g_rest, treedef.unflatten(g_blocks)

    return per_replica(spec, run, batch_names)
