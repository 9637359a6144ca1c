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
* a stage keeps its *input* from forward to backward (at most 2vp - 2 iterations later) in
  a ring of R = 2vp - 1 slots (slot = forward time mod R) and recomputes the chunk's
  forward inside the backward (``jax.vjp`` at the saved input): live activations are
  R·b·seq·embed per device plus one chunk's residuals, whatever m is;
* three static phases, so no iteration executes work that is never used: warm-up
  (vp - 1 iterations, forward only), steady (vm + p - vp, forward and backward), cool-down
  (vp - 1, backward only). Each device executes (vm + p - 1) chunk forwards and backwards
  for vm useful ones: bubble (p-1)/(v·m), exactly; the head and loss run only in the p of
  every vp steady iterations in which device p-1 finishes round v-1 (a nested scan with a
  static flag: its FLOPs are those of m micro-batches, not v·m + ... iterations);
* parameter gradients accumulate in fp32 in the loop carry; the carry holds one data
  replica's gradients (``pipeline.replicas``), so the data-parallel reduction runs once,
  after the loop. With fp16 the loss cotangent is seeded with loss_scale/m and the
  returned loss and gradients are scaled, as ``jax.value_and_grad`` of the scaled loss
  would be: the trainer unscales them and skips a non-finite step (``train/precision.py``).

