"""PipeDream-2BW's weight update (Narayanan et al. 2021, ICML, "Memory-Efficient
Pipeline-Parallel DNN Training"): ``pipeline_schedule=2bw``.

2BW keeps two versions of the weights (double buffering) and computes the gradient of
a batch on the weights it entered the pipeline with, while the optimizer applies it to
the current ones:

    W(t+1) = W(t) - lr · ∇f(W(t-1))        (the paper's eq. (1), any optax optimizer)

That one step of staleness lets step t+1's micro-batches enter the pipeline while step
t's are still in flight, so no flush separates the steps (``two_bw_loop``: m executed
chunks per device and step instead of 1F1B's m+p-1). In the trainer:

* the train state gains ``PREV_PARAMS`` (W(t-1), laid out like ``params``) and ``CARRY``
  (the loop's in-flight work: hand-overs, ring of saved inputs, the unfinished batch's
  gradient sums, loss and tokens), so orbax saves both and a resumed run continues
  exactly;
* step t runs the loop on ``params`` (the new batch) and ``prev_params`` (the previous
  batch's last work) and returns the previous batch's loss and gradient, which the
  optimizer applies to ``params``; the old ``params`` become ``prev_params``;
* step 0 only fills the pipeline: it reports a NaN loss and applies nothing. So step t
  reports batch t-1's loss, f(W(t-2)) in the rule's numbering, and after n steps the
  weights are those of n-1 steps of the rule above.

PipeDream-Flush, the paper's synchronous reference, is 1F1B with a flush per step:
``pipeline_schedule=pipedream-flush`` is a spelling of ``1f1b`` (``spec.SCHEDULE_ALIASES``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from shardlib.core.errors import ShardingError

PREV_PARAMS = "prev_params"  # the train state's entry: W(t-1), laid out like ``params``
CARRY = "pipeline_carry"  # the train state's entry: the loop's in-flight work (``two_bw_loop``)
STAGED_CARRY = ("fwd", "bwd", "ring", "g_blocks", "g_rest", "loss")  # [p, ...]: over ``stage``
SCHEDULE = "2bw"


def stale(spec) -> bool:
    """Whether the pipeline ``spec`` (a ``PipelineSpec`` or None) takes gradients at the
    previous step's weights."""
    return spec is not None and spec.schedule == SCHEDULE


def check(plan) -> None:
    """What 2bw's one extra state entry does not reach: the streamed (offloaded) update
    walks ``params`` and the optimizer state only, and 1-bit momentum's step is its own."""
    if not stale(plan.pipeline_spec()):
        return
    problems = []
    if plan.offload.optimizer or plan.offload.params:
        problems.append(("offload", "offload.optimizer=false and offload.params=false"))
    if plan.data.onebit_momentum:
        problems.append(("1-bit momentum (onebit_adam / onebit_lamb)", "optimizer=adamw"))
    if plan.data.microbatches > 1:  # the loop's micro-batches are the accumulation
        problems.append(("data.microbatches > 1", "more pipeline_microbatches instead"))
    if problems:
        what = " and ".join(p for p, _ in problems)
        fix = ", ".join(f for _, f in problems)
        raise ShardingError(
            f"pipeline_schedule=2bw with {what}: its stale weights ({PREV_PARAMS!r}, W(t-1)) "
            "live in device memory beside the parameters and are read by the trainer's own "
            f"step, which that path replaces. Fix: {fix}, or pipeline_schedule=1f1b."
        )


def after_first(step, new, old):
    """``new`` from the second step on, ``old`` (a tree like it, or one value for every
    leaf) at step 0, whose call only filled the pipeline: no batch finished in it."""
    if not isinstance(old, (dict, tuple, list)):
        old = jax.tree.map(lambda x: jnp.full_like(x, old), new)
    return jax.tree.map(lambda n, o: jnp.where(step > 0, n, o), new, old)


def advance(new_state: dict, state: dict, params, keep=None) -> dict:
    """``new_state`` with W(t) (``params``, as the step read them) as the next step's
    stale weights; ``keep(new, old)`` leaves a skipped step's (fp16) as they were."""
    if PREV_PARAMS not in state:
        return new_state
    prev = params if keep is None else keep(params, state[PREV_PARAMS])
    return {**new_state, PREV_PARAMS: prev}
