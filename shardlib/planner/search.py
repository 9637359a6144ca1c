"""Search the plans of a workload on a cluster: enumerate, prune by memory, rank by time.

The space (``Space``): every factorisation of the device count over the mesh axes the
planner terms declare (``planner.cost.terms.SEARCH_AXES``), each size admitted by its
axis's own constraint, then the values of each term's knobs it allows on that mesh
(``Term.choices``, ``Term.allows``: ZeRO stage, pipeline schedule and virtual stages), the
micro-batch count, and the trades (``Knob.trades``: rematerialisation, offload). The
search names no strategy: what it knows of one is that strategy's term's declarations.

``search`` is exact under the cost model but does not cost every point:
1. meshes are visited in order of a lower bound on their step time (compute at m = 1 plus
   the critical-path collectives, which no knob below makes smaller), and the walk stops
   once that bound exceeds the k-th best plan found (branch and bound);
2. for one mesh, ZeRO stage, schedule and micro-batch count, more rematerialisation or
   offload (a trade) never makes a step faster (more FLOPs, more host traffic), so once a
   (remat, offload) pair fits, every pair that is at least as heavy on both is skipped,
   and so is every such pair once one is slower than the k-th best plan found; without
   stages the same holds across larger micro-batch counts (smaller matmuls, more
   reductions); and the heaviest pair, which needs the least memory, is costed first: if
   it does not fit, neither does the rest of its group.
``exhaustive`` costs every point; the tests check that both return the same optimum.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from shardlib.core.errors import ShardingError
from shardlib.core.workload import Workload
from shardlib.parallel.plan import ParallelPlan
from shardlib.planner.candidate import AXIS_ORDER, PlanView, batch_ways, candidate
from shardlib.planner.cost.terms import SEARCH_AXES, TERMS
from shardlib.planner.cost.terms.declare import Knob
from shardlib.planner.cost.throughput import exposed_strategies, is_exposed
from shardlib.planner.cost.total import COMPUTE_EXTRAS, Estimate, collective_seconds, estimate
from shardlib.planner.inputs.cluster import Cluster

KNOBS: tuple[Knob, ...] = tuple(knob for term in TERMS for knob in term.knobs)
"""Every term's searched settings (``Term.knobs``), in the terms' order."""
TRADES: tuple[Knob, ...] = tuple(knob for knob in KNOBS if knob.trades)
"""The knobs whose heavier values only trade time for memory (``Knob.trades``)."""
MICROBATCHES = "microbatches"
"""The search's own knob: how the batch of a replica streams (the one count of
``PlanView.microbatches``, whichever section holds it)."""


@dataclass(frozen=True, init=False)
class Space:
    """Which values each knob and axis may take: each term's ``Knob`` unless given
    (``Space(zero=(0, 1))``), and the largest size of an axis (``limits``)."""

    menus: tuple[tuple[str, tuple], ...]
    """Values tried per knob, in ``KNOBS`` order."""
    limits: tuple[tuple[str, int], ...]
    """Largest size per mesh axis where given (1 leaves the axis out); else the axis's own
    (``SearchAxis.largest``: tensor stays inside a host, at most 64 stages)."""
    microbatches: tuple[int, ...] | None
    """Micro-batch counts tried (those that divide the per-replica batch); None: every
    divisor of the per-replica batch, so that a batch such as 1536 = 3 x 512 finds the
    m = 3k a pipeline needs (m >= stages still applies)."""
    fixed: tuple[tuple[str, int], ...]
    """Mesh axis sizes every plan has (``shardlib plan --fix tensor=8``); the other axes are
    searched."""
    required: tuple[str, ...]
    """Axes every plan has with a size > 1 (a fixed schedule needs a stage axis)."""

    def __init__(
        self,
        menus: Mapping[str, tuple] | tuple = (),
        limits: Mapping[str, int] | tuple = (),
        microbatches: tuple[int, ...] | None = None,
        fixed: tuple[tuple[str, int], ...] = (),
        required: tuple[str, ...] = (),
        **knobs: tuple,
    ):
        given = {**dict(menus), **knobs}
        unknown = sorted(set(given) - {k.name for k in KNOBS})
        if unknown:
            names = ", ".join(k.name for k in KNOBS)
            raise TypeError(f"Space: no knob {unknown}; knobs: {names}, microbatches.")
        values = tuple((k.name, tuple(given.get(k.name, k.values))) for k in KNOBS)
        object.__setattr__(self, "menus", values)
        object.__setattr__(self, "limits", tuple(dict(limits).items()))
        object.__setattr__(self, "microbatches", microbatches)
        object.__setattr__(self, "fixed", tuple(fixed))
        object.__setattr__(self, "required", tuple(required))

    def menu(self, knob: str) -> tuple:
        """The values tried for ``knob``."""
        return dict(self.menus)[knob]

    def limit(self, axis: str) -> int | None:
        """The largest size this space gives ``axis``, if it gives one."""
        return dict(self.limits).get(axis)

    def fixing(self, settings: Mapping[str, int | str | bool]) -> Space:
        """This space with ``settings`` fixed: axis sizes filter the meshes, a knob
        (``microbatches`` or a term's: ``zero``, ``schedule``, ``virtual``, ``remat``,
        ``offload``) becomes a menu of one, as its term says (``Term.fix``). Unknown names
        raise ShardingError."""
        axes = {str(a) for a in AXIS_ORDER}
        knobs = [MICROBATCHES, *(k.name for k in KNOBS)]
        unknown = sorted(set(settings) - axes - set(knobs))
        if unknown:
            raise ShardingError(
                f"--fix {', '.join(unknown)}: not an axis or knob. Fix: use "
                f"{', '.join([*AXIS_ORDER, *knobs])}."
            )
        fixed = tuple((k, int(v)) for k, v in settings.items() if k in axes)
        menus, required = dict(self.menus), list(self.required)
        for term in TERMS:
            own = {k.name: settings[k.name] for k in term.knobs if k.name in settings}
            if own:
                changes, needs = term.fix(own)
                menus.update(changes)
                required += [a for a in needs if a not in required]
        microbatches = self.microbatches
        if MICROBATCHES in settings:
            microbatches = (settings[MICROBATCHES],)
        return Space(menus, self.limits, microbatches, self.fixed + fixed, tuple(required))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(workload: Workload, cluster: Cluster, space: Space) -> Iterator[dict[str, int]]:
    """Axis sizes whose product is the device count and whose dims divide (cheap checks).

    The axes of ``SEARCH_AXES`` in their order, each over the divisors of the devices left
    up to its largest size that its ``admits`` takes; the last axis gets what is left; the
    batch must split over the batch axes. Yields ``{axis: size}`` for every axis of
    ``AXIS_ORDER``.
    """

    fixed = dict(space.fixed)

    def walk(i: int, left: int, chosen: dict[str, int]) -> Iterator[dict[str, int]]:
        axis = SEARCH_AXES[i]
        name, last = str(axis.axis), i == len(SEARCH_AXES) - 1
        largest = space.limit(name) or axis.largest(cluster)
        for size in (left,) if last else _divisors(left):
            if fixed.get(name, size) != size:
                continue
            if size > 1 and largest is not None and size > largest:
                continue
            if size > 1 and not axis.admits(workload, cluster, chosen, size):
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
    """For one mesh: lists of plans sharing every knob but the trades (ZeRO stage, schedule,
    m), each ordered lightest first over the trades (``TRADES``: remat, offload)."""
    if any(mesh[a] == 1 for a in space.required):
        return
    per_replica = _per_replica(workload, mesh)
    # each term's values of its own knobs on this mesh (``Term.choices``), then m
    choices = [term.choices(workload, mesh, space) for term in TERMS if term.choices]
    allows = [term.allows for term in TERMS if term.allows]
    menu = microbatch_menu(space, per_replica)
    trades = [space.menu(knob.name) for knob in TRADES]
    for *picked, m in itertools.product(*choices, menu):
        knobs = {k: v for part in picked for k, v in part.items()} | {MICROBATCHES: m}
        if per_replica % m and knobs.get("schedule") != "terapipe":  # its m slices seq
            continue
        if not all(ok(workload, mesh, knobs) for ok in allows):
            continue
        yield [
            candidate(**mesh, **knobs, **dict(zip([k.name for k in TRADES], heavier, strict=True)))
            for heavier in itertools.product(*trades)
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


def trade_ranks(space: Space) -> list[tuple[int, ...]]:
    """How heavy each plan of a knob group is on each trade (its value's place in
    ``Knob.values``; a value given outside them, such as remat=sqrt, after them), in the
    group's order (``knob_groups``: the product of the menus)."""
    menus = [space.menu(knob.name) for knob in TRADES]

    def rank(knob, value) -> int:
        return knob.values.index(value) if value in knob.values else len(knob.values)

    return [
        tuple(rank(knob, v) for knob, v in zip(TRADES, heavier, strict=True))
        for heavier in itertools.product(*menus)
    ]


