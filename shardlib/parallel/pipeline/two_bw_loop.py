"""PipeDream-2BW's loop without a flush: 1F1B's steady state across step boundaries.

1F1B (``one_f_one_b``) runs p-1 warm-up trips (forwards only) and p-1 cool-down trips
(backwards only) every step: each device executes m+p-1 chunks for m useful ones. 2BW
(Narayanan et al. 2021, ICML) lets step k+1's micro-batches enter while step k's finish,
so every trip is a steady one: m trips per call, each device executing m forwards and m
backwards, the flush bubble gone. On device s, trip t (0 <= t < m) of a call runs

* the forward of micro-batch t - s (1F1B's), of the *previous* batch where negative
  (micro-batch m + t - s, which entered the pipeline in the previous call);
* the backward of micro-batch t - 2(p-1) + s, likewise of the previous batch where
  negative (the last 2p-2 trips of a batch's backwards spill into the next call, so
  m >= 2p-2 is needed for a batch to finish in the next call).

What crosses the boundary is the ``carry``: the two hand-over buffers, the ring of saved
layer inputs (2p-1 slots; trip t of call k writes slot k·m + t mod 2p-1, so nothing moves
between calls), the previous batch's partial fp32 gradient sums and loss, and its tokens
(for the heads and embedding gradients still to come). Its work runs on the weights it
started with, the previous call's: ``prev_rest`` / ``prev_blocks`` (the double buffer),
selected per device in the first 2p-2 trips of a call (a loop of their own); the rest of
the call runs on the current weights only.

``step(...)`` returns the previous batch's loss and gradients (complete after this call's
first 2p-2 trips) and the new carry; the current batch's come out of the next call. So
the optimizer applies, at the end of call k+1, the gradient of batch k taken at W(k):
W(k+2) = W(k+1) - lr·∇f_k(W(k)), the paper's rule. The first call's returned gradient
is of an empty pipeline (zeros flowed through it) and must not be applied.

As 1F1B's, the loop runs once per data replica (``per_replica``), so the stage's weight
gradients are reduced once per step, after the loop; the carry keeps the replica dim.
The trainer runs it through ``parallel.gradients.no_flush`` (``two_bw.py``). v = 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.core.errors import ShardingError
from shardlib.parallel.pipeline.partition import pad_stages, unpad_stages
from shardlib.parallel.pipeline.replicas import replicas
from shardlib.parallel.pipeline.spec import PipelineSpec
from shardlib.parallel.pipeline.stage_work import device_work, handover
from shardlib.parallel.pipeline.views import (
    from_replicas,
    from_stages,
    split_microbatches,
    stage_axes,
    to_replicas,
    to_stages,
    variable_names,
)

ACCUMULATE = jnp.float32


def check_no_flush(spec: PipelineSpec) -> None:
    """A batch's backwards spill 2p-2 trips into the next call: it needs m >= 2p-2."""
    p, m = spec.stages, spec.microbatches
    if spec.virtual_stages != 1:
        raise ShardingError(
            f"the 2bw loop with virtual_stages={spec.virtual_stages}. Fix: virtual_stages=1."
        )
    if m < 2 * p - 2:
        raise ShardingError(
            f"the 2bw loop with pipeline_microbatches={m} over {p} stages: a batch's last "
            f"backwards run 2p-2 = {2 * p - 2} trips into the next step, which has only {m}. "
            f"Fix: pipeline_microbatches >= {2 * p - 2}."
        )


def _pick(mask_P, prev, cur):
    """Per device: ``prev`` where ``mask_P`` ([p] bools: numpy in the steady part, where
    none is set, traced in the first 2p-2 trips), else ``cur`` ([p, ...])."""
    if isinstance(mask_P, np.ndarray) and not mask_P.any():
        return cur
    m = jnp.asarray(mask_P).reshape(-1, *([1] * (cur.ndim - 1)))
    return jnp.where(m, prev, cur)


def _either(flag, prev, cur):
    """``prev`` if ``flag`` (a Python bool, or a traced scalar in the first trips) else
    ``cur``, leaf by leaf."""
    if isinstance(flag, bool):
        return prev if flag else cur
    return jax.tree.map(lambda a, b: jnp.where(flag, a, b), prev, cur)


