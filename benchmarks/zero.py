"""ZeRO stages 0-3 (and ZeRO-2 + optimizer offload) vs the ZeRO table, per device, N = 8.

    python benchmarks/zero.py    # llama-small (~12M params), fp32 Adam, data=8

Compiles (never runs) the train step from abstract shapes for each stage and prints the
model-state bytes one device holds and the bytes it sends per step, next to REFERENCE.md's
ZeRO table in its fp32 form (4Ψ params + 4Ψ grads + 8Ψ Adam moments; 2Ψ or 3Ψ traffic).
How each figure is measured: ``benchmarks/zero_figures.py``. Figures come from the CPU
backend, which all-reduces gradients that GPU/TPU reduce-scatter: the "GPU form" column
counts those all-reduces as reduce-scatters (half their wire bytes).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too

import shardlib

STAGES = ((0, False), (1, False), (2, False), (3, False), (2, True))


def main() -> None:
    shardlib.simulate_cpu_devices(8)
    from rich.console import Console
    from rich.table import Table

    from benchmarks.zero_figures import zero_figures
    from shardlib.analysis.report import format_bytes
    from shardlib.train.config import override, train_config
    from shardlib.train.setup import make_setup

    cfg = train_config(model="llama-small", batch=16, seq=128, optimizer="adam")
    mesh = shardlib.mesh_spec(data=8).build()
    rows = []
    for stage, offload in STAGES:
        setup = make_setup(override(cfg, {"zero": stage, "offload_optimizer": offload}), mesh)
        rows.append(zero_figures(setup, devices=8))
    psi = rows[0].params
    table = Table(title=f"ZeRO on data=8, {cfg.model}: Ψ = {psi:,} fp32 parameters, Adam")
    columns = ("stage", "params+opt (device)", "opt (host)", "grads", "memory", "formula",
               "ratio", "wire (CPU)", "wire (GPU form)", "formula", "ratio")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col == "stage" else "right")
    for f in rows:
        table.add_row(
            f"{f.stage}" + (" + offload" if f.offload else ""),
            format_bytes(f.device_state_bytes),
            format_bytes(f.host_state_bytes),
            format_bytes(f.grad_bytes),
            format_bytes(f.device_bytes),
            format_bytes(f.memory_formula),
            f"{f.memory_ratio:.3f}",
            format_bytes(f.wire_bytes),
            format_bytes(f.gpu_wire_bytes),
            format_bytes(f.wire_formula),
            f"{f.wire_ratio:.3f}",
        )
    console = Console()
    console.print(table)
    console.print(
        "memory = device-resident inputs of the compiled step (parameters, optimizer state, the "
        "batch) + one device's share of the gradient buffer; formula = ZeRO table, fp32 "
        "(offload: the optimizer term leaves the device).\n"
        "wire formula = 2Ψ (stages 0-2) or 3Ψ (stage 3) fp32 bytes, ring-exact (N-1)/N.\n"
        "Deviations: stages 1-3 on CPU send an all-reduce where GPU/TPU reduce-scatter (the "
        "'wire (CPU)' column, 1.5x the formula for stages 1-2); stage 3 sits under 3Ψ because "
        "XLA gathers the embedding and output projection once and keeps them for the backward "
        "pass. The CPU backend's memory_analysis() counts pinned-host arguments as argument "
        "bytes (host_* fields stay 0), so placement is read from the compiled input shardings."
    )


if __name__ == "__main__":
    main()
