"""Search the plans of a workload on a cluster: enumerate, prune by memory, rank by time.

The space (``Space``): every factorisation of the device count into data x stage x fsdp x
expert x context x tensor (tensor inside one host), ZeRO stage over ``data``, pipeline
schedule and virtual stages, micro-batch count, rematerialisation and offload.

``search`` is exact under the cost model but does not cost every point:
1. meshes are visited in order of a lower bound on their step time (compute at m = 1 plus
   the critical-path collectives, which no knob below makes smaller), and the walk stops
   once that bound exceeds the k-th best plan found (branch and bound);
2. for one mesh, ZeRO stage, schedule and micro-batch count, more rematerialisation or
   offload never makes a step faster (more FLOPs, more host traffic), so once a
   (remat, offload) pair fits, every pair that is at least as heavy on both is skipped.
``exhaustive`` costs every point; the tests check that both return the same optimum.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from shardlib.errors import ShardingError
from shardlib.parallel import ParallelPlan
from shardlib.planner.candidate import REMAT, candidate
from shardlib.planner.cluster import Cluster
from shardlib.planner.cost import Estimate, estimate
from shardlib.planner.workload import Workload


@dataclass(frozen=True)
class Space:
    """Which values each knob may take."""

    microbatches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """Micro-batch counts tried (those that divide the per-replica batch)."""
    zero: tuple[int, ...] = (0, 1, 2)
    """ZeRO stages over the data axis (only 0 when data = 1)."""
    schedules: tuple[str, ...] = ("gpipe", "bounded", "circular")
    """Pipeline schedules when stage > 1 (``PipelineParallel.schedule``; bounded is 1F1B,
    circular the interleaved schedule)."""
    virtual: tuple[int, ...] = (2, 4)
    """Virtual stages per device for the circular schedule."""
    remat: tuple[str, ...] = REMAT
    """Remat policies, lightest first."""
    offload: tuple[bool, ...] = (False, True)
    """Optimizer state in host memory or not."""
    max_tensor: int | None = None
    """Largest tensor degree (default: devices per host: tensor never crosses hosts)."""
    max_stage: int = 64
    """Largest pipeline degree."""
    context: bool = True
    """Try context parallelism."""
    pipeline: bool = True
    """Try pipeline parallelism."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(workload: Workload, cluster: Cluster, space: Space) -> Iterator[dict[str, int]]:
    """Axis sizes whose product is the device count and whose dims divide (cheap checks)."""
    n, w = cluster.num_devices, workload
    max_t = space.max_tensor or cluster.devices_per_host
    tensor_ok = math.gcd(*w.tensor_sizes)
    for tensor in _divisors(n):
        if tensor > max_t or tensor_ok % tensor:
            continue
        for context in _divisors(n // tensor):
            if context > 1 and (not space.context or w.seq % (2 * context)):
                continue
            if context > 1 and w.experts:  # the MoE model takes no ring token positions
                continue
            rest = n // (tensor * context)
            for expert in _divisors(rest):
                if expert > 1 and (not w.experts or w.experts % expert):
                    continue
                for stage in _divisors(rest // expert):
                    if stage > 1 and (not space.pipeline or stage > min(space.max_stage, w.layers)):
                        continue
                    if stage > 1 and w.experts:  # the trainer does not pipeline MoE models
                        continue
                    # ring attention inside pipeline stages is not in the cost model (compiled:
                    # memory 0.78x, bytes 0.85x of the prediction): not searched
                    if stage > 1 and context > 1:
                        continue
                    left = rest // (expert * stage)
                    for fsdp in _divisors(left):
                        data = left // fsdp
                        if w.global_batch % (data * fsdp * expert):
                            continue
                        if fsdp > 1 and w.embed % fsdp:
                            continue
                        yield dict(
                            data=data,
                            stage=stage,
                            fsdp=fsdp,
                            expert=expert,
                            context=context,
                            tensor=tensor,
                        )


def _per_replica(workload: Workload, mesh: dict[str, int]) -> int:
    """Sequences per batch replica (data, FSDP and expert replicas each get their own rows)."""
    return workload.global_batch // (mesh["data"] * mesh["fsdp"] * mesh["expert"])


def microbatch_counts(space: Space, per_replica: int, stages: int) -> list[int]:
    """The space's counts that divide the per-replica batch; with stages also every other
    divisor between p and the space's largest count (the trainer runs any m >= p that
    divides it: a per-replica batch of 9 or 144 has no power-of-two count on 3 or 8 stages)."""
    counts = {m for m in space.microbatches if per_replica % m == 0}
    if stages > 1:
        top = max(space.microbatches)
        counts |= {m for m in range(stages, top + 1) if per_replica % m == 0}
    return sorted(counts)


def knob_groups(
    workload: Workload, mesh: dict[str, int], space: Space
) -> Iterator[list[ParallelPlan]]:
    """For one mesh: lists of plans sharing (zero, schedule, m), ordered lightest first."""
    per_replica = _per_replica(workload, mesh)
    # ZeRO shards over ``data``. With an fsdp, context, expert or stage axis beside it XLA
    # merges and places the reductions in ways the cost model does not follow (compiled:
    # HSDP + ZeRO-2 memory 1.08x; ZeRO-2 with 1F1B stages memory 0.82x, bytes 0.79x): those
    # combinations are not searched
    plain = all(mesh[a] == 1 for a in ("fsdp", "context", "expert", "stage"))
    zeros = space.zero if mesh["data"] > 1 and plain else (0,)
    if mesh["stage"] > 1:
        scheds = [(s, 1) for s in space.schedules if s != "circular"]
        if "circular" in space.schedules:
            scheds += [("circular", v) for v in space.virtual]
    else:
        scheds = [("gpipe", 1)]  # no stage axis: the pipeline section stays as it is
    counts = microbatch_counts(space, per_replica, mesh["stage"])
    for zero, (schedule, virtual), m in itertools.product(zeros, scheds, counts):
        # the trainer's constraints (strategies/pipeline.py): equal stages; circular m >= p
        if mesh["stage"] > 1 and workload.layers % (mesh["stage"] * virtual):
            continue
        # every schedule streams at least one micro-batch per stage (m >= p, Narayanan et al.;
        # circular needs it): with fewer, stages idle most of the step and GPipe's saved
        # residuals, measured at m = 1, fall outside the fitted range (0.90x)
        if mesh["stage"] > 1 and m < mesh["stage"]:
            continue
        knobs = dict(zero=zero, microbatches=m, schedule=schedule, virtual=virtual)
        yield [
            candidate(**mesh, **knobs, remat=r, offload=o)
            for r in space.remat
            for o in space.offload
        ]


def rank_key(est: Estimate) -> tuple[float, float, float]:
    """Fastest first; among equally fast plans, less exposed communication (robust to
    slower links than assumed), then less memory (headroom)."""
    return (round(est.step_s, 9), round(est.exposed_comm_s, 9), est.memory_bytes)


def _dominated(plan: ParallelPlan, fitting: list[ParallelPlan]) -> bool:
    """Some fitting plan of the group has no more remat and no more offload."""
    r, o = REMAT.index(plan.remat.policy), plan.offload.optimizer
    return any(REMAT.index(f.remat.policy) <= r and f.offload.optimizer <= o for f in fitting)


def _estimate(workload, plan, cluster) -> Estimate | None:
    try:
        return estimate(workload, plan, cluster)
    except ShardingError:
        return None


def lower_bound(workload: Workload, mesh: dict[str, int], cluster: Cluster, space: Space) -> float:
    """No plan on ``mesh`` is faster: compute without recompute or bubble, plus the
    critical-path collectives at one micro-batch (their bytes do not depend on m, their
    latency only grows with m). With stages the pipeline loop's bubble trips also move
    bytes, fewest at the most micro-batches: GPipe and circular there bound every
    schedule (1F1B has more trips and a recomputed forward), the smallest bound is kept."""
    options = [("gpipe", 1, 1)]
    if mesh["stage"] > 1:
        per_replica = _per_replica(workload, mesh)
        m = max(microbatch_counts(space, per_replica, mesh["stage"]), default=1)
        options = [("gpipe", 1, m)] + [("circular", v, m) for v in space.virtual]
    bound = math.inf
    for schedule, virtual, m in options:
        plan = candidate(**mesh, schedule=schedule, virtual=virtual, microbatches=m)
        est = _estimate(workload, plan, cluster)
        if est is not None:
            bound = min(bound, est.compute_s + _critical_s(est, cluster))
    return bound


def _critical_s(est: Estimate, cluster: Cluster) -> float:
    from shardlib.planner.cost import collective_seconds

    return sum(collective_seconds(c, cluster, est.plan) for c in est.comms if not c.overlap)


@dataclass(frozen=True)
class Result:
    """What a search returns."""

    best: list[Estimate]
    """The fastest fitting plans, fastest first (one per mesh and knob group)."""
    evaluated: int
    """Plans costed."""
    meshes: int
    """Meshes in the space."""
    meshes_visited: int
    """Meshes not pruned by the bound."""


def search(workload: Workload, cluster: Cluster, space: Space = Space(), top: int = 5) -> Result:
    """The ``top`` fastest plans that fit (exact under the cost model; see module doc)."""
    bounded = sorted(
        (
            (lower_bound(workload, m, cluster, space), i, m)
            for i, m in enumerate(meshes(workload, cluster, space))
        ),
        key=lambda t: (t[0], t[1]),
    )
    heap: list[tuple[float, int, Estimate]] = []  # max-heap of the best `top` by -step
    evaluated, visited, tie = 0, 0, itertools.count()
    for bound, _, mesh in bounded:
        if bound == math.inf or (len(heap) >= top and bound > -heap[0][0][0]):
            break
        visited += 1
        for group in knob_groups(workload, mesh, space):
            fitting: list[ParallelPlan] = []
            best_here: Estimate | None = None
            for plan in group:
                if _dominated(plan, fitting):
                    continue
                est = _estimate(workload, plan, cluster)
                evaluated += 1
                if est is None or not est.fits:
                    continue
                fitting.append(plan)
                if best_here is None or rank_key(est) < rank_key(best_here):
                    best_here = est
            if best_here is not None:
                item = (tuple(-x for x in rank_key(best_here)), -next(tie), best_here)
                if len(heap) < top:
                    heapq.heappush(heap, item)
                elif item > heap[0]:
                    heapq.heapreplace(heap, item)
    best = [e for _, _, e in sorted(heap, key=lambda t: (rank_key(t[2]), -t[1]))]
    return Result(best, evaluated, len(bounded), visited)


def exhaustive(workload: Workload, cluster: Cluster, space: Space = Space()) -> Result:
    """Cost every plan of the space; the fastest that fits first (for checking ``search``)."""
    fits, evaluated, count = [], 0, 0
    for mesh in meshes(workload, cluster, space):
        count += 1
        for group in knob_groups(workload, mesh, space):
            for plan in group:
                est = _estimate(workload, plan, cluster)
                evaluated += 1
                if est is not None and est.fits:
                    fits.append(est)
    fits.sort(key=rank_key)
    return Result(fits, evaluated, count, count)
