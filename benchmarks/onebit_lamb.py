"""1-bit LAMB: wire bytes per device per step against the 1-bit formula, and loss against LAMB.

    python benchmarks/onebit_lamb.py              # bytes (compile only) + 200-step curves
    python benchmarks/onebit_lamb.py --steps 0    # bytes only

Bytes: LAMB's and 1-bit LAMB's train steps are compiled on 8 simulated CPU devices
(data=8) from abstract shapes and the optimized HLO's collectives summed by kind and dtype
(``comm_compression.collective_bytes``: REFERENCE.md's ring wire bytes). 1-bit LAMB's
program holds both stages (a conditional); after warm-up only its compressed branch runs,
whose collectives are the all-to-all and all-gather of the packed momentum and the chunk
scales. Formulas (N = 8, Ψ parameters, P = Ψ rounded up to 8N):

* LAMB (and 1-bit LAMB's warm-up): the fp32 gradient all-reduce, 2(N-1)/N · 4Ψ;
* 1-bit LAMB after warm-up: 1-bit Adam's 2(N-1)/N · Ψ/8 (signs), measured with its padding
  and 2N fp32 scales, 2(N-1)/N · (P/8 + 4N): 1/32 of the above.

``shardlib explain optimizer=onebit_lamb freeze_step=1 steps=3 batch=16 seq=64 --mesh
cpu-8-dp`` lists the same collectives with the line that sends each (llama-tiny: all-to-all
and all-gather of 19.3 KiB each, the warm-up's 1.2 MiB all-reduce, a 14 B metric all-reduce).

Curves: the default data (the embedded stdlib corpus), llama-tiny, data=8, the same steps,
schedule and settings for LAMB and 1-bit LAMB (warm-up 20% of the steps, DeepSpeed's factor
settings); the plot goes to ``benchmarks/onebit_lamb.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too

import shardlib
from benchmarks.comm_compression import _step_program, collective_bytes, plot_curves, train_curves

PNG = Path(__file__).with_name("onebit_lamb.png")
N = 8


def wire_rows(model: str, console) -> tuple[list[tuple], int]:
    """(name, measured wire bytes, formula bytes, what) per row; and Ψ."""
    import jax

    from shardlib.train.config import train_config
    from shardlib.train.onebit import padded_size
    from shardlib.train.setup import make_setup

    base = dict(model=model, batch=16, seq=64, steps=3)
    mesh = shardlib.mesh_spec(data=N).build()
    with console.status("compiling LAMB and 1-bit LAMB on data=8"):
        lamb = make_setup(train_config(optimizer="lamb", **base), mesh)
        dense = collective_bytes(_step_program(lamb).as_text(), mesh)
        onebit = make_setup(train_config(optimizer="onebit_lamb", freeze_step=1, **base), mesh)
        found = collective_bytes(_step_program(onebit).as_text(), mesh)
    psi = sum(x.size for x in jax.tree.leaves(lamb.param_shapes))
    p, ring = padded_size(onebit.param_shapes, N), 2 * (N - 1) / N

    def total(table, kinds):
        return sum(v["wire_bytes"] for (k, _), v in table.items() if k in kinds)

    packed = total(found, ("all-to-all", "all-gather"))
    signs = sum(
        v["wire_bytes"] for (k, d), v in found.items() if k in ("all-to-all", "all-gather")
        and d == "u8"
    )  # fmt: skip
    return [
        ("LAMB gradient all-reduce (fp32)", total(dense, ("all-reduce",)), ring * 4 * psi,
         "2(N-1)/N · 4Ψ"),
        ("1-bit LAMB after warm-up: packed signs (u8)", signs, ring * psi / 8,
         "2(N-1)/N · Ψ/8 (1-bit formula)"),
        ("1-bit LAMB after warm-up: signs + scales", packed, ring * psi / 8,
         "2(N-1)/N · Ψ/8 (1-bit formula)"),
        ("  the same, exact (padding, 2N scales)", packed, ring * (p / 8 + 4 * N),
         "2(N-1)/N · (P/8 + 4N)"),
    ], psi  # fmt: skip


def curves(steps: int, console) -> dict[str, list[float]]:
    """Loss per step of LAMB and 1-bit LAMB on the default data, data=8."""
    spec = shardlib.mesh_spec(data=N)
    return train_curves({
        "LAMB (data=8)": (dict(optimizer="lamb"), spec),
        f"1-bit LAMB (data=8, freeze {steps // 5})": (
            dict(optimizer="onebit_lamb", freeze_step=steps // 5), spec),
    }, steps, console)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="curve length (0: bytes only)")
    parser.add_argument("--model", default="llama-tiny", help="model for the byte counts")
    args = parser.parse_args()
    shardlib.simulate_cpu_devices(N)
    from rich.console import Console
    from rich.table import Table

    from shardlib.analysis.report import format_bytes

    console = Console()
    rows, psi = wire_rows(args.model, console)
    table = Table(title=f"wire bytes per device per step, {args.model} (Ψ = {psi:,}), data=8 CPU")
    for col in ("collective", "measured", "formula", "ratio", "formula says"):
        left = col in ("collective", "formula says")
        table.add_column(col, justify="left" if left else "right")
    for name, got, want, what in rows:
        table.add_row(name, format_bytes(got), format_bytes(want), f"{got / want:.4f}", what)
    console.print(table)
    for name, got, want, _ in rows:
        console.print(f"{name.strip()}: {got:,.0f} B measured, {want:,.0f} B formula")
    console.print(
        f"1-bit LAMB after warm-up / LAMB all-reduce: {rows[2][1] / rows[0][1]:.5f} "
        f"(1/32 = {1 / 32:.5f}); the scalar metric all-reduces (loss, norm) run in both stages."
    )
    if args.steps <= 0:
        return
    freeze = args.steps // 5
    marks = [(freeze, f"freeze_step = {freeze}")]
    plot_curves(curves(args.steps, console), PNG, console, marks)


if __name__ == "__main__":
    main()