def two_bw_loop(spec: PipelineSpec, *, block_fn, embed, head_loss, split_tokens=None):
    """``(init_carry, step)`` for the no-flush loop (module docstring).

    ``init_carry(rest, blocks_state, tokens_BL1) -> carry``: an empty pipeline (zeros).
    ``step(rest, blocks, prev_rest, prev_blocks, carry, tokens_BL1, scale=1.0) -> (loss,
    grads_rest, grads_blocks, carry)``: the previous batch's mean loss and gradients.
    The parts are ``one_f_one_b_value_and_grad``'s.
    """
    check_no_flush(spec)
    split_tokens = split_tokens or (lambda t_BL1: (t_BL1[:, :-1], t_BL1[:, 1:]))
    p, m = spec.stages, spec.microbatches
    ring_slots, spill = 2 * p - 1, 2 * p - 2
    stage_ids = np.arange(p)

    def staged(blocks_state):
        blocks_state, keep = pad_stages(blocks_state, spec.stage_layers)
        keep_pk = None if keep is None else to_stages(keep, None, p, 1)[:, 0]
        names = variable_names(blocks_state)
        leaves, treedef = jax.tree.flatten(blocks_state)
        w_pk = [to_stages(w, n, p, 1)[:, 0] for w, n in zip(leaves, names, strict=True)]
        return w_pk, keep_pk, names, treedef

    def tokens_of(tokens_BL1):
        return [split_microbatches(t, m) for t in split_tokens(tokens_BL1)]  # [m, b, seq]

    def init_carry(rest, blocks_state, tokens_BL1):
        w_pk, _, _, _ = staged(blocks_state)
        inputs_MBL, targets_MBL = tokens_of(tokens_BL1)
        x = jax.eval_shape(embed, rest, inputs_MBL[0])
        k = w_pk[0].shape[1]
        zeros = jnp.zeros((p, *x.shape), x.dtype)
        return {
            "fwd": zeros,
            "bwd": zeros,
            "ring": jnp.zeros((p, ring_slots, k, *x.shape), x.dtype),
            "g_blocks": [jnp.zeros(w.shape, ACCUMULATE) for w in w_pk],
            "g_rest": jax.tree.map(lambda r: jnp.zeros((p, *r.shape), ACCUMULATE), rest),
            "loss": jnp.zeros((p,), jnp.float32),
            "inputs": inputs_MBL,
            "targets": targets_MBL,
            "slot0": jnp.zeros((), jnp.int32),
        }

    def step(rest, blocks_state, prev_rest, prev_blocks, carry, tokens_BL1, scale=1.0):
        scale = jnp.asarray(scale, jnp.float32)
        w_pk, keep_pk, names, treedef = staged(blocks_state)
        prev_w_pk = staged(prev_blocks)[0]
        axes = stage_axes()
        fwd_one, bwd_one, head_one, embed_grad = device_work(
            block_fn, treedef, embed, head_loss, split_saved=False, seed=scale / m
        )
        fwd_all = jax.vmap(fwd_one, in_axes=(0, 0, 0, 0, None), spmd_axis_name=axes)
        bwd_all = jax.vmap(bwd_one, spmd_axis_name=axes)
        # each stage's own targets, as 1F1B's (``one_f_one_b``): 2 fp32 logits-sized
        # buffers live in the head's backward, not 4
        head_all = jax.vmap(head_one, in_axes=(None, 0, 0), spmd_axis_name=axes)
        embed_grad_all = jax.vmap(embed_grad, in_axes=(None, 0, None), spmd_axis_name=axes)
        # each device embeds a micro-batch of its own (device 0's, t, is kept), as 1F1B's:
        # one embedding replicated over ``stage`` is split and all-reduced there by XLA
        embed_all = jax.vmap(embed, in_axes=(None, 0), spmd_axis_name=axes)
        inputs_MBL, targets_MBL = tokens_of(tokens_BL1)
        is_first, is_last = stage_ids == 0, stage_ids == p - 1
        slot0 = carry["slot0"]  # the ring slot of this call's trip 0 (calls so far x m, mod R)

        def micro(tokens_M, i):
            return jax.lax.dynamic_index_in_dim(tokens_M, jnp.clip(i, 0, m - 1), 0, False)

        def add(acc, new, on_P):
            on = jnp.asarray(on_P)
            return jax.tree.map(
                lambda a, b: a + jnp.where(on.reshape(-1, *([1] * (b.ndim - 1))), b, 0), acc, new
            )

        def trip(state, t, prev_f, prev_b):
            """One trip; ``prev_f`` / ``prev_b`` ([p] bools): the devices whose forward /
            backward is of the previous batch (traced in the first 2p-2 trips, all False
            as numpy in the steady part, which then selects nothing)."""
            fwd, bwd, ring, acc, g_rest, loss = state["cur"]
            p_acc, p_g_rest, p_loss = state["prev"]
            # forward: device 0 embeds micro-batch t (always this batch's)
            x0 = embed_all(rest, inputs_MBL[jnp.clip(t - stage_ids, 0, m - 1)])
            x = jnp.where(is_first.reshape(p, 1, 1, 1), x0, fwd)
            w = [_pick(prev_f, a, b) for a, b in zip(prev_w_pk, w_pk, strict=True)]
            y, ring = fwd_all(w, keep_pk, x, ring, jnp.mod(slot0 + t, ring_slots))
            # split over ``tensor`` while it moves, as 1F1B's hand-overs (SC21's scatter/gather)
            new_fwd = handover(jnp.roll(handover(y, "stage output"), 1, axis=0), "stage input")
            # head on device p-1: micro-batch t-(p-1), of the previous batch if negative
            head_prev = bool(prev_f[p - 1]) if isinstance(prev_f, np.ndarray) else prev_f[p - 1]
            # every stage's forward micro-batch's targets (device p-1's is the live one)
            i_P = jnp.clip(t - stage_ids + jnp.where(prev_f, m, 0), 0, m - 1)
            targets_P = _pick(prev_f, state["targets_prev"][i_P], targets_MBL[i_P])
            loss_P, g_head_P, dy_head = head_all(_either(head_prev, prev_rest, rest), y, targets_P)
            last_loss = jnp.where(is_last, loss_P, 0)
            # backward: device s runs micro-batch t-2(p-1)+s, from its forward's ring slot
            dy = jnp.where(is_last.reshape(p, 1, 1, 1), dy_head, bwd)
            slot_P = jnp.mod(slot0 + t - spill + 2 * jnp.arange(p), ring_slots)
            w = [_pick(prev_b, a, b) for a, b in zip(prev_w_pk, w_pk, strict=True)]
            acc_in = [_pick(prev_b, a, b) for a, b in zip(p_acc, acc, strict=True)]
            acc_out, dx = bwd_all(w, keep_pk, ring, slot_P, dy, acc_in)
            acc = [_pick(prev_b, b, o) for b, o in zip(acc, acc_out, strict=True)]
            p_acc = [_pick(prev_b, o, a) for a, o in zip(p_acc, acc_out, strict=True)]
            # device 0's input cotangent into the embedding, for the batch it belongs to
            grad_prev = bool(prev_b[0]) if isinstance(prev_b, np.ndarray) else prev_b[0]
            i_emb = t - spill + jnp.where(grad_prev, m, 0)
            src = _either(grad_prev, state["inputs_prev"], inputs_MBL)
            g_emb_P = embed_grad_all(_either(grad_prev, prev_rest, rest), dx, micro(src, i_emb))
            head_new, grad_new = jnp.logical_not(head_prev), jnp.logical_not(grad_prev)
            p_loss = p_loss + jnp.where(head_prev, last_loss, 0)
            loss = loss + jnp.where(head_new, last_loss, 0)
            both = jnp.logical_and
            p_g_rest = add(p_g_rest, g_head_P, both(is_last, head_prev))
            g_rest = add(g_rest, g_head_P, both(is_last, head_new))
            p_g_rest = add(p_g_rest, g_emb_P, both(is_first, grad_prev))
            g_rest = add(g_rest, g_emb_P, both(is_first, grad_new))
            new_bwd = handover(jnp.roll(handover(dx, "stage cotangent"), -1, axis=0), "stage dy")
            return {
                **state,
                "cur": (new_fwd, new_bwd, ring, acc, g_rest, loss),
                "prev": (p_acc, p_g_rest, p_loss),
            }

        zero_rest = jax.tree.map(lambda r: jnp.zeros((p, *r.shape), ACCUMULATE), rest)
        state = {
            "cur": (
                carry["fwd"],
                carry["bwd"],
                carry["ring"],
                [jnp.zeros(w.shape, ACCUMULATE) for w in w_pk],
                zero_rest,
                jnp.zeros((p,), jnp.float32),
            ),
            "prev": (carry["g_blocks"], carry["g_rest"], carry["loss"]),
            "inputs_prev": carry["inputs"],
            "targets_prev": carry["targets"],
        }

        def first(s, t):  # the previous batch's last work: per-device masks
            return trip(s, t, jnp.arange(p) > t, jnp.arange(p) < spill - t), None

        state = jax.lax.scan(first, state, jnp.arange(spill, dtype=jnp.int32))[0]
        if m > spill:  # the steady part: this batch's work only
            none = np.zeros(p, bool)

            def body(s, t):
                return trip(s, t, none, none), None

            state = jax.lax.scan(body, state, jnp.arange(spill, m, dtype=jnp.int32))[0]
        fwd, bwd, ring, acc, g_rest, loss = state["cur"]
        p_acc, p_g_rest, p_loss = state["prev"]
        g_blocks = [
            unpad_stages(from_stages(g[:, None], n), spec.stage_layers)
            for g, n in zip(p_acc, names, strict=True)
        ]
        new_carry = {
            "fwd": fwd,
            "bwd": bwd,
            "ring": ring,
            "g_blocks": acc,
            "g_rest": g_rest,
            "loss": loss,
            "inputs": inputs_MBL,
            "targets": targets_MBL,
            "slot0": jnp.mod(slot0 + m, ring_slots),  # the next call's trip 0's slot
        }
        g_rest_prev = jax.tree.map(lambda g: jnp.sum(g, 0), p_g_rest)
        loss_prev = jnp.sum(p_loss) / m * scale
        return loss_prev, g_rest_prev, treedef.unflatten(g_blocks), new_carry

    return per_replica(spec, init_carry, step)


