"""Search the plans of a workload on a cluster: enumerate, prune by memory, rank by time.

The space (``Space``): every factorisation of the device count over the mesh axes the
planner terms declare (``planner.terms.SEARCH_AXES``: data, stage, fsdp, expert, context,
tensor), each size admitted by its axis's own constraint, then ZeRO stage over ``data``,
pipeline schedule and virtual stages, micro-batch count, rematerialisation and offload.

``search`` is exact under the cost model but does not cost every point:
1. meshes are visited in order of a lower bound on their step time (compute at m = 1 plus
   the critical-path collectives, which no knob below makes smaller), and the walk stops
   once that bound exceeds the k-th best plan found (branch and bound);
2. for one mesh, ZeRO stage, schedule and micro-batch count, more rematerialisation or
   offload never makes a step faster (more FLOPs, more host traffic), so once a
   (remat, offload) pair fits, every pair that is at least as heavy on both is skipped,
   and so is every such pair once one is slower than the k-th best plan found; without
   stages the same holds across larger micro-batch counts (smaller matmuls, more
   reductions); and the heaviest pair, which needs the least memory, is costed first: if
   it does not fit, neither does the rest of its group.
``exhaustive`` costs every point; the tests check that both return the same optimum.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from shardlib.core.errors import ShardingError
from shardlib.core.workload import Workload
from shardlib.parallel.plan import ParallelPlan
from shardlib.planner.candidate import AXIS_ORDER, REMAT, PlanView, batch_ways, candidate
from shardlib.planner.cost.terms import SEARCH_AXES
from shardlib.planner.cost.throughput import is_exposed
from shardlib.planner.cost.total import Estimate, collective_seconds, estimate
from shardlib.planner.inputs.cluster import Cluster


@dataclass(frozen=True)
class Space:
    """Which values each knob may take."""

    microbatches: tuple[int, ...] | None = None
    """Micro-batch counts tried (those that divide the per-replica batch); None: every
    divisor of the per-replica batch, so that a batch such as 1536 = 3 x 512 finds the
    m = 3k a pipeline needs (m >= stages still applies)."""
    zero: tuple[int, ...] = (0, 1, 2)
    """ZeRO stages over the data axis (only 0 when data = 1)."""
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "circular")
    """Pipeline schedules when stage > 1 (``PipelineParallel.schedule``; 1F1B is 1F1B,
    interleaved with virtual stages; circular GPipe with virtual stages)."""
    virtual: tuple[int, ...] = (2, 4)
    """Virtual stages per device for the circular and 1F1B schedules (besides v = 1 for
    1f1b)."""
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
    fixed: tuple[tuple[str, int], ...] = ()
    """Mesh axis sizes every plan has (``shardlib plan --fix tensor=8``); the other axes are
    searched."""
    staged_only: bool = False
    """Only meshes with a stage axis (a fixed schedule or virtual stage count needs one)."""

    def fixing(self, settings: Mapping[str, int | str | bool]) -> Space:
        """This space with ``settings`` fixed: axis sizes filter the meshes, a knob
        (``zero``, ``microbatches``, ``schedule``, ``virtual``, ``remat``, ``offload``)
        becomes a menu of one. Unknown names raise ShardingError."""
        axes = {str(a) for a in AXIS_ORDER}
        menus = {"zero": "zero", "microbatches": "microbatches", "schedule": "schedules"}
        menus |= {"virtual": "virtual", "remat": "remat", "offload": "offload"}
        unknown = sorted(set(settings) - axes - set(menus))
        if unknown:
            raise ShardingError(
                f"--fix {', '.join(unknown)}: not an axis or knob. Fix: use "
                f"{', '.join([*AXIS_ORDER, *menus])}."
            )
        fixed = tuple((k, int(v)) for k, v in settings.items() if k in axes)
        changes: dict = {k: (v,) for k, v in settings.items() if k in menus}
        changes = {menus[k]: v for k, v in changes.items()}
        virtual, schedule = settings.get("virtual"), settings.get("schedule")
        if virtual is not None:  # v > 1: circular or interleaved 1F1B; v = 1 the others'
            circular = ("circular", "1f1b") if virtual > 1 else ("gpipe", "1f1b")
            if schedule is not None and schedule not in circular:
                raise ShardingError(
                    f"--fix schedule={schedule},virtual={virtual}: virtual stages > 1 go with "
                    "the circular or 1F1B schedule only. Fix: fix one of the two."
                )
            changes["schedules"] = (schedule,) if schedule else circular
            if virtual == 1:
                changes.pop("virtual")
        staged = "schedule" in settings or virtual is not None
        return dataclasses.replace(
            self, fixed=self.fixed + fixed, staged_only=self.staged_only or staged, **changes
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(workload: Workload, cluster: Cluster, space: Space) -> Iterator[dict[str, int]]:
    """Axis sizes whose product is the device count and whose dims divide (cheap checks).

    The axes of ``SEARCH_AXES`` in their order, each over the divisors of the devices left
    that its ``admits`` takes; the last axis gets what is left; the batch must split over
    the batch axes. Yields ``{axis: size}`` for every axis of ``AXIS_ORDER``.
    """

    fixed = dict(space.fixed)

    def walk(i: int, left: int, chosen: dict[str, int]) -> Iterator[dict[str, int]]:
        axis = SEARCH_AXES[i]
        name, last = str(axis.axis), i == len(SEARCH_AXES) - 1
        for size in (left,) if last else _divisors(left):
            if fixed.get(name, size) != size:
                continue
            if size > 1 and not axis.admits(workload, cluster, space, chosen, size):
                continue
            sizes = {**chosen, name: size}
            if not last:
                yield from walk(i + 1, left // size, sizes)
            elif workload.global_batch % batch_ways(sizes) == 0:
                yield {str(a): sizes[a] for a in AXIS_ORDER}

    yield from walk(0, cluster.num_devices, {})


def _per_replica(workload: Workload, mesh: dict[str, int]) -> int:
    """Sequences per batch replica (data, FSDP and expert replicas each get their own rows)."""
    return workload.global_batch // batch_ways(mesh)


def microbatch_menu(space: Space, per_replica: int) -> tuple[int, ...]:
    """The micro-batch counts ``space`` tries for ``per_replica`` sequences per replica."""
    if space.microbatches is None:
        return tuple(_divisors(per_replica))
    return space.microbatches


def knob_groups(
    workload: Workload, mesh: dict[str, int], space: Space
) -> Iterator[list[ParallelPlan]]:
    """For one mesh: lists of plans sharing (zero, schedule, m), ordered lightest first."""
    if space.staged_only and mesh["stage"] == 1:
        return
    per_replica = _per_replica(workload, mesh)
    # ZeRO shards over ``data``. With an fsdp, context, expert or stage axis beside it XLA
    # merges and places the reductions in ways the cost model does not follow (compiled:
    # HSDP + ZeRO-2 memory 1.08x; ZeRO-2 with 1F1B stages memory 0.82x, bytes 0.79x): those
    # combinations are not searched (nor beside an axis added later, until measured)
    plain = all(s == 1 for a, s in mesh.items() if a not in ("data", "tensor"))
    zeros = space.zero if mesh["data"] > 1 and plain else tuple(z for z in space.zero if z == 0)
    if mesh["stage"] > 1:
        scheds = [(s, 1) for s in space.schedules if s != "circular"]
        for interleaved in ("circular", "1f1b"):
            if interleaved in space.schedules:
                scheds += [(interleaved, v) for v in space.virtual if v > 1]
    else:
        scheds = [("gpipe", 1)]  # no stage axis: the pipeline section stays as it is
    menu = microbatch_menu(space, per_replica)
    for zero, (schedule, virtual), m in itertools.product(zeros, scheds, menu):
        if per_replica % m:
            continue
        # the trainer's constraints (strategies/pipeline.py): equal stages; circular m >= p
        if mesh["stage"] > 1 and workload.layers % (mesh["stage"] * virtual):
            continue
        # every schedule streams at least one micro-batch per stage (m >= p, Narayanan et al.;
        # circular needs it): with fewer, stages idle most of the step and GPipe's saved
        # residuals, measured at m = 1, fall outside the fitted range (0.90x)
        if mesh["stage"] > 1 and m < mesh["stage"]:
            continue
        if schedule == "1f1b" and virtual > 1 and m % mesh["stage"]:
            continue  # interleaved 1F1B streams whole groups of p micro-batches
        knobs = dict(zero=zero, microbatches=m, schedule=schedule, virtual=virtual)
        yield [
            candidate(**mesh, **knobs, remat=r, offload=o)
            for r in space.remat
            for o in space.offload
        ]


def rank_key(est: Estimate) -> tuple[float, float, float, float]:
    """Fastest first; among equally fast plans, less exposed communication, then less
    communication in all (both robust to slower links than assumed: hidden traffic can
    surface), then less memory (headroom)."""
    return (
        round(est.step_s, 9),
        round(est.exposed_comm_s, 9),
        round(est.comm_s, 6),
        est.memory_bytes,
    )


def _dominated(plan: ParallelPlan, fitting: list[ParallelPlan]) -> bool:
    """Some plan of ``fitting`` (the group's fitting plans, or those already too slow) has
    no more remat and no more offload."""
    r, o = REMAT.index(plan.remat.policy), plan.offload.optimizer
    return any(REMAT.index(f.remat.policy) <= r and f.offload.optimizer <= o for f in fitting)


def estimate_or_none(workload, plan, cluster) -> Estimate | None:
    """The plan's estimate, or None where a dim does not divide (a ShardingError)."""
    try:
        return estimate(workload, plan, cluster)
    except ShardingError:
        return None


def lower_bound(workload: Workload, mesh: dict[str, int], cluster: Cluster, space: Space) -> float:
    """No plan on ``mesh`` is faster: compute without recompute or bubble at one
    micro-batch (the largest matmuls: the throughput model's fastest rate), plus the
    critical-path collectives at one micro-batch (their bytes do not depend on m, their
    latency only grows with m). With stages the pipeline loop's bubble trips also move
    bytes, fewest at the most micro-batches: GPipe and circular there bound every
    schedule (1F1B has more trips and a recomputed forward), the smallest bound is kept."""
    whole = estimate_or_none(workload, candidate(**mesh), cluster)
    if whole is None:
        return math.inf
    options = [whole]
    if mesh["stage"] > 1:
        per_replica = _per_replica(workload, mesh)
        m = max((m for m in microbatch_menu(space, per_replica) if per_replica % m == 0), default=1)
        plans = [candidate(**mesh, microbatches=m)]
        plans += [
            candidate(**mesh, schedule="circular", virtual=v, microbatches=m) for v in space.virtual
        ]
        options = [e for e in (estimate_or_none(workload, p, cluster) for p in plans) if e]
    critical = min((_critical_s(e, cluster) for e in options), default=math.inf)
    return whole.compute_s + critical


def _critical_s(est: Estimate, cluster: Cluster) -> float:
    staged = PlanView(est.plan).stage > 1
    return sum(collective_seconds(c, cluster, est.plan) for c in est.comms if is_exposed(c, staged))


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
        # without stages a step is no faster with more micro-batches (smaller matmuls, a
        # reduction per micro-batch): what fits or is too slow at m rules out heavier
        # plans at every larger m too (groups come in ascending m per ZeRO stage)
        carried: dict[tuple, tuple[list, list]] = {}
        for group in knob_groups(workload, mesh, space):
            view = PlanView(group[0])
            key = (view.zero, view.schedule, view.virtual, view.microbatches)
            if mesh["stage"] == 1:
                key = (view.zero,)
            fitting, too_slow = carried.setdefault(key, ([], []))
            best_here: Estimate | None = None
            worst = -heap[0][0][0] if len(heap) >= top else math.inf
            # the heaviest plan (most remat, offload) uses the least memory: if it does not
            # fit, nothing in the group does
            heaviest = group[-1]
            known: dict[int, Estimate | None] = {}
            if not (_dominated(heaviest, fitting) or _dominated(heaviest, too_slow)):
                known[id(heaviest)] = est = estimate_or_none(workload, heaviest, cluster)
                evaluated += 1
                if est is None or not est.fits:
                    continue
            for plan in group:
                if _dominated(plan, fitting) or _dominated(plan, too_slow):
                    continue
                if id(plan) in known:
                    est = known[id(plan)]
                else:
                    est = estimate_or_none(workload, plan, cluster)
                    evaluated += 1
                if est is not None and rank_key(est)[0] > worst:
                    too_slow.append(plan)
                    continue
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
                est = estimate_or_none(workload, plan, cluster)
                evaluated += 1
                if est is not None and est.fits:
                    fits.append(est)
    fits.sort(key=rank_key)
    return Result(fits, evaluated, count, count)
