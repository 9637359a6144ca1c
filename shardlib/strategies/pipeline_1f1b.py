"""A memory-bounded pipeline schedule in the spirit of 1F1B, as one jitted SPMD loop.

GPipe under ``jax.grad`` runs every forward iteration before the first backward one, so it
keeps the residuals of all m micro-batches. 1F1B bounds memory by starting a micro-batch's
backward as soon as its forward has left the last stage. In one SPMD program that means
writing forward and backward into the *same* loop instead of differentiating the loop:

* iteration t, stage s runs the forward of micro-batch ``t - s`` and the backward of
  micro-batch ``t - 2(p-1) + s`` (all stages at once under ``vmap``);
* the last stage applies the head and the loss to its forward output and turns it into a
  cotangent in the same iteration (its backward starts right away);
* forward activations shift up a stage (``roll +1``), cotangents shift down (``roll -1``):
  two collective-permutes per iteration;
* each stage keeps only the *inputs* of its in-flight micro-batches in a ring of
  R = 2p - 1 slots (stage s needs 2(p-1-s) + 1 of them) and recomputes its forward
  inside the backward (``jax.vjp`` of the stage at the saved input): so live activations
  are R·b·seq·embed per device plus one stage's residuals, whatever m is;
* parameter gradients are accumulated in fp32 in the loop carry, loss = mean over
  micro-batches; the carry holds one data replica's gradients (``pipeline_replicas``), so
  the data-parallel reduction runs once, after the loop.

Costs, by construction: m + 2(p-1) iterations of one forward plus one backward
(bubble 2(p-1)/m, twice GPipe's in this lockstep form) and one recomputed forward per
stage and micro-batch (~1.33x the FLOPs of the step without remat). Only p stages
(v = 1) are supported.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.layout import constrain
from shardlib.strategies.pipeline import (
    STATE_NAMES,
    PipelineSpec,
    constrain_param,
    from_stages,
    split_microbatches,
    stage_axes,
    stage_mask,
    to_replicas,
    to_stages,
    variable_names,
)
from shardlib.strategies.pipeline_partition import masked, pad_stages, unpad_stages
from shardlib.strategies.pipeline_replicas import replicas

RING_NAMES = ("stage", None, "batch", "seq", "embed")  # [p, R, b, seq, embed]
ACCUMULATE = jnp.float32  # gradients summed over micro-batches in the loop carry


def bounded_value_and_grad(spec: PipelineSpec, *, block_fn, stage_layers, embed, head_loss):
    """``vg(rest, blocks_state, tokens_BL1) -> (loss, grads_rest, grads_blocks_state)``.

    ``embed(rest, tokens_bl) -> x_bld`` runs before the blocks, ``head_loss(rest, x_bld,
    targets_bl) -> scalar mean loss`` after them; ``stage_layers(block_fn, w_k, x)`` applies
    one stage's k stacked blocks. ``rest`` are all parameters but the stacked blocks.
    """
    p, m = spec.stages, spec.microbatches
    ring_slots = 2 * p - 1

    def stage(w_k, keep_k, x):
        # fp32 master weights in (their gradients accumulate in fp32), compute dtype here
        w_k = jax.tree.map(lambda w: w.astype(x.dtype), w_k)
        if keep_k is None:
            return stage_layers(block_fn, w_k, x)
        return stage_layers(masked(block_fn), (w_k, keep_k), x)  # uneven: identity slots

    def stage_vjp(w_k, keep_k, x, dy):
        _, pullback = jax.vjp(lambda w, x: stage(w, keep_k, x), w_k, x)
        return pullback(dy)

    def value_and_grad(rest, blocks_state, tokens_BL1, rest_shardings=None):
        """Per data replica (one gradient reduction per step, after the loop), then the mean."""
        reps = replicas(gather_weights=spec.gather_weights)
        if reps is None:
            return run(rest, blocks_state, tokens_BL1, rest_shardings)
        if rest_shardings is None:  # replicated: what the propagation would pick anyway
            rest_shardings = jax.tree.map(lambda _: NamedSharding(reps.mesh, P()), rest)
        rest_R = jax.tree.map(lambda w, s: reps.broadcast(w, s.spec), rest, rest_shardings)
        inner = jax.tree.map(reps.inner_sharding, rest_shardings)
        tokens_R = reps.split_batch(tokens_BL1, reps.outer.spec(("batch", None)))
        loss_R, g_rest_R, g_blocks_R = reps.vmap(lambda r, b, t: run(r, b, t, inner))(
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

    def run(rest, blocks_state, tokens_BL1, rest_shardings):
        blocks_state, keep = pad_stages(blocks_state, spec.stage_layers)  # [G·k, ...]
        keep_pk = None if keep is None else to_stages(keep, None, p, 1)[:, 0]
        names = variable_names(blocks_state)
        leaves, treedef = jax.tree.flatten(blocks_state)
        w_pk = [to_stages(w, n, p, 1)[:, 0] for w, n in zip(leaves, names, strict=True)]
        pk_names = [None if n is None else ("stage", None, *n[1:]) for n in names]

        def pin_w(ws):
            return [
                constrain_param(w, n, "stage gradient") for w, n in zip(ws, pk_names, strict=True)
            ]

        def pin_rest(tree):
            if rest_shardings is None:
                return tree
            return jax.lax.with_sharding_constraint(tree, rest_shardings)

        axes = stage_axes()
        fwd_all = jax.vmap(lambda w, kp, x: stage(treedef.unflatten(w), kp, x), spmd_axis_name=axes)

        def bwd_one(w, kp, x, dy):
            g_w, dx = stage_vjp(treedef.unflatten(w), kp, x, dy)
            return jax.tree.leaves(g_w), dx

        bwd_all = jax.vmap(bwd_one, spmd_axis_name=axes)
        pick = jax.vmap(lambda ring, j: jax.lax.dynamic_index_in_dim(ring, j, 0, False))

        micro_MBL1 = constrain(split_microbatches(tokens_BL1, m), (None, "batch", None))
        inputs_MBL, targets_MBL = micro_MBL1[:, :, :-1], micro_MBL1[:, :, 1:]
        x_aval = jax.eval_shape(embed, rest, inputs_MBL[0])
        zeros_PBLD = jnp.zeros((p, *x_aval.shape), x_aval.dtype)
        ring = jnp.zeros((p, ring_slots, *x_aval.shape), x_aval.dtype)
        stage_ids = jnp.arange(p)
        first, last = stage_mask(p, 4) == 0, stage_mask(p, 4) == p - 1

        def micro(tokens_M, i):
            return jax.lax.dynamic_index_in_dim(tokens_M, jnp.clip(i, 0, m - 1), 0, False)

        def body(carry, t):
            fwd, bwd, ring, g_w, g_rest, loss_sum = carry
            # forward: stage s runs micro-batch t - s; stage 0 embeds micro-batch t
            x = jnp.where(first, embed(rest, micro(inputs_MBL, t))[None], fwd)
            x = constrain(x, STATE_NAMES)
            ring = jax.lax.dynamic_update_index_in_dim(ring, x, t % ring_slots, 1)
            ring = constrain(ring, RING_NAMES)
            y = constrain(fwd_all(w_pk, keep_pk, x), STATE_NAMES)
            # the last stage's output goes through head and loss now: micro-batch t - p + 1
            i_last = t - (p - 1)
            on_last = (i_last >= 0) & (i_last < m)
            target = micro(targets_MBL, i_last)
            y_last = constrain(y[p - 1], STATE_NAMES[1:])
            loss, head_pull = jax.vjp(lambda r, h: head_loss(r, h, target), rest, y_last)
            g_head, dy_last = head_pull(jnp.where(on_last, 1.0 / m, 0.0).astype(loss.dtype))
            # backward: stage s runs micro-batch t - 2(p-1) + s from its saved input
            i_back = t - 2 * (p - 1) + stage_ids
            live = ((i_back >= 0) & (i_back < m)).reshape(p, 1, 1, 1)
            dy_last = constrain(dy_last, STATE_NAMES[1:])
            dy = jnp.where(live, jnp.where(last, dy_last[None], bwd), 0)
            x_saved = pick(ring, (i_back + stage_ids) % ring_slots)  # its forward slot
            g_w_t, dx = bwd_all(w_pk, keep_pk, x_saved, constrain(dy, STATE_NAMES))
            # stage 0's input cotangent flows into the embedding: micro-batch t - 2(p-1)
            _, embed_pull = jax.vjp(lambda r: embed(r, micro(inputs_MBL, i_back[0])), rest)
            (g_embed,) = embed_pull(dx[0])
            g_w = pin_w([a + b.astype(ACCUMULATE) for a, b in zip(g_w, g_w_t, strict=True)])
            g_rest = pin_rest(
                jax.tree.map(
                    lambda a, b, c: a + b.astype(ACCUMULATE) + c.astype(ACCUMULATE),
                    g_rest,
                    g_head,
                    g_embed,
                )
            )
            loss_sum = loss_sum + jnp.where(on_last, loss, 0.0)
            fwd = constrain(jnp.roll(y, 1, axis=0), STATE_NAMES)
            bwd = constrain(jnp.roll(dx, -1, axis=0), STATE_NAMES)
            return (fwd, bwd, ring, g_w, g_rest, loss_sum), None

        carry = (
            zeros_PBLD,
            zeros_PBLD,
            ring,
            pin_w([jnp.zeros(w.shape, ACCUMULATE) for w in w_pk]),
            pin_rest(jax.tree.map(lambda r: jnp.zeros(r.shape, ACCUMULATE), rest)),
            jnp.zeros((), jnp.float32),
        )
        (_, _, _, g_w, g_rest, loss_sum), _ = jax.lax.scan(
            body, carry, jnp.arange(spec.iterations())
        )
        g_blocks = [
            constrain_param(unpad_stages(from_stages(g[:, None], n), spec.stage_layers), n, "grad")
            for g, n in zip(g_w, names, strict=True)
        ]
        return loss_sum / m, g_rest, treedef.unflatten(g_blocks)

    return value_and_grad
