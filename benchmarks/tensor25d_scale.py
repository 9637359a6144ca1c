"""The planner's 2D/2.5D term against compiled programs at 7B/13B width on 64-256 devices.

    python benchmarks/tensor25d_scale.py            # every row below (about 3 minutes)
    python benchmarks/tensor25d_scale.py --rows 0,1 # some of them

The tests check the term on llama-small (``tests/planner/test_planner_tensor25d.py``); the
default search tries grids beside data, so this says how far the term holds at the widths
the search proposes them for. Each plan is compiled from abstract shapes on simulated CPU
devices (``planner.validate``: nothing is allocated, fp32) and compared with
``estimate(..., backend="cpu")``. Few layers keep the compile short: every layer is the same
program, so the per-layer share is the same at full depth. Target: memory within 10%; wire
bytes are printed beside it.

Measured (jax 0.10.2, CPU, fp32, 2 cores; 6-9 s a row, 2026-11-27 at ``4d08481``):

| row | model, layers | mesh (grid d, knobs) | memory pred. / compiled GiB | wire |
| --- | --- | --- | --- | --- |
| 0 | llama-7b, 8 | data=4 x 4 x 4 (d=1) | 7.719 / 7.945 = 0.972 | 1.031 |
| 1 | llama-7b, 8 | data=2 x 2 x 4 x 4 (d=2) | 7.719 / 7.945 = 0.972 | 1.016 |
| 2 | llama-7b, 8 | 4 x 4 x 4 (d=4) | 7.719 / 7.945 = 0.972 | 0.996 |
| 3 | llama-7b, 8 | data=4 x 4 x 4 (d=1, remat=selective) | 4.062 / 4.005 = 1.014 | 0.963 |
| 4 | llama-7b, 8 | 4 x 4 x 4 (d=4, m=2, remat=full) | 3.019 / 3.318 = 0.910 | 0.993 |
| 5 | llama2-13b, 4 | data=4 x 4 x 4 x 4 (d=4; 256 devices) | 3.122 / 3.326 = 0.939 | 1.041 |
| 6 | llama-7b, 8 | data=4 x 4 x 4 (d=1, zero1) | 7.013 / 7.090 = 0.989 | 1.020 |
| 7 | llama-7b, 8 | data=4 x 4 x 4 (d=1, zero2, remat=full) | 2.185 / 2.215 = 0.986 | 1.038 |
| 8 | llama-small, 3 (8 devices) | 2 x 2 x 2 (d=2, remat=full) | 0.041 / 0.040 = 1.033 | 0.959 |
| 9 | llama-small, 3 (8 devices) | 3D 2 x 2 x 2 | 0.031 / 0.032 = 0.972 | 0.998 |
| 10 | llama-7b, 8 | 3D 4 x 4 x 4 | 6.356 / 6.543 = 0.971 | 0.974 |
| 11 | llama-7b, 8 | 3D data=4 x 2 x 2 x tensor=4 (remat=full) | 2.890 / 3.042 = 0.950 | 1.017 |
| 12 | llama-7b, 8 | data=4 x 4 x 4 (d=1, remat=full) | 2.890 / 3.042 = 0.950 | 1.048 |
| 13 | llama-7b, 8 | data=4 x 4 x 4 (d=1, summa) | 7.305 / 7.547 = 0.968 | 0.997 |
| 14 | llama-7b, 8 | data=2 x 2 x 4 x 4 (d=2, summa) | 7.305 / 7.510 = 0.973 | 0.986 |
| 15 | llama-7b, 8 | 4 x 4 x 4 (d=4, summa) | 7.305 / 7.547 = 0.968 | 0.997 |
| 16 | llama-7b, 8 | data=4 x 4 x 4 (d=1, summa, remat=full) | 3.226 / 3.223 = 1.001 | 1.014 |

(batch 64 x seq 1024; rows 8 and 9 16 x 32; grids written tensor_depth x tensor2 x tensor.)
Rows 0-2, 5, 6, 9 and 10 read 0.988 / 0.925 / 1.007 / 0.962 / 0.991 when first written, on
the same compiled bytes: the planner's side moved (by other terms' changes since; which one
was not traced), not 2.5D's own term.
Rows 13-16 (``products = "summa"``), priced as the megatron form before the planner knew
summa: memory 1.023 / 1.028 / 1.023 / 0.897, wire 0.748 / 0.718 / 0.722 / 0.813 (the
residual's moves instead of each product's three activation terms). Summa with
remat=selective compiles to remat=full's program (3.223 GiB, full's bytes over ``tensor``:
its products are custom VJPs a dots policy does not save), so the planner does not cost it.
All seventeen within 10%. Rows 3 and 12 read 1.151 and 1.130 (and row 7 1.234) while the
head's ``head_h`` fp32 h-wide buffers (11.7 per token, fitted on 1D programs) were booked
whole: a grid keeps the residual stream split over ``tensor``, and XLA's buffers at those
plans' peaks (``--xla_dump_to``: the live-range dump) hold no whole-width head buffer but
the lookup's two outputs; booked h/q wide (``terms.tensor25d._head_split``) they read 1.014
and 0.950. The lowest, row 4 (0.910), allocates 3.318 GiB for a 2.604 GiB live peak (the
CPU backend's buffer assignment packs its heap loosely there), which no term books.
``remat=full``'s recomputed forward is booked (``RECOMPUTED_GATHERS``, the column weights'
second gather): rows 4 and 7 read 0.834 and 0.864 on wire bytes without it. 3D rows are
written tensor3 x tensor2 x tensor where the sizes differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too

import argparse
import time

THREE_D_DATA = (("data", 4), ("tensor3", 2), ("tensor2", 2), ("tensor", 4))
# (devices, model, layers, global batch, seq, candidate keywords)
ROWS = [
    (64, "llama-7b", 8, 64, 1024, dict(data=4, tensor=16, grid_depth=1)),
    (64, "llama-7b", 8, 64, 1024, dict(data=2, tensor=32, grid_depth=2)),
    (64, "llama-7b", 8, 64, 1024, dict(tensor=64, grid_depth=4)),
    (64, "llama-7b", 8, 64, 1024, dict(data=4, tensor=16, grid_depth=1, remat="selective")),
    (64, "llama-7b", 8, 64, 1024, dict(tensor=64, grid_depth=4, remat="full", microbatches=2)),
    (256, "llama2-13b", 4, 64, 1024, dict(data=4, tensor=64, grid_depth=4)),
    (64, "llama-7b", 8, 64, 1024, dict(data=4, tensor=16, grid_depth=1, zero=1)),
    (64, "llama-7b", 8, 64, 1024, dict(data=4, tensor=16, grid_depth=1, zero=2, remat="full")),
    (8, "llama-small", 3, 16, 32, dict(tensor=8, grid_depth=2, remat="full")),  # the test's size
    # 3D (tensor x tensor2 x tensor3: the grid with rows over two axes), given as mesh axes
    (8, "llama-small", 3, 16, 32, dict(mesh=(("tensor", 2), ("tensor2", 2), ("tensor3", 2)))),
    (64, "llama-7b", 8, 64, 1024, dict(mesh=(("tensor3", 4), ("tensor2", 4), ("tensor", 4)))),
    (64, "llama-7b", 8, 64, 1024, dict(mesh=THREE_D_DATA, remat="full")),
    (64, "llama-7b", 8, 64, 1024, dict(data=4, tensor=16, grid_depth=1, remat="full")),
    # products = "summa" (Tesseract's SUMMA for every product) on rows 0, 1, 2 and 12's plans
    (64, "llama-7b", 8, 64, 1024, dict(data=4, tensor=16, grid_depth=1, products="summa")),
    (64, "llama-7b", 8, 64, 1024, dict(data=2, tensor=32, grid_depth=2, products="summa")),
    (64, "llama-7b", 8, 64, 1024, dict(tensor=64, grid_depth=4, products="summa")),
    (
        64,
        "llama-7b",
        8,
        64,
        1024,
        dict(data=4, tensor=16, grid_depth=1, remat="full", products="summa"),
    ),  # fmt: skip
]


def _plan(knobs: dict):
    """``candidate(**knobs)``, or for 3D (not a searched form) the plan of ``mesh``."""
    from shardlib.core.mesh import MeshSpec
    from shardlib.parallel.plan import ParallelPlan
    from shardlib.parallel.remat import Remat
    from shardlib.planner import candidate

    if "mesh" not in knobs:
        return candidate(**knobs)
    return ParallelPlan(mesh=MeshSpec(knobs["mesh"]), remat=Remat(knobs.get("remat", "none")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="", help="comma-separated row indices (default all)")
    args = parser.parse_args()
    picked = [int(i) for i in args.rows.split(",")] if args.rows else range(len(ROWS))
    rows = [ROWS[i] for i in picked]

    import shardlib

    shardlib.simulate_cpu_devices(max(r[0] for r in rows))
    from shardlib.planner import Workload
    from shardlib.planner.candidate import PlanView
    from shardlib.planner.validate import validate

    print("| model, layers, batch x seq | plan | memory predicted / compiled GiB | wire ratio |")
    print("| --- | --- | --- | --- |")
    for _, model, layers, batch, seq, knobs in rows:
        workload = Workload.from_preset(model, batch, seq, "fp32", layers=layers)
        plan = _plan(knobs)
        start = time.perf_counter()
        check = validate(workload, plan)
        view = PlanView(plan)
        print(
            f"| {model}, {layers}, {batch} x {seq} | {view.mesh_text()} ({view.knobs_text()}) | "
            f"{check.predicted_memory / 2**30:.3f} / {check.compiled_memory / 2**30:.3f} = "
            f"{check.memory_ratio:.3f} | {check.wire_ratio:.3f} |"
            f"  ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
