"""TeraPipe (Li et al. 2021): a causal LM's sequence pipelined token slice by token slice.

GPipe fills its stages with micro-batches, so a batch of 1 or 2 long sequences leaves
them idle. A causal layer's output at a token depends only on the tokens before it, so
the sequence itself can be cut: s equal slices of L/s tokens flow through the p stages one
after another, in the place GPipe's micro-batches take. Slice j's attention at a stage
needs the keys/values of slices 0..j-1 at the same layers: the stage computed them in its
earlier trips and keeps them in a buffer ``[k layers, b, seq, kv_heads, head_dim]`` (K and
V), carried through the loop per stage. Slice j's own keys/values are written into it at
offset j·L/s, and its queries attend over the whole buffer with the causal mask by true
position (later slots are masked): the same score FLOPs as one device's dense attention.

The block stays the model's: ``core.token_slice`` tells ``ops.run_blocks`` the slice's true
positions (rotary) and ``ops.attention`` the buffer, and the attention call leaves its own
keys/values there for this loop. Loop: s + p - 1 trips of one slice per stage, so a stage
executes (s+p-1)/s of its ideal work: bubble (p-1)/(s+p-1) of the executed trips (GPipe's
form, with slices for micro-batches). The backward pass is ``jax.grad`` of the scan: the
buffer's cotangent carries each slice's gradient to the earlier slices' keys/values.

Refused (``check``): block statistics (MoE), uneven stages, virtual stages, a sequence
split over a mesh axis, and a sequence that does not divide into the slices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from shardlib.core.errors import ShardingError
from shardlib.core.layout import constrain
from shardlib.core.token_slice import TokenSlice, token_slice
from shardlib.parallel.pipeline.replicas import replicas
from shardlib.parallel.pipeline.storage import LayerOrder
from shardlib.parallel.pipeline.views import stage_axes, stage_mask, stage_state, to_replicas

STATE_NAMES = ("stage", "batch", "seq", "embed")  # [p, b, L/s, embed]
KV_NAMES = ("stage", None, "batch", None, "kv_heads", "head_dim")  # [p, k, b, seq, G, K]
PICKED = "pipeline_round_weights"  # as gpipe's: a stage's layer, never saved per trip


def check_terapipe(spec, *, seq: int, block_stats: bool, context: int = 1) -> None:
    """What the token-slice loop needs, with the fix, before anything compiles."""
    s = spec.microbatches
    if context > 1:
        raise ShardingError(
            f"pipeline_schedule=terapipe with a context axis of {context}: the stages already "
            "cut the sequence into slices. Fix: drop the context axis, or another schedule."
        )
    if block_stats:
        raise ShardingError(
            "pipeline_schedule=terapipe with block statistics (an MoE router's losses): a "
            "slice's statistics are not the sequence's. Fix: pipeline_schedule=gpipe."
        )
    if spec.virtual_stages != 1 or len(set(spec.stage_layers)) > 1:
        raise ShardingError(
            f"pipeline_schedule=terapipe with virtual_stages={spec.virtual_stages}, "
            f"stage_layers={spec.stage_layers}: only equal stages of one chunk are built. "
            "Fix: virtual_stages=1 and model.layers a multiple of the stage axis."
        )
    if s < 1 or seq % s:
        raise ShardingError(
            f"pipeline_schedule=terapipe cuts seq={seq} into pipeline_microbatches={s} equal "
            f"slices. Fix: a slice count dividing {seq}."
        )


def terapipe_layers(spec, stage_layers):
    """A ``layers(block_fn, blocks_state, x_BLD)`` running ``spec.microbatches`` token
    slices through ``spec.stages`` stages; ``stage_layers`` as in ``gpipe.pipeline_layers``."""
    p, s = spec.stages, spec.microbatches

    def layers(block_fn, blocks_state, x_BLD):
        if isinstance(x_BLD, tuple):
            check_terapipe(spec, seq=s, block_stats=True)
        reps = replicas(gather_weights=spec.gather_weights)
        if reps is None:
            return run(block_fn, blocks_state, x_BLD)
        x_spec = reps.outer.spec(("batch", "seq", "embed"))
        out_R = reps.vmap(lambda w, x: run(block_fn, w, x))(
            to_replicas(reps, blocks_state), reps.split_batch(x_BLD, x_spec)
        )
        return reps.merge_batch(out_R, x_spec)

    def run(block_fn, blocks_state, x_BLD):
        dtype, (b, seq, d) = x_BLD.dtype, x_BLD.shape
        n = seq // s  # tokens per slice
        staged = stage_state(blocks_state, p, 1, stored=not LayerOrder.of_spec(spec).natural)
        k = jax.tree.leaves(staged)[0].shape[2]

        def pick(w_vk, j):
            w = jax.lax.dynamic_index_in_dim(w_vk[0], j, 0, False)
            return checkpoint_name(w.astype(dtype), PICKED)

        def probe(w, x):  # the shape of one layer's keys/values, from the model itself
            slot = TokenSlice(offset=0)
            with token_slice(slot):
                block_fn(w, x)
            return slot.k, slot.v

        w0 = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape[3:], dtype), staged)
        k_sh, v_sh = jax.eval_shape(probe, w0, jax.ShapeDtypeStruct((b, n, d), dtype))

        def run_stage(w_vk, kv, offset, valid, x):
            """One stage on one slice: x [b, n, d]; kv: (K, V) [k, b, seq, G, K]; a trip
            with no slice here (``valid`` false) writes back what the slot held."""

            def block(layer, carry):
                j, prefix_k, prefix_v = layer
                x, own_k, own_v = carry
                slot = TokenSlice(offset=offset, prefix_k=prefix_k, prefix_v=prefix_v)
                with token_slice(slot):
                    x = block_fn(jax.tree.map(lambda w: pick(w, j), w_vk), x)
                own_k = jax.lax.dynamic_update_index_in_dim(own_k, slot.k, j, 0)
                own_v = jax.lax.dynamic_update_index_in_dim(own_v, slot.v, j, 0)
                return x, own_k, own_v

            own = tuple(jnp.zeros((k, *a.shape), a.dtype) for a in (k_sh, v_sh))
            x, own_k, own_v = stage_layers(block, (jnp.arange(k), *kv), (x, *own))

            def store(buf, own):  # only the slice's slots: O(L/s) per trip, not O(L)
                old = jax.lax.dynamic_slice_in_dim(buf, offset, n, 2)
                return jax.lax.dynamic_update_slice_in_dim(
                    buf, jnp.where(valid, own, old), offset, 2
                )

            return x, tuple(store(buf, o) for buf, o in zip(kv, (own_k, own_v), strict=True))

        all_stages = jax.vmap(run_stage, spmd_axis_name=stage_axes())
        slices = x_BLD.reshape(b, s, n, d).transpose(1, 0, 2, 3)  # [s, b, n, d]
        state = constrain(jnp.zeros((p, b, n, d), dtype), STATE_NAMES)
        kv = tuple(
            constrain(jnp.zeros((p, k, b, seq, *a.shape[2:]), a.dtype), KV_NAMES)
            for a in (k_sh, v_sh)
        )
        ids = jnp.arange(p)

        def body(loop, t):
            state, kv, slices = loop
            state = jnp.where(stage_mask(p, 4) == 0, slices[t % s][None], state)
            j_P = t - ids  # the slice each stage works on this trip
            valid = (j_P >= 0) & (j_P < s)
            out, kv = all_stages(staged, kv, jnp.clip(j_P, 0, s - 1) * n, valid, state)
            kv = tuple(constrain(a, KV_NAMES) for a in kv)
            done = (t - (p - 1)) % s  # the last stage hands its slice back
            kept = jax.lax.dynamic_index_in_dim(slices, done, 0, False)
            slices = jax.lax.dynamic_update_index_in_dim(
                slices, jnp.where(t >= p - 1, out[p - 1], kept), done, 0
            )
            state = constrain(jnp.roll(out, 1, axis=0), STATE_NAMES)
            return (state, kv, slices), None

        (_, _, slices), _ = jax.lax.scan(body, (state, kv, slices), jnp.arange(s + p - 1))
        return constrain(slices.transpose(1, 0, 2, 3).reshape(b, seq, d), ("batch", "seq", "embed"))

    return layers