Needs m % p == 0 when v > 1 (Megatron's rule); v = 1 takes any m. Costs one recomputed
chunk forward per micro-batch (~1.33x the FLOPs of the step without remat).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.core.layout import constrain
from shardlib.core.scopes import ONE_TRIP_SCOPE
from shardlib.parallel.pipeline.gpipe import STATE_NAMES, PipelineSpec
from shardlib.parallel.pipeline.partition import masked, pad_stages, unpad_stages
from shardlib.parallel.pipeline.replicas import replicas
from shardlib.parallel.pipeline.timetable import Schedule
from shardlib.parallel.pipeline.views import (
    constrain_param,
    from_stages,
    split_microbatches,
    stage_axes,
    stage_mask,
    staged_names,
    to_replicas,
    to_stages,
    variable_names,
)

RING_NAMES = ("stage", None, "batch", "seq", "embed")  # [p, R, b, seq, embed]
ACCUMULATE = jnp.float32  # gradients summed over micro-batches in the loop carry
STAGE_SCOPE = "pipeline_stage"  # named scope of the chunks' work (in profiles and op names)


def one_f_one_b_value_and_grad(
    spec: PipelineSpec, *, block_fn, stage_layers, embed, head_loss, split_tokens=None
):
    """``vg(rest, blocks_state, tokens_BL1, rest_shardings=None, loss_scale=None) -> (loss,
    grads_rest, grads_blocks_state)``, loss and gradients times ``loss_scale`` if given.

    ``split_tokens(tokens_BL1) -> (inputs_BL, targets_BL)`` puts a batch in the order the
    model sees it (default: the natural order); ``embed(rest, inputs_bl) -> x_bld`` runs
    before the blocks, ``head_loss(rest, x_bld, targets_bl) -> scalar mean loss`` after
    them; ``stage_layers(block_fn, w_k, x)`` applies one chunk's k stacked blocks. ``rest``
    are all parameters but the stacked blocks. The trainer passes its loss's own parts
    (``parallel.gradients``), traced under ``plan.ops()``.
    """
    split_tokens = split_tokens or (lambda t_BL1: (t_BL1[:, :-1], t_BL1[:, 1:]))
    sched = Schedule(spec.stages, spec.microbatches, spec.virtual_stages)
    p, m, v = sched.p, sched.m, sched.v

    def stage(w_k, keep_k, x):
        # fp32 master weights in (their gradients accumulate in fp32), compute dtype here
        w_k = jax.tree.map(lambda w: w.astype(x.dtype), w_k)
        if keep_k is None:
            return stage_layers(block_fn, w_k, x)
        return stage_layers(masked(block_fn), (w_k, keep_k), x)  # uneven: identity slots

    def stage_vjp(w_k, keep_k, x, dy):
        _, pullback = jax.vjp(lambda w, x: stage(w, keep_k, x), w_k, x)
        return pullback(dy)

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
        tokens_R = reps.split_batch(tokens_BL1, reps.outer.spec(("batch", None)))
        loss_R, g_rest_R, g_blocks_R = reps.vmap(lambda r, b, t: run(r, b, t, inner, scale))(
            rest_R, to_replicas(reps, blocks_state), tokens_R
        )
        g_rest = jax.tree.map(lambda g: jnp.mean(g, 0), g_rest_R)
        g_rest = jax.lax.with_sharding_constraint(g_rest, rest_shardings)
        g_leaves, treedef = jax.tree.flatten(g_blocks_R)
        names = variable_names(blocks_state)
        g_blocks = [
            constrain_param(jnp.mean(g, 0), n, "stacked gradient")
            for g, n in zip(g_leaves, names, strict=True)
        ]
        return jnp.mean(loss_R), g_rest, treedef.unflatten(g_blocks)

    def run(rest, blocks_state, tokens_BL1, rest_shardings, scale):
        blocks_state, keep = pad_stages(blocks_state, spec.stage_layers)  # [G·k, ...]
        keep_pvk = None if keep is None else to_stages(keep, None, p, v)
        names = variable_names(blocks_state)
        leaves, treedef = jax.tree.flatten(blocks_state)
        w_pvk = [to_stages(w, n, p, v) for w, n in zip(leaves, names, strict=True)]
        pvk_names = [staged_names(n) for n in names]
        pk_names = [None if n is None else (n[0], *n[2:]) for n in pvk_names]
        axes = stage_axes()

        def pin(ws, ns, what):
            return [constrain_param(w, n, what) for w, n in zip(ws, ns, strict=True)]

        def pin_rest(tree):
            if rest_shardings is None:
                return tree
            return jax.lax.with_sharding_constraint(tree, rest_shardings)

        pick = jax.vmap(lambda a, j: jax.lax.dynamic_index_in_dim(a, j, 0, False))

        def put(a, x, j):
            return jax.lax.dynamic_update_index_in_dim(a, x, j, 0)

        def chunks(r_P):
            """Each device's chunk r_P[s] of [p, v, k, ...] as [p, k, ...] (static: v = 1)."""
            ws = [w[:, 0] if v == 1 else pick(w, r_P) for w in w_pvk]
            kp = None if keep_pvk is None else keep_pvk[:, 0] if v == 1 else pick(keep_pvk, r_P)
            return pin(ws, pk_names, "stage weights"), kp

        def add_chunk(g_pvk, g_pk, r_P):
            """Accumulate one chunk's gradient into device s's chunk r_P[s] (fp32)."""
            g_pk = g_pk.astype(ACCUMULATE)
            if v == 1:
                return g_pvk + g_pk[:, None]
            return jax.vmap(put)(g_pvk, pick(g_pvk, r_P) + g_pk, r_P)

        fwd_all = jax.vmap(lambda w, kp, x: stage(treedef.unflatten(w), kp, x), spmd_axis_name=axes)

        def bwd_one(w, kp, x, dy):
            g_w, dx = stage_vjp(treedef.unflatten(w), kp, x, dy)
            return jax.tree.leaves(g_w), dx

        bwd_all = jax.vmap(bwd_one, spmd_axis_name=axes)

        inputs_MBL, targets_MBL = (
            constrain(split_microbatches(t_BL, m), (None, "batch", None))
            for t_BL in split_tokens(tokens_BL1)
        )
        x_aval = jax.eval_shape(embed, rest, inputs_MBL[0])
        zeros_PBLD = jnp.zeros((p, *x_aval.shape), x_aval.dtype)
        ring = jnp.zeros((p, sched.ring_slots, *x_aval.shape), x_aval.dtype)
        first, last = stage_mask(p, 4) == 0, stage_mask(p, 4) == p - 1
        seed = scale / m  # d(scaled mean loss) / d(one micro-batch's mean loss)

        def micro(tokens_M, i):
            return jax.lax.dynamic_index_in_dim(tokens_M, jnp.clip(i, 0, m - 1), 0, False)

        def body(carry, t, *, fwd_on: bool, bwd_on: bool, head_on: bool):
            fwd, bwd, ring, g_w, g_rest, loss_sum = carry
            g_rest_t = []
            if fwd_on:
                fi = sched.forward(t)
                # device 0 embeds in round 0; in later rounds it takes device p-1's output
                x0 = embed(rest, micro(inputs_MBL, fi.micro[0]))[None]
                x = jnp.where(first & (fi.round == 0).reshape(p, 1, 1, 1), x0, fwd)
                x = constrain(x, STATE_NAMES)
                ring = jax.lax.dynamic_update_index_in_dim(ring, x, t % sched.ring_slots, 1)
                ring = constrain(ring, RING_NAMES)
                w_pk, keep_pk = chunks(fi.round)
                with jax.named_scope(STAGE_SCOPE):
                    y = constrain(fwd_all(w_pk, keep_pk, x), STATE_NAMES)
                fwd = constrain(jnp.roll(y, 1, axis=0), STATE_NAMES)
            if head_on:  # device p-1 has just finished round v-1 of micro-batch i
                target = micro(targets_MBL, fi.micro[p - 1])
                y_last = constrain(y[p - 1], STATE_NAMES[1:])

                def scaled_loss(r, h):
                    loss = head_loss(r, h, target).astype(jnp.float32)
                    return loss * seed, loss

                _, head_pull, loss = jax.vjp(scaled_loss, rest, y_last, has_aux=True)
                g_head, dy_last = head_pull(jnp.ones((), jnp.float32))
                g_rest_t.append(g_head)
                loss_sum = loss_sum + loss
            if bwd_on:
                bi = sched.backward(t)
                dy = bwd
                if head_on:  # device p-1 is in round v-1: the head's cotangent
                    dy = jnp.where(last, constrain(dy_last, STATE_NAMES[1:])[None], dy)
                dy = jnp.where(bi.live.reshape(p, 1, 1, 1), dy, 0)
                x_saved = pick(ring, bi.slot)  # the input saved by its forward
                w_pk, keep_pk = chunks(bi.round)
                with jax.named_scope(STAGE_SCOPE):
                    g_w_t, dx = bwd_all(w_pk, keep_pk, x_saved, constrain(dy, STATE_NAMES))
                g_w = pin(
                    [add_chunk(a, b, bi.round) for a, b in zip(g_w, g_w_t, strict=True)],
                    pvk_names,
                    "stage gradient",
                )
                # device 0's round-0 input cotangent flows into the embedding
                to_embed = (bi.live[0] & (bi.round[0] == 0)).astype(dx.dtype)
                _, embed_pull = jax.vjp(lambda r: embed(r, micro(inputs_MBL, bi.micro[0])), rest)
                g_rest_t.append(embed_pull(dx[0] * to_embed)[0])
                bwd = constrain(jnp.roll(dx, -1, axis=0), STATE_NAMES)
            if g_rest_t:
                g_rest = pin_rest(
                    jax.tree.map(
                        lambda a, *b: a + sum(x.astype(ACCUMULATE) for x in b), g_rest, *g_rest_t
                    )
                )
            return (fwd, bwd, ring, g_w, g_rest, loss_sum), None

        def phase(carry, start, length, **flags):
            if length == 0:
                return carry
            if length == 1:  # v·p = 2: the ramps are one trip each; keep them loops
                return one_trip(lambda t, c: body(c, t, **flags)[0], carry, start)
            step = lambda c, t: body(c, t, **flags)  # noqa: E731
            return jax.lax.scan(step, carry, start + jnp.arange(length, dtype=jnp.int32))[0]

        def steady(carry):
            """Head in p of every vp iterations (device p-1 finishing round v-1)."""
            start = sched.warmup
            if v == 1:
                return phase(carry, start, m, fwd_on=True, bwd_on=True, head_on=True)
            vp = v * p

            def group(c, g):
                t0 = start + g * vp
                c = phase(c, t0, p, fwd_on=True, bwd_on=True, head_on=True)
                return phase(c, t0 + p, vp - p, fwd_on=True, bwd_on=True, head_on=False), None

            groups = m // p
            if groups > 1:
                carry = jax.lax.scan(group, carry, jnp.arange(groups - 1, dtype=jnp.int32))[0]
            return phase(
                carry, start + (groups - 1) * vp, p, fwd_on=True, bwd_on=True, head_on=True
            )

        carry = (
            zeros_PBLD,
            zeros_PBLD,
            ring,
            pin([jnp.zeros(w.shape, ACCUMULATE) for w in w_pvk], pvk_names, "stage gradient"),
            pin_rest(jax.tree.map(lambda r: jnp.zeros(r.shape, ACCUMULATE), rest)),
            jnp.zeros((), jnp.float32),
        )
        carry = phase(carry, 0, sched.warmup, fwd_on=True, bwd_on=False, head_on=False)
        carry = steady(carry)
        carry = phase(
            carry, sched.cooldown_start, sched.warmup, fwd_on=False, bwd_on=True, head_on=False
        )
        _, _, _, g_w, g_rest, loss_sum = carry
        g_blocks = [
            constrain_param(unpad_stages(from_stages(g, n), spec.stage_layers), n, "grad")
            for g, n in zip(g_w, names, strict=True)
        ]
        return loss_sum / m * scale, g_rest, treedef.unflatten(g_blocks)

    return value_and_grad


def one_trip(step, carry, t: int):
    """``step(t, carry)`` once, in a while loop XLA keeps (trip count hidden behind a barrier).

    XLA inlines a loop of one trip into its caller. The cool-down's buffers (its chunk's
    weights in compute layout, the zeroed stacks of residuals and weight gradients its
    layer scans fill) then live in the entry computation, where the CPU scheduler creates
    them before the steady loop and keeps them through it: +24 GiB per device on the 39B
    layout (tensor 8 x stage 2, fp32, m = 2), whose ramps are one trip. As a loop of its own
    they exist only while it runs. ``explain`` counts the loop once (``ONE_TRIP_SCOPE``).
    """
    with jax.named_scope(ONE_TRIP_SCOPE):
        t0 = jax.lax.optimization_barrier(jnp.int32(t))
        return jax.lax.fori_loop(t0, t0 + 1, step, carry)
