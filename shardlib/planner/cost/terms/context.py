"""Context parallelism (ring attention): the sequence split, K/V blocks passed round a ring.

The trainer's default ``attention=ring`` (``shardlib/parallel/context/ring.py``) runs, per
layer and micro-batch, inside ``shard_map`` over the context axis (c devices):

* forward: c-1 hops, each a ``ppermute`` of this device's current K and V blocks
  [b, s/c, g/t, d] (compute dtype) and their int32 positions [s/c];
* backward (hand-written ``custom_vjp``): the ring again, c-1 hops of K, V and positions,
  and c hops of the K/V gradient blocks (fp32 accumulators that travel with their block:
  c-1 in the loop and one last hop home).

So (3c-2) block-sized permutes per layer where Liu et al. 2023's count is 3(c-1): the
compiled programs show exactly these (llama-small, c = 2, 4, 8). Each is one
collective-permute (a device sends its block once). They overlap with the block
computations. Gradients are also reduced over the context axis (``terms.dp``); the
activations of ring attention are in ``terms.model``.
"""

from __future__ import annotations

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import Axis
from shardlib.planner.cost.terms.base import Comm, Context, Contribution, SearchAxis

POSITION_BYTES = 4  # int32 token positions travel with the K/V blocks (zig-zag order)
GRAD_BYTES = 4  # the K/V gradient accumulators are fp32 whatever the compute dtype

# Activations under ring attention. Compiled memory depends on the local tokens b·s/c only,
# not on how they split into batch and sequence, nor on heads x keys (llama-small: d4c2 and
# d2c4 at the same b·s/c compile to the same bytes; 8 or 16 heads alike): no score matrix
# is kept, only q, k, v, the output and its log-sum-exp per layer, and one ring step's
# blocks at a time. So per token, in units of the q/k/v width (heads + 2 kv_heads)·d/t, the
# calibration fits ``ring_saved_qkv`` (saved per layer, replacing the dense ``layer_scores``)
# and ``ring_working_qkv`` (live once: one layer's ring forward/backward working set), on
# the context probes of ``planner.calibration.PROBES``.


def _admits(workload, cluster, space, chosen, size) -> bool:
    # zig-zag ring attention takes two chunks per device; the MoE model takes no ring
    # token positions
    return space.context and workload.seq % (2 * size) == 0 and not workload.experts


def _check(workload, view) -> None:
    w, c = workload, view.context
    if w.seq % (2 * c):
        raise ShardingError(
            f"plan {view.mesh_text()}: seq {w.seq} does not split into 2 chunks on each of "
            f"{c} context devices. Fix: a context size that divides seq / 2."
        )
    if w.experts:
        raise ShardingError(
            f"plan {view.mesh_text()}: the MoE model does not take ring attention's token "
            "order. Fix: use expert/data/fsdp/tensor axes."
        )


SEARCH_AXIS = SearchAxis(
    Axis.CONTEXT,
    placement=40,  # per-layer K/V hops that overlap the block's compute: inside, after tensor
    admits=_admits,
    splits_batch=False,
    rule="splits the sequence in 2 chunks per device, dense models only",
    check=_check,
)


def context(ctx: Context) -> Contribution:
    p, w = ctx.p, ctx.w
    if p.context <= 1:
        return Contribution()
    c = p.context
    elems = ctx.micro_batch * ctx.local_seq * w.kv_heads / p.tensor * w.head_dim
    kv = 2 * elems * w.compute_bytes + ctx.local_seq * POSITION_BYTES  # K, V, positions
    dkv = 2 * elems * GRAD_BYTES
    runs = ctx.layer_runs  # per layer and micro-batch; a pipeline's bubble trips too
    axes = (str(Axis.CONTEXT),)
    return Contribution(
        comms=(
            # c-1 hops in forward and c-1 again in backward
            Comm(
                "context",
                "k/v blocks",
                "collective-permute",
                axes,
                c,
                kv,
                2 * (c - 1) * runs,
                True,
                3,
            ),
            # the gradient blocks: c-1 hops in the loop and one home
            Comm("context", "k/v grads", "collective-permute", axes, c, dkv, c * runs, True, 2),
        ),
    )


def ring_working_bytes(ctx: Context, micro_batch: int) -> float:
    """One layer's ring-attention working set (blocks in flight), live once."""
    p, w = ctx.p, ctx.w
    if p.context <= 1:
        return 0.0
    qkv = (w.heads + 2 * w.kv_heads) * w.head_dim / p.tensor
    return ctx.calib["ring_working_qkv"] * micro_batch * ctx.local_seq * qkv * w.compute_bytes
