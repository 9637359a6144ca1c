"""Chimera (Li and Hoefler, SC21): two pipelines in opposite directions over one stage axis.

1F1B's bubble comes from the pipeline's ends: device 0 idles while the first micro-batch
fills the pipeline, device p-1 while the last drains. Chimera runs a second pipeline the
other way round over the same devices, so one pipeline's busy devices are the other's
idle ones. Device s holds two chunks: the *down* pipeline's stage s and the *up*
pipeline's stage p-1-s, i.e. each stage's weights twice over the stage axis (the paper's
doubled weights: here the stored [p, k, ...] rows and their flip over ``stage``, one
collective permute per step). Half the micro-batches go down, half up. In a trip a
device's forward and backward run the same chunk (``ChimeraSchedule.direction``), and its
layer scans read that chunk's layers one at a time from the two stacks
(``stage_work._layer_scan``), so no copy of the chunk is made per trip. Picking the chunk
whole from a [p, 2, k] stack kept, beside the stored rows, the stack (2 W, W one stage's
fp32 blocks), a picked chunk per forward and per backward and a layout copy: 108.4 GiB per
device on Megatron's 39B layout, 73.2 GiB read a layer at a time.

As in ``one_f_one_b`` forward and backward are written into one loop (the same stage
work: ``stage_work``, the same ring of saved layer inputs, the same lean hand-overs, the
same per-replica wrapper); what differs is the timetable (``chimera_timetable``): each
trip a device runs one forward and one backward of the direction the trip's parity gives
it, and hands its forward output on with ``roll(+1)`` (down) or ``roll(-1)`` (up), its
input cotangent the other way. The head runs on device p-1's down outputs and device 0's
up outputs, in the same trips (every other steady trip), the embedding on device 0's down
and device p-1's up inputs. The two replicas of each stage accumulate their gradients in
a [p, 2, k, ...] fp32 carry; after the loop the up chunk's is flipped back over ``stage``
and added to the down chunk's (one collective permute), so the step updates one copy and
the replicas stay identical, as the paper's gradient all-reduce between them does.

Each device executes m + p - 2 chunk forwards and backwards for m useful ones (1F1B:
m + p - 1); live saved inputs are 1F1B's ring of 2p - 1 slots; the weights (and their
fp32 gradient accumulator) are doubled, as in the paper (2 Mθ). Needs p and m even,
v = 1 (``PipelineSpec.check``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from shardlib.core.layout import constrain
from shardlib.parallel.pipeline.chimera_timetable import DOWN, UP, ChimeraSchedule
from shardlib.parallel.pipeline.gpipe import STATE_NAMES
from shardlib.parallel.pipeline.one_f_one_b import (
    ACCUMULATE,
    RING_NAMES,
    STAGE_SCOPE,
    masked_add,
    per_replica,
    pin_rest_grads,
)
from shardlib.parallel.pipeline.partition import pad_stages, unpad_stages
from shardlib.parallel.pipeline.spec import PipelineSpec
from shardlib.parallel.pipeline.stage_work import (
    device_work,
    handover,
    one_trip,
    split,
)
from shardlib.parallel.pipeline.views import (
    constrain_param,
    from_stages,
    split_microbatches,
    stage_axes,
    staged_names,
    to_stages,
    variable_names,
)


def doubled(w_pk: jax.Array) -> jax.Array:
    """[p, k, ...] -> [p, 2, k, ...]: device s's down stage s and up stage p-1-s (the
    uneven stages' keep mask, a few bytes: the weights stay two [p, k] stacks)."""
    return jnp.stack([w_pk, jnp.flip(w_pk, 0)], axis=1)


