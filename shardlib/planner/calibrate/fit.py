"""Fit the cost model's free coefficients to compiled programs (``explain``), and keep them.

The collective terms are exact formulas; the memory model has a few free numbers because
XLA's fusion and scheduling decide what the backward pass keeps: how many elements per token
a layer saves at each width, what the loss head keeps, how many gathered layers are live
under FSDP. The model is linear in them, so a least-squares fit over a handful of compiled
probes recovers them: ``python -m shardlib.planner.calibrate.fit`` compiles ``PROBES`` on 8
simulated CPU devices (abstract shapes: nothing allocated), fits, and prints the table to
paste into ``shardlib/planner/cost/coefficients.py``. Validation (``planner.validate``,
``benchmarks/planner_validation.py``) checks the fitted model on *other* plans, models and
device counts (``benchmarks/planner_scale_validation.py``: full-depth models on up to 2048).

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
from shardlib.planner.calibrate.gpt_probes import GPT_FREE, GPT_PROBES
from shardlib.planner.candidate import candidate
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

Probe = tuple[ParallelPlan, str]
"""A plan and the workload it is compiled on (``TrainConfig`` words: model, batch, seq and
``model.NAME``; ``PROBE_BASE`` first)."""

PROBES: tuple[Probe, ...] = (
    (candidate(data=8), "batch=16 model.layers=2"),
    (candidate(data=8), "batch=16 model.layers=4"),
    (candidate(data=8), "batch=16 model.layers=2 model.mlp=2048"),
    (candidate(data=8), "batch=16 model.layers=2 seq=256"),
    (
        candidate(data=8),
        "batch=16 model.layers=2 model.heads=16 model.kv_heads=8 model.head_dim=16",
    ),
    (candidate(data=8), "batch=16 model.layers=2 model.embed=512"),
    (candidate(data=8), "batch=16 model.layers=2 model.vocab=8192"),
    (candidate(data=8), "batch=32 model.layers=4"),
    (candidate(data=4, tensor=2), "batch=8 model.layers=2"),
    (candidate(data=2, tensor=4), "batch=4 model.layers=4"),
    (candidate(fsdp=8), "batch=16 model.layers=2"),
    (candidate(fsdp=8), "batch=16 model.layers=4"),
    (candidate(fsdp=4, tensor=2), "batch=8 model.layers=4"),
    (candidate(data=8), "model=llama-tiny seq=64 batch=16"),
    (candidate(fsdp=8, microbatches=2), "model=llama-tiny seq=64 batch=16"),
    (candidate(data=4, tensor=2), "model=llama-tiny seq=32 batch=8"),
    (candidate(data=8, remat="selective"), "batch=16 model.layers=2"),
    (candidate(data=8, remat="selective"), "batch=16 model.layers=4 seq=256"),
    (candidate(data=4, tensor=2, remat="selective"), "batch=8 model.layers=2 model.mlp=2048"),
    (candidate(fsdp=4, tensor=2, remat="selective"), "batch=16 model.layers=4 seq=256"),
    (candidate(data=8, remat="full"), "batch=16 model.layers=2"),
    (candidate(data=8, remat="full"), "batch=16 model.layers=4 seq=256"),
    (candidate(fsdp=4, tensor=2, remat="full"), "batch=16 model.layers=4 seq=256"),
    (candidate(data=8, remat="full"), "batch=32 model.layers=6"),
    (candidate(data=8, remat="full"), "batch=16 model.layers=2 seq=512"),
    (candidate(data=8, remat="full"), "batch=16 model.layers=4 seq=512"),
    (candidate(data=4, tensor=2, remat="selective"), "batch=8 model.layers=2 seq=512"),
    (candidate(data=8, zero=1), "batch=16 model.layers=2"),
    (candidate(data=8, zero=1), "batch=16 model.layers=4 seq=256"),
    (candidate(data=8, zero=2, microbatches=2), "batch=16 model.layers=2"),
    (candidate(data=4, tensor=2, zero=1, microbatches=2), "batch=16 model.layers=4"),
    (candidate(data=8), "batch=16 model.layers=4 model.mlp=2048"),
    (candidate(data=4, tensor=2), "batch=8 model.layers=4 model.mlp=2048"),
    (
        candidate(data=8),
        "batch=16 model.layers=4 model.heads=16 model.kv_heads=8 model.head_dim=16",
    ),
    (candidate(fsdp=4, tensor=2), "batch=16 model.layers=6 model.kv_heads=8"),
    (candidate(fsdp=2, tensor=4), "batch=16 model.layers=2 model.kv_heads=8 seq=256"),
    (candidate(fsdp=8, microbatches=2), "batch=16 model.layers=4 seq=64"),
    (candidate(fsdp=8, microbatches=4), "batch=32 model.layers=2"),
    (candidate(data=2, fsdp=2, tensor=2), "batch=16 model.layers=4 seq=256"),
    # one sequence per device, as on large meshes
    (candidate(fsdp=4, tensor=2, remat="full"), "batch=4 model.layers=4 seq=256"),
    (candidate(data=2, fsdp=4, remat="selective"), "batch=8 model.layers=4 seq=256"),
    (candidate(fsdp=8, remat="selective"), "batch=8 model.layers=4 seq=256"),
    (candidate(data=8, remat="full"), "batch=8 model.layers=4 seq=256"),
    # published widths (few layers): head_dim 64-128, mlp/h 2.7-4, seq 1024-2048
    (candidate(fsdp=8), "model=llama-1b batch=16 seq=1024 model.layers=4"),
    (candidate(fsdp=8, remat="selective"), "model=llama-1b batch=16 seq=1024 model.layers=4"),
    (candidate(fsdp=4, tensor=2, remat="full"), "model=llama-1b batch=8 seq=2048 model.layers=2"),
    (candidate(fsdp=8), "model=llama-7b batch=8 seq=2048 model.layers=2"),
    (candidate(fsdp=8, remat="selective"), "model=llama-7b batch=16 seq=2048 model.layers=4"),
    (
        candidate(fsdp=4, tensor=2, remat="selective"),
        "model=llama-7b batch=8 seq=1024 model.layers=2",
    ),
    (candidate(data=2, fsdp=4, remat="full"), "model=llama-7b batch=16 seq=1024 model.layers=2"),
    (candidate(fsdp=8, microbatches=2), "model=llama-7b batch=16 seq=2048 model.layers=2"),
    (candidate(fsdp=8), "model=llama-7b batch=8 seq=2048 model.layers=6"),
    (candidate(fsdp=8), "model=llama-1b batch=8 seq=2048 model.layers=8"),
    (candidate(fsdp=4, context=2), "model=llama-7b batch=8 seq=4096 model.layers=3"),
)
_MOE = "model=moe-tiny model.embed=256 model.mlp=1024 model.heads=8 model.kv_heads=4"
_MOE += " model.head_dim=32 model.layers=4 model.moe_every=2 model.expert_mlp=512"
MOE_PROBES: tuple[Probe, ...] = (
    (candidate(expert=8), _MOE),
    (candidate(expert=8), f"{_MOE} seq=256"),
    (candidate(expert=8), f"{_MOE} model.expert_mlp=1024"),
    (candidate(expert=8), f"{_MOE} model.moe_every=1"),
    (candidate(expert=8), f"{_MOE} model.top_k=1"),
    (candidate(data=2, expert=4), f"{_MOE} model.experts=16"),
    (candidate(data=2, expert=4), f"{_MOE} model.moe_every=1 model.layers=2"),
    (candidate(data=2, expert=4), _MOE),
    (candidate(data=2, expert=4), f"{_MOE} model.moe_every=3 model.layers=6"),
    (candidate(expert=4, tensor=2), _MOE),
    (candidate(expert=4, tensor=2), f"{_MOE} model.capacity_factor=1.0 model.expert_mlp=768"),
    (candidate(fsdp=2, expert=4), _MOE),
    (candidate(fsdp=2, expert=4), f"{_MOE} model.embed=128 model.moe_every=1 seq=64 batch=32"),
    (candidate(data=8), _MOE),
)
CONTEXT_PROBES: tuple[Probe, ...] = (
    (candidate(data=4, context=2), "batch=16 model.layers=2"),
    (candidate(data=4, context=2), "batch=16 model.layers=4"),
    (candidate(data=4, context=2), "batch=16 model.layers=2 seq=256"),
    (candidate(data=4, context=2, microbatches=2), "batch=16 model.layers=2"),
    (candidate(data=2, context=4), "batch=16 model.layers=2"),
    (candidate(data=2, context=4), "batch=16 model.layers=4"),
    (candidate(data=2, context=4), "batch=16 model.layers=2 seq=512"),
    (candidate(data=4, context=2), "batch=16 model.layers=2 model.heads=16 model.head_dim=16"),
)
PIPELINE_PROBES: tuple[Probe, ...] = (
    (candidate(data=2, stage=4, schedule="gpipe", microbatches=4), "batch=16 model.layers=4"),
    (candidate(data=2, stage=4, schedule="gpipe", microbatches=2), "batch=16 model.layers=4"),
    (candidate(data=4, stage=2, schedule="gpipe", microbatches=2), "batch=16 model.layers=4"),
    (candidate(stage=4, fsdp=2, schedule="gpipe", microbatches=4), "batch=16 model.layers=4"),
    (candidate(stage=4, tensor=2, schedule="gpipe", microbatches=4), "batch=16 model.layers=4"),
    (
        candidate(data=2, stage=2, tensor=2, schedule="gpipe", microbatches=2),
        "batch=32 model.layers=4",
    ),
    (
        candidate(data=2, stage=4, schedule="gpipe", microbatches=4),
        "batch=16 model.layers=4 model.vocab=16384",
    ),
    (candidate(data=2, stage=4, schedule="1f1b", microbatches=4), "batch=16 model.layers=4"),
    (
        candidate(data=2, stage=4, schedule="circular", virtual=2, microbatches=4),
        "batch=16 model.layers=8",
    ),
    (
        candidate(stage=2, fsdp=4, schedule="circular", virtual=2, microbatches=2),
        "batch=16 model.layers=4",
    ),
    (
        candidate(data=2, stage=2, tensor=2, schedule="circular", virtual=2, microbatches=4),
        "batch=16 model.layers=8 model.mlp=2048",
    ),
    (
        candidate(stage=2, data=4, schedule="circular", virtual=4, microbatches=2),
        "batch=16 model.layers=8 seq=256",
    ),
)
# Published widths at tensor 1-8, with the buffers that grow with them: 7B-class
# (h 4096), 39B-class (h 8192) and 175B-class (h 12288) layers, seq 2048, a few layers each
# (the per-layer parts scale with the count; held-out validation runs the full depth:
# ``benchmarks/planner_scale_validation.py``). Every remat policy, ZeRO-1/2, 1F1B and
# interleaved pipelines; 8 devices, so the fit never needs a large simulated mesh.
_W7 = "model=llama-7b seq=2048"
_W39 = "model=llama-70b model.kv_heads=64 model.mlp=21760 model.vocab=51200 seq=2048"
_W175 = (
    "model=llama-70b model.embed=12288 model.heads=96 model.kv_heads=96 model.mlp=32768 "
    "model.vocab=51200 seq=2048"
)
SCALE_PROBES: tuple[Probe, ...] = (
    # activations outweigh the parameters here (the rest are weight-heavy at 2 layers)
    (candidate(tensor=8, remat="selective"), f"{_W7} batch=8 model.layers=4"),
    (candidate(tensor=8, remat="full"), f"{_W7} batch=8 model.layers=4"),
    (candidate(tensor=8, remat="selective"), f"{_W7} batch=2 model.layers=2"),
    (candidate(tensor=8, remat="selective"), f"{_W175} batch=1 model.layers=2"),
    (candidate(fsdp=2, tensor=4, remat="selective"), f"{_W39} batch=2 model.layers=2"),
    (candidate(fsdp=4, tensor=2, remat="selective"), f"{_W175} batch=4 model.layers=2"),
    (candidate(tensor=8, remat="full"), f"{_W175} batch=2 model.layers=4"),
    (candidate(fsdp=2, tensor=4, remat="full"), f"{_W7} batch=4 model.layers=4"),
    (candidate(tensor=8), f"{_W39} batch=1 model.layers=2"),
    (
        candidate(data=2, tensor=4, zero=1, microbatches=2, remat="selective"),
        f"{_W39} batch=4 model.layers=2",
    ),
    (
        candidate(data=2, tensor=4, zero=2, microbatches=2, remat="full"),
        f"{_W7} batch=4 model.layers=2",
    ),
    (
        candidate(stage=2, tensor=4, schedule="1f1b", microbatches=4, remat="full"),
        f"{_W39} batch=4 model.layers=4",
    ),
    (
        candidate(stage=2, tensor=4, schedule="1f1b", microbatches=2, remat="selective"),
        f"{_W7} batch=4 model.layers=4",
    ),
    (
        candidate(stage=2, tensor=4, schedule="circular", virtual=2, microbatches=2, remat="full"),
        f"{_W39} batch=2 model.layers=4",
    ),
)
# Vocab moved apart from h (h 256-512 at vocab 2048-32768; 7B width at 8192 and 128256),
# where the fitted probes keep vocab / h near 32 at small widths. Measured, not fitted: the
# head's sum of fp32 logits-sized and h-sized buffers does not hold them (coefficients.py).
HEAD_PROBES: tuple[Probe, ...] = tuple(
    (candidate(**plan), words)
    for plan, words in (
        (dict(data=8), "batch=16 model.layers=2 model.vocab=32768"),
        (dict(data=8), "batch=16 model.layers=2 model.vocab=2048"),
        (dict(data=8, remat="full"), "batch=16 model.layers=2 model.vocab=32768 model.embed=512"),
        (dict(fsdp=8), "batch=16 model.layers=2 model.vocab=32768"),
        (dict(fsdp=4, tensor=2, remat="full"), "batch=16 model.layers=4 seq=256 model.vocab=32768"),
        (dict(fsdp=2, tensor=4, remat="full"), "batch=8 model.layers=4 seq=256"),
        (dict(fsdp=2, tensor=4, remat="full"), "batch=8 model.layers=4 seq=256 model.vocab=32768"),
        (
            dict(fsdp=2, tensor=4, remat="full"),
            "batch=8 model.layers=4 seq=256 model.vocab=2048 model.embed=512",
        ),
        (
            dict(data=2, tensor=4, remat="selective"),
            "batch=4 model.layers=2 seq=256 model.vocab=32768",
        ),
        (dict(tensor=8, remat="full"), f"{_W7} batch=2 model.layers=2 model.vocab=128256"),
        (dict(fsdp=4, tensor=2, remat="full"), f"{_W7} batch=4 model.layers=2 model.vocab=8192"),
    )
)
GROUPS: dict[str, tuple[Probe, ...]] = {
    "small": PROBES + CONTEXT_PROBES + MOE_PROBES + PIPELINE_PROBES,
    "scale": SCALE_PROBES,
    "head": HEAD_PROBES,
    "gpt": GPT_PROBES,  # the GPT block's own counts (``--free gpt``; gpt_probes.py)
}
GROUPS["remat"] = tuple(
    (plan, words) for plan, words in GROUPS["small"] if plan.remat.policy != "none"
)
"""The small probes with a remat policy: what ``--free remat`` refits besides ``scale``."""
PROBES = GROUPS["small"] + SCALE_PROBES
PROBE_BASE = "model=llama-small seq=128"


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
