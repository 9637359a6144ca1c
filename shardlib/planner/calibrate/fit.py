"""Fit the cost model's free coefficients to compiled programs (``explain``), and keep them.

The collective terms are exact formulas; the memory model has a few free numbers because
XLA's fusion and scheduling decide what the backward pass keeps: how many elements per token
a layer saves at each width, what the loss head keeps, how many gathered layers are live
under FSDP. The model is linear in them, so a least-squares fit over a handful of compiled
probes recovers them: ``python -m shardlib.planner.calibrate.fit`` compiles ``PROBES``
(``probes.py``) on 8 simulated CPU devices (abstract shapes: nothing allocated), fits, and
prints the table to paste into ``shardlib/planner/cost/coefficients.py``. Validation
(``planner.validate``, ``benchmarks/planner_validation.py``) checks the fitted model on
*other* plans, models and device counts (``benchmarks/planner_scale_validation.py``:
full-depth models on up to 2048).

Where a policy keeps buffers by definition, those are counted as such (``terms.remat.KEPT``)
and the coefficients are what XLA keeps on top, fitted non-negative. The measurements of
the remat and published-width probes are kept in ``REMAT_RECORDS`` (JSON lines), so a
change to those terms refits without compiling anything:

    python -m shardlib.planner.calibrate.fit \
        --records shardlib/planner/calibrate/remat_probes.jsonl --free remat
    # regenerate the records (8 simulated devices; minutes):
    python -m shardlib.planner.calibrate.fit --group remat --save /tmp/remat.jsonl
    python -m shardlib.planner.calibrate.fit --group scale --save /tmp/scale.jsonl
    cat /tmp/remat.jsonl /tmp/scale.jsonl > shardlib/planner/calibrate/remat_probes.jsonl
    # the pipeline coefficients alone, after a pipeline change (re-measure its probes first):
    python -m shardlib.planner.calibrate.fit --group small --save /tmp/small.jsonl
    python -m shardlib.planner.calibrate.fit --records /tmp/small.jsonl \
        shardlib/planner/calibrate/remat_probes.jsonl --free pipeline

``--group head`` compiles probes that are not fitted (``HEAD_PROBES``): pass their records
with the others to see the head's miss.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np

from shardlib.core.mesh import MeshSpec, simulate_cpu_devices
from shardlib.parallel.plan import ParallelPlan
from shardlib.planner.calibrate.gpt_probes import GPT_FREE
from shardlib.planner.calibrate.probes import GROUPS, PROBE_BASE, PROBES
from shardlib.planner.cost.coefficients import BLOCK_KINDS, COEFFICIENTS

FREE = tuple(k for k in COEFFICIENTS if not k.startswith(tuple(f"{b}_" for b in BLOCK_KINDS)))
REMAT_RECORDS = "shardlib/planner/calibrate/remat_probes.jsonl"
"""The compiled ``remat`` and ``scale`` probe groups (jax 0.10.2, CPU, fp32)."""
FREE_SETS: dict[str, tuple[str, ...]] = {
    "remat": tuple(k for k in FREE if k.startswith(("selective_", "full_", "remat_"))),
    "pipeline": tuple(k for k in FREE if k.startswith("pipe_")),
    "layers": tuple(k for k in FREE if k.startswith("layer_")) + ("moe_dense_mlp",),
    "gpt": GPT_FREE,
}
"""Coefficient subsets ``--free`` refits alone: a change to one policy's buffers (``remat``:
on ``--group remat`` and ``scale`` records) or to the pipelines' (``pipeline``: on all
records, its own probes re-measured) or to what a block keeps without remat (``layers``: the
``layer_*`` counts and MoE models' dense blocks, on all records re-measured) leaves the other
coefficients as they are."""


def train_config(plan: ParallelPlan, words: str):
    """The ``TrainConfig`` of a probe: its workload words, and the plan as its ``parallel``."""
    from shardlib.train.config import parse_overrides

    return dataclasses.replace(parse_overrides(words.split()), parallel=plan)


def measure(plan: ParallelPlan, words: str) -> dict:
    """Compile one train step from abstract shapes and return what ``explain`` measured."""
    from shardlib.analysis import explain
    from shardlib.train.setup import make_setup

    mesh = plan.build_mesh()
    setup = make_setup(train_config(plan, words), mesh)
    state = setup.abstract_state()
    batch = setup.abstract_batch()
    report = explain(setup.train_step, state, batch, mesh=mesh, params=state["params"])
    return {
        "mesh": dict(plan.mesh.axes),
        "parallel": plan.tables(),
        "overrides": words,
        "memory": report.memory.total_bytes,
        "wire": sum(t["wire_bytes"] for t in report.collective_totals.values()),
        "wire_by_axes": {k: v["wire_bytes"] for k, v in report.collective_totals_by_axis.items()},
        "flops": report.flops_per_device,
    }


def record_plan(record: dict) -> ParallelPlan:
    """The plan a record was measured on (its ``[mesh]`` and ``[parallel.*]`` tables)."""
    spec = MeshSpec(tuple(record["mesh"].items()), parallel=record.get("parallel", {}))
    return ParallelPlan.from_mesh_spec(spec)


def predicted_memory(record: dict, calib) -> float:
    from shardlib.core.workload import Workload
    from shardlib.planner.cost.total import estimate

    plan = record_plan(record)
    workload = Workload.from_train_config(train_config(plan, record["overrides"]))
    return estimate(workload, plan, backend="cpu", calib=calib).memory_bytes


def fit(records: list[dict], rounds: int = 60, free: tuple[str, ...] = FREE) -> dict[str, float]:
    """Fit the free coefficients to compiled memory, minimising the *worst* relative error.

    The target is a bound on every plan (the issue's "within 10%"), not a good average, so
    the least-squares fit is reweighted the way Lawson's algorithm approaches the minimax
    solution: each round multiplies a probe's weight by its current error, so the probes
    the fit serves worst pull hardest in the next round.
    """
    zero = {**COEFFICIENTS, **dict.fromkeys(free, 0.0)}  # the rest stay as they are
    rows, target = [], []
    for r in records:
        base = predicted_memory(r, zero)
        cols = [predicted_memory(r, {**zero, k: 1.0}) - base for k in free]
        if not any(cols):  # no coefficient being fitted reaches this probe
            continue
        rows.append([c / r["memory"] for c in cols])
        target.append((r["memory"] - base) / r["memory"])
    a, b = np.array(rows), np.array(target)
    weights = np.full(len(b), 1.0 / len(b))
    best, best_err = None, np.inf
    for _ in range(rounds):
        root = np.sqrt(weights)[:, None]
        coef = _nonnegative_lstsq(a * root, b * root[:, 0])
        err = np.abs(a @ coef - b)
        if err.max() < best_err:
            best, best_err = coef, err.max()
        weights = weights * np.maximum(err, 1e-9)
        weights /= weights.sum()
    fitted = {k: round(float(v), 3) for k, v in zip(free, best, strict=True)}
    return {**COEFFICIENTS, **fitted}


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: drop the most negative and refit until none is."""
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def main(argv: list[str] | None = None) -> int:
    """Compile the probes (or read them back with ``--records FILE``), fit, print the table."""
    import argparse

    parser = argparse.ArgumentParser(description="fit the planner's memory coefficients")
    parser.add_argument("--records", nargs="*", help="JSON lines of earlier measurements: fit only")
    parser.add_argument("--save", help="write the measurements here (JSON lines)")
    parser.add_argument("--group", choices=tuple(GROUPS), help="compile only these probes")
    parser.add_argument(
        "--free",
        choices=tuple(FREE_SETS),
        help="refit only these coefficients (the rest keep coefficients.py's values)",
    )
    args = parser.parse_args(argv)
    if args.records:
        records = []
        for path in args.records:
            with open(path) as f:
                records += [json.loads(line) for line in f if line.startswith("{")]
    else:
        simulate_cpu_devices(8)
        records = []
        for plan, words in GROUPS[args.group] if args.group else PROBES:
            records.append(measure(plan, f"{PROBE_BASE} {words}"))
            print(json.dumps(records[-1]), file=sys.stderr, flush=True)
    if args.save:
        with open(args.save, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    coefficients = fit(records, free=FREE_SETS[args.free] if args.free else FREE)
    worst = 0.0
    for r in records:
        ratio = predicted_memory(r, coefficients) / r["memory"]
        worst = max(worst, abs(ratio - 1))
        print(f"{record_plan(r).describe():50} {r['overrides']:70} {ratio:.3f}")
    print(json.dumps(coefficients, indent=1))
    print(f"{len(records)} probes, worst memory error {worst:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
