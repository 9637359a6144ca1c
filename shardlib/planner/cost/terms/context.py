"""Step parallelism (ring attention): the sequence split, K/V blocks passed round a ring.

The trainer's default ``attention=ring`` (``shardlib/parallel/context/kernels.py``) runs, per
layer and micro-batch, inside ``shard_map`` over the context axis (c devices):

* forward: c-1 hops, each a ``ppermute`` of this device's current K and V blocks
  [b, s/c, g/t, d] (compute dtype) and their int32 positions [s/c];
* backward (hand-written ``custom_vjp``): the ring again, c-1 hops of K, V and positions,
  and c hops of the K/V gradient blocks (fp32 accumulators that travel with their block:
  c-1 in the loop and one last hop home).

So (3c-2) block-sized permutes per layer where Liu et al. 2023's count is 3(c-1): the
compiled programs show exactly these (llama-small, c = 2, 4, 8). Each is one
collective-permute (a device sends its block once). They overlap with the block
computations (``window``: the attention's).

The hooks say what else ring attention changes. Activations (``saved``, ``working``): no
score matrix is kept (a fused kernel, ``attention_impl=cudnn``, keeps none either), and its
backward recomputes q·kᵀ whatever the remat policy (``recomputes_scores``). Gradients
(``reductions``): the context devices hold the same weights and see other tokens, so
every gradient is reduced over the context axis too. What the compiled programs do
(8 devices, llama-small):
* without FSDP, two all-reduces of the whole gradient, one over ``context`` and one over
  the other replicas (the partitioner reduces the batch and the sequence contraction
  separately and XLA does not fold them): 2(c-1)/c·M + 2(d-1)/d·M, more than one
  reduction over both;
* with FSDP, one all-reduce over ``data,context`` of the FSDP shard, after the FSDP
  reduction, except one of the two vocab-sized matrices (the output projection, or the
  embedding when there is a data axis too): its context all-reduce runs on the whole
  matrix, before the FSDP slice. Either way that matrix costs the separate form,
  2(c-1)/c·M_full + 2(d-1)/d·M_shard on top of the FSDP reduction. Not when FSDP runs
  the head vocab-parallel (``fsdp.vocab_tables``): its context all-reduce then runs on
  the FSDP shard, as every other matrix's.
"""

from __future__ import annotations

from typing import Any

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import Axis
from shardlib.core.param_info import ParamInfo
from shardlib.parallel.plan import ParallelPlan
from shardlib.planner.cost.terms.base import MASTER_BYTES, Comm, Contribution, Step
from shardlib.planner.cost.terms.declare import SearchAxis, Term
from shardlib.planner.cost.terms.fsdp import vocab_tables
from shardlib.planner.cost.terms.pipeline_loop import layer_runs

CONTEXT = str(Axis.CONTEXT)

POSITION_BYTES = 4  # int32 token positions travel with the K/V blocks (zig-zag order)
GRAD_BYTES = 4  # the K/V gradient accumulators are fp32 whatever the compute dtype

# Activations under ring attention. Compiled memory depends on the local tokens b·s/c only,
# not on how they split into batch and sequence, nor on heads x keys (llama-small: d4c2 and
# d2c4 at the same b·s/c compile to the same bytes; 8 or 16 heads alike): no score matrix
# is kept, only q, k, v, the output and its log-sum-exp per layer, and one ring step's
# blocks at a time. So per token, in units of the q/k/v width (heads + 2 kv_heads)·d/t, the
# calibration fits ``ring_saved_qkv`` (saved per layer, replacing the dense ``layer_scores``)
# and ``ring_working_qkv`` (live once: one layer's ring forward/backward working set), on
# the context probes of ``calibrate.probes.PROBES``.


def _admits(workload, cluster, chosen, size) -> bool:
    # zig-zag ring attention takes two chunks per device; the MoE model takes no ring
    # token positions
    return workload.seq % (2 * size) == 0 and not workload.experts


def _check(workload, view) -> None:
    w, c = workload, view[CONTEXT]
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
    splits=("seq",),
    rule="splits the sequence in 2 chunks per device, dense models only",
    check=_check,
)


def context(step: Step) -> Contribution:
    view, w = step.view, step.workload
    if view[CONTEXT] <= 1:
        return Contribution()
    c = view[CONTEXT]
    elems = step.micro_batch * step.local_seq * w.local_kv_heads(view["tensor"]) * w.head_dim
    kv = 2 * elems * w.compute_bytes + step.local_seq * POSITION_BYTES  # K, V, positions
    dkv = 2 * elems * GRAD_BYTES
    runs = layer_runs(step)  # per layer and micro-batch; a pipeline's bubble trips too
    axes = (CONTEXT,)
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


def ring_working_bytes(step: Step, micro_batch: int) -> float:
    """One layer's ring-attention working set (blocks in flight), live once."""
    view, w = step.view, step.workload
    if view[CONTEXT] <= 1:
        return 0.0
    qkv = w.local_qkv_width(view["tensor"])
    return step.calib["ring_working_qkv"] * micro_batch * step.local_seq * qkv * w.compute_bytes


def _saved(step: Step, policy: str, kept) -> dict[str, Any]:
    """Ring attention keeps no score matrix, its own count of q/k/v-wide elements instead
    (fitted, ``ring_saved_qkv``; none under remat); a fused kernel keeps none at all."""
    view, w = step.view, step.workload
    if view[CONTEXT] > 1:
        qkv = w.local_qkv_width(view["tensor"])
        ring = step.calib["ring_saved_qkv"] * qkv if policy == "none" else 0.0
        return {"attention": ring}
    if view.fused_attention:  # its output and row statistics: counted with the q/k/v width
        return {"attention": 0.0}
    return {}


_SEPARATE_WITH_FSDP = "lm_head"
"""The matrix whose context all-reduce runs unsliced under FSDP (equal in size to the
embedding, which XLA picks instead when there is a data axis: the same bytes)."""


def _reductions(step: Step, param: ParamInfo) -> tuple:
    """Over ``context``: with the other replicas on the parameter's shard, or alone on the
    whole matrix first (the separate form of the module docstring)."""
    separate = param.name == _SEPARATE_WITH_FSDP and param.name not in vocab_tables(step)
    if step.view["fsdp"] == 1 or separate:
        ways = step.shard(param, without=("fsdp",))  # the whole matrix, as FSDP gathers it
        return (((CONTEXT,), param.numel / ways * MASTER_BYTES),)
    return (((CONTEXT,), None),)


_DEFAULT = ParallelPlan().context


def _unmodelled(view) -> str:
    section = view.plan.context
    if section.attention != _DEFAULT.attention or section.load_balance != _DEFAULT.load_balance:
        return "context attention other than ring"
    if view.fused_attention and view[CONTEXT] > 1:
        return "attention_impl=cudnn across a context axis"
    return ""


TERM = Term(
    "context",
    cost=context,
    axis=SEARCH_AXIS,
    settings=lambda view: {
        # one fused kernel (cuDNN's flash attention): the score matrix never reaches HBM,
        # is never saved for the backward pass, and its products run at the kernel's rate
        "fused_attention": view.plan.context.attention_impl == "cudnn",
    },
    unmodelled=_unmodelled,
    reductions=_reductions,
    replicates=True,
    saved=_saved,
    working=ring_working_bytes,
    recomputes_scores=lambda step: step.view[CONTEXT] > 1,
    window="attention",  # a pass is free while a block's compute outlasts its transfer
)