def chimera_value_and_grad(spec: PipelineSpec, *, block_fn, embed, head_loss, split_tokens=None):
    """``one_f_one_b_value_and_grad``'s contract (same arguments, same result), scheduled
    as Chimera: ``vg(rest, blocks_state, tokens_BL1, rest_shardings=None, loss_scale=None)
    -> (loss, grads_rest, grads_blocks_state)``."""
    split_tokens = split_tokens or (lambda t_BL1: (t_BL1[:, :-1], t_BL1[:, 1:]))
    sched = ChimeraSchedule(spec.stages, spec.microbatches)
    p, m = sched.p, sched.m

    def run(rest, blocks_state, tokens_BL1, rest_shardings, scale, sum_stages=True):
        blocks_state, keep = pad_stages(blocks_state, spec.stage_layers)  # [G·k, ...]
        keep_p2k = None if keep is None else doubled(to_stages(keep, None, p, 1)[:, 0])
        names = variable_names(blocks_state)
        leaves, treedef = jax.tree.flatten(blocks_state)
        p2k_names = [staged_names(n) for n in names]  # [p, 2, k, ...]: v's place
        pk_names = [None if n is None else (n[0], *n[2:]) for n in p2k_names]
        w_down = [  # [p, k, ...]: device s's down stage s, the stored rows themselves
            constrain_param(to_stages(w, n, p, 1)[:, 0], nn, "stage weights")
            for w, n, nn in zip(leaves, names, pk_names, strict=True)
        ]
        w_up = [  # [p, k, ...]: its up stage p-1-s, the paper's second weight copy
            constrain_param(jnp.flip(w, 0), n, "up stage weights")
            for w, n in zip(w_down, pk_names, strict=True)
        ]
        w_two = (w_down, w_up)
        axes = stage_axes()

        def pin(ws, ns, what):
            return [constrain_param(w, n, what) for w, n in zip(ws, ns, strict=True)]

        def pin_rest(tree_P):
            return pin_rest_grads(tree_P, rest_shardings)

        split_saved = spec.split_saved_inputs
        seed = scale / m  # d(scaled mean loss) / d(one micro-batch's mean loss)
        fwd_one, bwd_one, head_one, embed_grad = device_work(
            block_fn, treedef, embed, head_loss, split_saved=split_saved, seed=seed
        )

        # each device reads layer by layer from its two chunks the one its direction says
        fwd_all = jax.vmap(fwd_one, in_axes=(0, 0, 0, 0, None, 0), spmd_axis_name=axes)
        bwd_all = jax.vmap(bwd_one, spmd_axis_name=axes)
        head_all = jax.vmap(head_one, in_axes=(None, 0, 0), spmd_axis_name=axes)
        embed_all = jax.vmap(embed, in_axes=(None, 0), spmd_axis_name=axes)
        embed_grad_all = jax.vmap(embed_grad, in_axes=(None, 0, 0), spmd_axis_name=axes)

        inputs_MBL, targets_MBL = (
            constrain(split_microbatches(t_BL, m), (None, "batch", None))
            for t_BL in split_tokens(tokens_BL1)
        )
        x_aval = jax.eval_shape(embed, rest, inputs_MBL[0])
        k = w_down[0].shape[1]
        zeros_PBLD = handover(jnp.zeros((p, *x_aval.shape), x_aval.dtype), "stage hand-over")

        def saved(x, names):  # the layer inputs' layout while saved
            return split(x, names, "saved inputs") if split_saved else constrain(x, names)

        ring = saved(jnp.zeros((p, sched.ring_slots, k, *x_aval.shape), x_aval.dtype), RING_NAMES)
        s_P = jnp.arange(p)

        def ends(items, first: bool):
            """[p]: live items on a pipeline's first (embedding) or last (head) stage."""
            down_end, up_end = (0, p - 1) if first else (p - 1, 0)
            on = ((items.direction == DOWN) & (s_P == down_end)) | (
                (items.direction == UP) & (s_P == up_end)
            )
            return items.live & on

        def per_device(tokens_M, micro_P):  # [p, b, seq]: each device's micro-batch
            return constrain(tokens_M[micro_P], (None, "batch", None))

        def body(carry, t, *, fwd_on, bwd_on, head_on):
            fwd, bwd, ring, g_w, g_rest, loss_sum = carry
            d_P = sched.direction(t)  # [p]: the forward's and the backward's chunk
            if fwd_on:
                fi = sched.forward(t)
                starts = ends(fi, first=True).reshape(p, 1, 1, 1)
                x0 = embed_all(rest, per_device(inputs_MBL, fi.micro))
                x = constrain(jnp.where(starts, x0.astype(fwd.dtype), fwd), STATE_NAMES)
                with jax.named_scope(STAGE_SCOPE):
                    y, ring = fwd_all(w_two, keep_p2k, x, ring, t % sched.ring_slots, d_P)
                y = constrain(y, STATE_NAMES)
                ring = saved(ring, RING_NAMES)
                sent = handover(y, "stage output")
                down_in = jnp.roll(sent, 1, axis=0)  # device s-1's down output
                up_in = jnp.roll(sent, -1, axis=0)  # device s+1's up output
                nxt = sched.forward(t + 1).direction.reshape(p, 1, 1, 1)
                fwd = handover(jnp.where(nxt == DOWN, down_in, up_in), "stage input")
            if head_on:  # device p-1's down and device 0's up micro-batches are done
                done = ends(fi, first=False)
                loss_P, g_head_P, dy_head = head_all(rest, y, per_device(targets_MBL, fi.micro))
                g_rest = pin_rest(masked_add(g_rest, g_head_P, done))
                loss_sum = loss_sum + jnp.where(done, loss_P, 0)
            if bwd_on:
                bi = sched.backward(t)
                dy = bwd
                if head_on:  # the turn-around: the head's cotangent
                    dy = jnp.where(done.reshape(p, 1, 1, 1), dy_head, dy)
                dy = constrain(jnp.where(bi.live.reshape(p, 1, 1, 1), dy, 0), STATE_NAMES)
                with jax.named_scope(STAGE_SCOPE):
                    g_w, dx = bwd_all(w_two, keep_p2k, ring, bi.slot, dy, g_w, d_P)
                g_w = pin(g_w, p2k_names, "stage gradient")
                to_embed = ends(bi, first=True)  # the pipelines' first stages: embedding
                dx_embed = jnp.where(to_embed.reshape(p, 1, 1, 1), dx, 0)
                g_embed_P = embed_grad_all(rest, dx_embed, per_device(inputs_MBL, bi.micro))
                g_rest = pin_rest(masked_add(g_rest, g_embed_P, to_embed))
                sent = handover(dx, "stage cotangent")
                down_in = jnp.roll(sent, -1, axis=0)  # device s+1's down cotangent
                up_in = jnp.roll(sent, 1, axis=0)  # device s-1's up cotangent
                nxt = sched.backward(t + 1).direction.reshape(p, 1, 1, 1)
                bwd = handover(jnp.where(nxt == DOWN, down_in, up_in), "stage dy")
            return (fwd, bwd, ring, g_w, g_rest, loss_sum), None

        def phase(carry, start, length, **flags):
            """``length`` alike trips from ``start`` as one loop (a kept loop for one)."""
            if length == 0:
                return carry
            if length == 1:
                return one_trip(lambda t, c: body(c, t, **flags)[0], carry, start)
            step = lambda c, t: body(c, t, **flags)  # noqa: E731
            return jax.lax.scan(step, carry, start + jnp.arange(length, dtype=jnp.int32))[0]

        def steady(carry):
            """m - 1 trips from p - 1, the head in every other one (the first and last):
            (m-2)/2 pairs of (head, no head) in one loop, then the last head trip. Each trip
            of a pair is a loop of its own (``one_trip``): two trips written into one loop
            body make XLA keep a second copy of the ring and of the weights (+7 MB of 18 on
            the p = 4 toy decoder of ``test_pipeline_chimera``)."""
            start, pairs = sched.warmup, (m - 2) // 2

            def pair(c, t):
                c = phase(c, t, 1, fwd_on=True, bwd_on=True, head_on=True)
                return phase(c, t + 1, 1, fwd_on=True, bwd_on=True, head_on=False), None

            if pairs:
                ts = start + 2 * jnp.arange(pairs, dtype=jnp.int32)
                carry = jax.lax.scan(pair, carry, ts)[0]
            return phase(carry, start + 2 * pairs, 1, fwd_on=True, bwd_on=True, head_on=True)

        carry = (
            zeros_PBLD,
            zeros_PBLD,
            ring,
            pin(
                [jnp.zeros((p, 2, *w.shape[1:]), ACCUMULATE) for w in w_down],
                p2k_names,
                "stage gradient",
            ),
            pin_rest(jax.tree.map(lambda r: jnp.zeros((p, *r.shape), ACCUMULATE), rest)),
            jnp.zeros((p,), jnp.float32),
        )
        carry = phase(carry, 0, sched.warmup, fwd_on=True, bwd_on=False, head_on=False)
        carry = steady(carry)
        cool = sched.cooldown_start
        carry = phase(carry, cool, sched.warmup, fwd_on=False, bwd_on=True, head_on=False)
        _, _, _, g_w, g_rest_P, loss_sum = carry
        # the two replicas of each stage: device s's down chunk and device p-1-s's up chunk
        g_pk = [g[:, DOWN] + jnp.flip(g[:, UP], 0) for g in g_w]
        g_blocks = [
            constrain_param(unpad_stages(from_stages(g[:, None], n), spec.stage_layers), n, "grad")
            for g, n in zip(g_pk, names, strict=True)
        ]
        g_rest = g_rest_P
        if sum_stages:  # one reduction per step
            g_rest = jax.tree.map(lambda g: jnp.sum(g, 0), g_rest_P)
            if rest_shardings is not None:
                g_rest = jax.lax.with_sharding_constraint(g_rest, rest_shardings)
        return jnp.sum(loss_sum) / m * scale, g_rest, treedef.unflatten(g_blocks)

    return per_replica(spec, run)