def per_replica(spec: PipelineSpec, init_carry, step):
    """``init_carry`` and ``step`` run once per data replica (``pipeline.replicas``: the
    weights broadcast to a leading [R] dim, the batch split over it), so the stage's
    weight gradients are reduced once per step, after the loop, as 1F1B's are
    (``one_f_one_b.per_replica``). The carry keeps the [R] dim between steps."""

    def spread(reps, rest, blocks_state, rest_shardings):
        if rest_shardings is None:
            rest_shardings = jax.tree.map(lambda _: NamedSharding(reps.mesh, P()), rest)
        rest_R = jax.tree.map(lambda w, sh: reps.broadcast(w, sh.spec), rest, rest_shardings)
        return rest_R, to_replicas(reps, blocks_state), rest_shardings

    def init(rest, blocks_state, tokens_BL1):
        reps = replicas(gather_weights=spec.gather_weights)
        if reps is None:
            return init_carry(rest, blocks_state, tokens_BL1)
        tokens_R = reps.split_batch(tokens_BL1, reps.outer.spec(("batch", None)))
        rest_R, blocks_R, _ = spread(reps, rest, blocks_state, None)
        return reps.vmap(init_carry)(rest_R, blocks_R, tokens_R)

    def run(rest, blocks_state, prev_rest, prev_blocks, carry, tokens_BL1, scale=1.0,
            rest_shardings=None):  # fmt: skip
        reps = replicas(gather_weights=spec.gather_weights)
        if reps is None:
            return step(rest, blocks_state, prev_rest, prev_blocks, carry, tokens_BL1, scale)
        rest_R, blocks_R, rest_shardings = spread(reps, rest, blocks_state, rest_shardings)
        prev_rest_R, prev_blocks_R, _ = spread(reps, prev_rest, prev_blocks, rest_shardings)
        tokens_R = reps.split_batch(tokens_BL1, reps.outer.spec(("batch", None)))
        loss_R, g_rest_R, g_blocks_R, carry = reps.vmap(
            lambda r, b, pr, pb, c, t: step(r, b, pr, pb, c, t, scale)
        )(rest_R, blocks_R, prev_rest_R, prev_blocks_R, carry, tokens_R)
        g_rest = jax.tree.map(lambda g: jnp.mean(g, 0), g_rest_R)  # one reduction over R
        g_rest = jax.lax.with_sharding_constraint(g_rest, rest_shardings)
        return jnp.mean(loss_R), g_rest, from_replicas(g_blocks_R, blocks_state), carry

    return init, run
