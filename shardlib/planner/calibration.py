"""Fit the cost model's free coefficients to compiled programs (``explain``), and keep them.

The collective terms are exact formulas; the memory model has a few free numbers because
XLA's fusion and scheduling decide what the backward pass keeps: how many elements per token
a layer saves at each width, what the loss head keeps, how many gathered layers are live
under FSDP. The model is linear in them, so a least-squares fit over a handful of compiled
probes recovers them: ``python -m shardlib.planner.calibration`` compiles ``PROBES`` on 8
simulated CPU devices (abstract shapes: nothing allocated), fits, and prints the table to
paste below. Validation (``planner.validate``, ``benchmarks/planner_validation.py``) checks
the fitted model on *other* plans, models and device counts.
"""

from __future__ import annotations

import json
import sys

import numpy as np

# Fitted on the CPU backend (fp32, jax 0.10.2) with `python -m shardlib.planner.calibration`.
COEFFICIENTS: dict[str, float] = {
    "layer_h": 4.109,  # elements of width h saved per token per layer (norms, residual)
    "layer_qkv": 2.707,  # ... of width (heads + 2 kv_heads) x head_dim, split by tensor
    "layer_mlp": 5.276,  # ... of width mlp, split by tensor
    "layer_scores": 3.217,  # ... of width heads x seq (scores, probabilities)
    "head_vocab": 0.761,  # fp32 logits-sized buffers of the loss (logits, softmax, gradient)
    "head_h": 11.383,  # fp32 h-sized buffers around the head
    "fsdp_layers_live": 0.011,  # gathered layers live at once under FSDP (beyond the grads')
    "fsdp_outer_live": 0.734,  # gathered embedding/head copies live at once
    "grad_layers_live": 1.793,  # a layer's unreduced gradient in flight
    "fixed_bytes": 74976.0,  # runtime scratch independent of the model
}
# Fit residuals on the 27 probes: memory within 2.6% (max), collective bytes exact.
# Read the layer counts as a sum: the probes vary q/k/v, h and mlp widths only partly
# independently, so XLA's fused buffers are shared out between them by the fit.

FREE = tuple(COEFFICIENTS)

PROBES: tuple[tuple[dict[str, int], str], ...] = (
    ({"data": 8}, "batch=16 model.layers=2"),
    ({"data": 8}, "batch=16 model.layers=4"),
    ({"data": 8}, "batch=16 model.layers=2 model.mlp=2048"),
    ({"data": 8}, "batch=16 model.layers=2 seq=256"),
    ({"data": 8}, "batch=16 model.layers=2 model.heads=16 model.kv_heads=8 model.head_dim=16"),
    ({"data": 8}, "batch=16 model.layers=2 model.embed=512"),
    ({"data": 8}, "batch=16 model.layers=2 model.vocab=8192"),
    ({"data": 8}, "batch=32 model.layers=4"),
    ({"data": 4, "tensor": 2}, "batch=8 model.layers=2"),
    ({"data": 2, "tensor": 4}, "batch=4 model.layers=4"),
    ({"fsdp": 8}, "batch=16 model.layers=2"),
    ({"fsdp": 8}, "batch=16 model.layers=4"),
    ({"fsdp": 4, "tensor": 2}, "batch=8 model.layers=4"),
    ({"data": 8}, "model=llama-tiny seq=64 batch=16"),
    ({"fsdp": 8}, "model=llama-tiny seq=64 batch=16 microbatches=2"),
    ({"data": 4, "tensor": 2}, "model=llama-tiny seq=32 batch=8"),
)
PROBE_BASE = "model=llama-small seq=128"


def measure(mesh_sizes: dict[str, int], overrides: str) -> dict:
    """Compile one train step from abstract shapes and return what ``explain`` measured."""
    from shardlib.explain import explain
    from shardlib.mesh import MeshSpec
    from shardlib.train.config import parse_overrides
    from shardlib.train.setup import make_setup

    cfg = parse_overrides(overrides.split())
    mesh = MeshSpec(tuple(mesh_sizes.items())).build()
    setup = make_setup(cfg, mesh)
    report = explain(setup.train_step, setup.abstract_state(), setup.abstract_batch(), mesh=mesh)
    return {
        "mesh": mesh_sizes,
        "overrides": overrides,
        "memory": report.memory.total_bytes,
        "wire": sum(t["wire_bytes"] for t in report.collective_totals.values()),
        "wire_by_axes": {k: v["wire_bytes"] for k, v in report.collective_totals_by_axis.items()},
        "flops": report.flops_per_device,
    }


def plan_and_workload(mesh_sizes: dict[str, int], overrides: str):
    from shardlib.planner.candidate import Plan
    from shardlib.planner.workload import Workload
    from shardlib.train.config import parse_overrides

    cfg = parse_overrides(overrides.split())
    plan = Plan(**mesh_sizes, microbatches=cfg.microbatches)
    return Workload.from_train_config(cfg), plan


def predicted_memory(mesh_sizes, overrides, calib) -> float:
    from shardlib.planner.cost import estimate

    workload, plan = plan_and_workload(mesh_sizes, overrides)
    return estimate(workload, plan, backend="cpu", calib=calib).memory_bytes


def fit(records: list[dict]) -> dict[str, float]:
    """Least squares (relative error) of compiled memory on the model's free coefficients."""
    zero = dict.fromkeys(FREE, 0.0)
    rows, target = [], []
    for r in records:
        base = predicted_memory(r["mesh"], r["overrides"], zero)
        cols = [predicted_memory(r["mesh"], r["overrides"], {**zero, k: 1.0}) - base for k in FREE]
        rows.append([c / r["memory"] for c in cols])
        target.append((r["memory"] - base) / r["memory"])
    a, b = np.array(rows), np.array(target)
    coef = _nonnegative_lstsq(a, b)
    return {k: round(float(v), 3) for k, v in zip(FREE, coef, strict=True)}


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


def main() -> int:
    import shardlib

    shardlib.simulate_cpu_devices(8)
    records = []
    for mesh, overrides in PROBES:
        rec = measure(mesh, f"{PROBE_BASE} {overrides}")
        print(json.dumps(rec), file=sys.stderr, flush=True)
        records.append(rec)
    coefficients = fit(records)
    for r in records:
        pred = predicted_memory(r["mesh"], r["overrides"], coefficients)
        print(f"{r['mesh']!s:28} {r['overrides']:70} {pred / r['memory']:.3f}")
    print(json.dumps(coefficients, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
