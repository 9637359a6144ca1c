"""Per-device communication and memory of the train step vs the published formulas.

    python benchmarks/communication.py   # llama-small (~12M params), fp32, 8 CPUs

Compiles (never runs) the step for DP=8, FSDP=8 and TP=4 and prints, per plan, the wire bytes
measured from the optimized HLO next to REFERENCE.md's formula. CPU figures: XLA's CPU backend
all-reduces FSDP gradients where GPU/TPU reduce-scatter; the "GPU-equivalent" column counts
those all-reduces as reduce-scatters.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too

import shardlib

shardlib.simulate_cpu_devices(8)

import jax  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import models  # noqa: E402
from benchmarks.reference import (  # noqa: E402
    dp_gradient_allreduce,
    megatron_tp_layer,
    zero_memory,
    zero_wire,
)
from shardlib.analysis import explain  # noqa: E402
from shardlib.analysis.report import format_bytes, ring_wire_bytes  # noqa: E402
from shardlib.train.config import train_config  # noqa: E402
from shardlib.train.setup import make_setup  # noqa: E402

CFG = train_config(model="llama-small", batch=16, seq=128)
VOCAB_PARALLEL = ("reduce-scatter", "all-reduce", "all-gather", "all-gather")
"""FSDP's vocab-parallel head, of [b, s, h] each (``planner.cost.terms.fsdp``)."""


def report(devices: int, **axes):
    setup = make_setup(CFG, shardlib.mesh_spec(**axes).build(jax.devices()[:devices]))
    return explain(
        setup.train_step, setup.abstract_state(), setup.abstract_batch(), mesh=setup.mesh
    )


def main() -> None:
    model = models.config(CFG.model)
    psi = model.param_count()
    batch, seq = CFG.dataset.batch, CFG.dataset.seq
    table = Table(title=f"{CFG.model}: Ψ = {psi:,} fp32 parameters, batch {batch} x {seq}")
    for col in ("plan", "quantity", "measured (CPU)", "GPU-equivalent", "formula", "ratio"):
        table.add_column(col, justify="right" if col not in ("plan", "quantity") else "left")

    def row(plan, what, measured, formula, gpu=None):
        shown = gpu if gpu is not None else measured
        table.add_row(
            plan,
            what,
            format_bytes(measured),
            format_bytes(gpu),
            format_bytes(formula),
            f"{shown / formula:.3f}",
        )

    dp = report(8, data=8)
    row(
        "DP=8",
        "gradient all-reduce wire",
        dp.collective_totals["all-reduce"]["wire_bytes"],
        dp_gradient_allreduce(psi, 8),
    )
    fs = report(8, fsdp=8)
    totals = fs.collective_totals
    gathered = totals["all-gather"]["wire_bytes"]
    reduced = totals["all-reduce"]["wire_bytes"]
    scattered = totals.get("reduce-scatter", {}).get("wire_bytes", 0.0)
    # vocab-parallel head (2,048 tokens <= vocab / 2): the two tables are neither gathered
    # nor reduced; the lookup's reduce-scatter, the head input's all-reduce and two
    # all-gathers of [b, s, h] move instead (fp32)
    blocks = psi - 2 * model.vocab * model.embed
    rows = batch * seq * model.embed * 4
    activations = sum(ring_wire_bytes(k, rows, 8) for k in VOCAB_PARALLEL)
    head_all_reduce = ring_wire_bytes("all-reduce", rows, 8)  # not a gradient: GPU sends it too
    row(
        "FSDP=8",
        "total wire (ZeRO-3: 3Ψ of the blocks + vocab-parallel head)",
        gathered + reduced + scattered,
        zero_wire(3, blocks, 8) + activations,
        gpu=gathered + scattered + (reduced - head_all_reduce) / 2 + head_all_reduce,
    )
    row(
        "FSDP=8",
        "argument bytes (params+Adam)/8",
        fs.memory.argument_bytes,
        zero_memory(3, psi, 8, grad_bytes=0),
    )
    tp = report(4, tensor=4)
    layer = megatron_tp_layer(batch, seq, model.embed, t=4)
    looped = [c for c in tp.collectives if c.count == model.layers and c.axes == ("tensor",)]
    row(
        "TP=4",
        f"per-layer all-reduce wire ({len(looped)} ops)",
        sum(c.wire_bytes for c in looped),
        layer["wire_bytes"],
    )
    Console().print(table)
    print(
        "FSDP: the GPU-equivalent column counts the gradient all-reduces as reduce-scatters; "
        "the vocab-parallel head's activation all-reduce stays one."
    )


if __name__ == "__main__":
    main()