UNORDERED = tuple(i for i, knob in enumerate(TRADES) if knob.name == "remat")
"""Trades whose heavier values are not always slower: recomputing saves fewer activations,
whose HBM round trip (``throughput.saved_seconds``) can cost more than the recompute (dense
attention's scores). Plans differing in them dominate nothing."""


def _dominated(rank: tuple[int, ...], fitting: list[tuple[int, ...]]) -> bool:
    """Some plan of ``fitting`` (the ranks of the group's fitting plans, or of those already
    too slow) is no heavier on any trade (no more offload) and the same on the unordered
    ones (``UNORDERED``: remat)."""
    return any(
        all(f <= r for f, r in zip(other, rank, strict=True))
        and all(other[i] == rank[i] for i in UNORDERED)
        for other in fitting
    )


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
    latency only grows with m). Where a term moves bytes that fall with more micro-batches
    (a pipeline loop's bubble trips) or has forms that move fewer (a 2.5D grid), its
    ``bounds`` name the plans that bound the mesh instead (every combination of the terms'
    bounds), at the most micro-batches ``m``; the smallest bound is kept. The compute is
    the matmuls' and elementwise work's only (``total.COMPUTE_EXTRAS`` left out)."""
    whole = estimate_or_none(workload, candidate(**mesh), cluster)
    if whole is None:
        return math.inf
    options = [whole]
    per_replica = _per_replica(workload, mesh)
    m = max((m for m in microbatch_menu(space, per_replica) if per_replica % m == 0), default=1)
    # each term's bounding knobs ([] : its defaults bound), combined across the terms
    per_term = [t.bounds(mesh, space, m) or [{}] for t in TERMS if t.bounds]
    bounds = [
        {k: v for part in combo for k, v in part.items()} for combo in itertools.product(*per_term)
    ]
    if bounds != [{}]:
        plans = [candidate(**mesh, **knobs) for knobs in bounds]
        options = [e for e in (estimate_or_none(workload, p, cluster) for p in plans) if e]
    critical = min((_critical_s(e, cluster) for e in options), default=math.inf)
    # the saved activations' round trip and the launches are no part of the bound: a
    # recomputing plan saves less than ``whole`` (remat=none) does
    extra = sum(whole.compute_parts.get(k, 0.0) for k in COMPUTE_EXTRAS)
    return whole.compute_s - extra + critical


def _critical_s(est: Estimate, cluster: Cluster) -> float:
    exposed = exposed_strategies(PlanView(est.plan))
    critical = (c for c in est.comms if is_exposed(c, exposed))
    return sum(collective_seconds(c, cluster, est.plan) for c in critical)


def _carry_key(plan: ParallelPlan, mesh: Mapping[str, int]) -> tuple:
    """The groups whose pruning carries over: without stages a step is no faster with more
    micro-batches (smaller matmuls, a reduction per micro-batch), so what fits or is too
    slow at m rules out heavier plans at every larger m too (groups come in ascending m
    per ZeRO stage and grid depth: a 2.5D grid is another layout of the tensor devices, not
    a heavier plan, and what fits in 1D says nothing of it); with stages each (ZeRO stage,
    schedule, v, m) stands alone."""
    view = PlanView(plan)
    if mesh["stage"] == 1:
        return (view.zero, view.settings["grid_depth"], view.settings["products"])
    return (view.zero, view.schedule, view.virtual, view.microbatches)


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
    group_ranks = trade_ranks(space)
    for bound, _, mesh in bounded:
        if bound == math.inf or (len(heap) >= top and bound > -heap[0][0][0]):
            break
        visited += 1
        carried: dict[tuple, tuple[list, list]] = {}
        for group in knob_groups(workload, mesh, space):
            ranks = {id(plan): r for plan, r in zip(group, group_ranks, strict=True)}
            fitting, too_slow = carried.setdefault(_carry_key(group[0], mesh), ([], []))
            best_here: Estimate | None = None
            worst = -heap[0][0][0] if len(heap) >= top else math.inf
            # the heaviest plan (most remat, offload) uses the least memory: if it does not
            # fit, nothing in the group does
            heaviest = group[-1]
            known: dict[int, Estimate | None] = {}
            rank = ranks[id(heaviest)]
            if not (_dominated(rank, fitting) or _dominated(rank, too_slow)):
                known[id(heaviest)] = est = estimate_or_none(workload, heaviest, cluster)
                evaluated += 1
                if est is None or not est.fits:
                    continue
            for plan in group:
                rank = ranks[id(plan)]
                if _dominated(rank, fitting) or _dominated(rank, too_slow):
                    continue
                if id(plan) in known:
                    est = known[id(plan)]
                else:
                    est = estimate_or_none(workload, plan, cluster)
                    evaluated += 1
                if est is not None and rank_key(est)[0] > worst:
                    too_slow.append(rank)
                    continue
                if est is None or not est.fits:
                    continue
                fitting.append(rank)
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
