"""Planner cost model vs compiled executables: memory and collective bytes per device.

    python benchmarks/planner_validation.py            # 8 and 64 simulated CPU devices
    python benchmarks/planner_validation.py --devices 8

Every plan is compiled from abstract shapes (nothing allocated) by ``planner.validate`` and
compared with ``cost.estimate(..., backend="cpu")``. None of these plans is one of the
calibration probes (``planner.calibrate.probes.PROBES``): this checks the fitted model on other
meshes, widths, micro-batch counts and device counts. Strategies covered: data parallel,
FSDP, Megatron tensor parallel, ZeRO-1/2, rematerialisation (selective, full), optimizer
offload (device memory excludes the pinned_host arguments; the host bytes are compared
apart), context parallelism (ring attention), expert parallelism (MoE) and pipelines (GPipe,
1f1b = (interleaved) 1F1B, circular = GPipe with virtual stages), on Llama, MoE and GPT
blocks.
Targets: memory within 10%, collective bytes within 5%.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# moe-tiny widened so that its buffers are not dwarfed by the runtime's fixed bytes
MOE = {"embed": 256, "mlp": 1024, "heads": 8, "kv_heads": 4, "head_dim": 32}
# gpt-tiny widened the same way (4 layers unless a row says)
GPT_W512 = {"layers": 4, "embed": 512, "mlp": 2048, "heads": 8}
GPT_W384 = {"layers": 4, "embed": 384, "mlp": 1536, "heads": 6}

# (model, global batch, seq, model overrides, plan kwargs)
CASES = {
    8: [
        ("llama-small", 16, 128, {}, dict(data=2, fsdp=4)),
        ("llama-small", 16, 128, {}, dict(data=2, fsdp=2, tensor=2)),
        ("llama-small", 16, 128, {}, dict(fsdp=8, microbatches=2)),
        ("llama-tiny", 16, 64, {}, dict(data=4, tensor=2, microbatches=2)),
        ("llama-small", 16, 128, {"layers": 6, "kv_heads": 8}, dict(fsdp=2, tensor=4)),
        ("llama-small", 16, 128, {"layers": 4, "kv_heads": 8}, dict(data=2, tensor=4)),
        ("llama-small", 32, 64, {"layers": 3, "mlp": 768}, dict(data=4, fsdp=2)),
        # ZeRO-1/2, remat, optimizer offload
        ("llama-small", 16, 128, {"layers": 3, "mlp": 768}, dict(data=8, zero=1, microbatches=2)),
        ("llama-small", 16, 128, {"layers": 3}, dict(data=4, tensor=2, zero=2, microbatches=2)),
        ("llama-small", 16, 256, {"layers": 2}, dict(data=8, zero=1, offload=True)),
        ("llama-small", 16, 256, {"layers": 3}, dict(data=2, fsdp=2, tensor=2, remat="selective")),
        ("llama-small", 16, 512, {"layers": 3}, dict(data=8, remat="full")),
        (
            "llama-small",
            32,
            128,
            {"layers": 3},
            dict(data=8, zero=2, offload=True, remat="full"),
        ),
        # context parallelism (ring attention)
        ("llama-small", 16, 256, {"layers": 3}, dict(data=2, context=2, tensor=2)),
        ("llama-small", 8, 512, {"layers": 2}, dict(context=8)),
        ("llama-small", 16, 256, {"layers": 2}, dict(fsdp=2, context=4)),
        # expert parallelism (MoE)
        (
            "moe-tiny",
            16,
            128,
            {**MOE, "expert_mlp": 256, "layers": 6, "moe_every": 3},
            dict(data=2, expert=4),
        ),
        (
            "moe-tiny",
            16,
            128,
            {**MOE, "expert_mlp": 256, "layers": 6, "moe_every": 3},
            dict(fsdp=2, expert=4),
        ),
        # pipelines: GPipe, 1F1B, interleaved
        (
            "llama-small",
            32,
            64,
            {"layers": 8},
            dict(data=2, stage=4, microbatches=8, schedule="gpipe"),
        ),
        (
            "llama-small",
            16,
            128,
            {"layers": 8},
            dict(tensor=2, stage=4, microbatches=4, schedule="1f1b"),
        ),
        (
            "llama-small",
            16,
            256,
            {"layers": 4},
            dict(data=2, tensor=2, stage=2, microbatches=4, schedule="circular", virtual=2),
        ),
        (
            "llama-small",
            16,
            128,
            {"layers": 8, "mlp": 2048},
            dict(data=4, stage=2, microbatches=4, schedule="1f1b"),
        ),
        (
            "llama-small",
            16,
            128,
            {"layers": 8},
            dict(fsdp=2, stage=2, microbatches=2, schedule="circular", virtual=2),
        ),
        # ring attention inside the stages; an MoE's router statistics carried through them
        (
            "llama-small",
            16,
            128,
            {"layers": 4},
            dict(data=2, stage=2, context=2, microbatches=2, schedule="gpipe"),
        ),
        (
            "moe-tiny",
            16,
            128,
            {**MOE, "expert_mlp": 512, "layers": 4, "moe_every": 2},
            dict(data=2, stage=2, expert=2, microbatches=2, schedule="gpipe"),
        ),
        # the GPT block (fp32 LayerNorm, GELU MLP, tied table, learned positions), at widths
        # and depths its probes (calibrate.gpt_probes: h 256) do not have
        ("gpt-tiny", 16, 256, GPT_W512 | {"layers": 16}, dict(data=2, tensor=4)),
        ("gpt-tiny", 16, 512, GPT_W384 | {"layers": 8}, dict(fsdp=4, tensor=2)),
        ("gpt-tiny", 16, 256, GPT_W512, dict(stage=2, tensor=4, microbatches=4, schedule="1f1b")),
        (
            "gpt-tiny",
            16,
            256,
            GPT_W512,
            dict(stage=2, fsdp=2, tensor=2, microbatches=4, schedule="1f1b"),
        ),
        (
            "gpt3-1.3b",
            4,
            1024,
            {"layers": 4, "vocab": 50304},
            dict(stage=2, tensor=4, microbatches=4, schedule="1f1b"),
        ),
        # published widths: the plan `shardlib plan` writes for llama-7b on 8 H100s, and more
        ("llama-7b", 64, 2048, {}, dict(fsdp=8, microbatches=4, remat="selective")),
        ("llama-7b", 32, 4096, {"layers": 4}, dict(fsdp=4, context=2)),
        (
            "llama-1b",
            32,
            2048,
            {"layers": 8},
            dict(data=2, stage=4, microbatches=8, schedule="1f1b"),
        ),
    ],
    64: [
        ("llama-small", 64, 128, {"layers": 4}, dict(data=64)),
        ("llama-small", 64, 128, {"layers": 4}, dict(fsdp=64)),
        ("llama-small", 64, 128, {"layers": 4}, dict(data=8, fsdp=8)),
        ("llama-small", 64, 128, {"layers": 4, "kv_heads": 8}, dict(data=8, tensor=8)),
        ("llama-small", 64, 128, {"layers": 4, "kv_heads": 8}, dict(fsdp=8, tensor=8)),
        ("llama-small", 64, 128, {"layers": 4}, dict(data=4, fsdp=4, tensor=4)),
        ("llama-small", 128, 64, {"layers": 4}, dict(data=16, tensor=4, microbatches=2)),
        # ZeRO-1/2, remat, optimizer offload
        ("llama-small", 128, 128, {"layers": 4}, dict(data=64, zero=2, microbatches=2)),
        (
            "llama-small",
            64,
            128,
            {"layers": 4, "kv_heads": 8},
            dict(data=16, tensor=4, zero=1, offload=True),
        ),
        ("llama-small", 64, 256, {"layers": 4}, dict(fsdp=16, tensor=4, remat="full")),
        ("llama-small", 64, 256, {"layers": 4}, dict(data=8, fsdp=8, remat="selective")),
        # context, expert, pipelines
        ("llama-small", 64, 256, {"layers": 2}, dict(data=8, context=8)),
        ("llama-small", 32, 256, {"layers": 2}, dict(fsdp=4, context=4, tensor=4)),
        (
            "moe-tiny",
            64,
            128,
            {**MOE, "layers": 4, "moe_every": 2, "expert_mlp": 768},
            dict(fsdp=8, expert=8),
        ),
        (
            "llama-small",
            64,
            128,
            {"layers": 16},
            dict(data=4, stage=8, fsdp=2, microbatches=8, schedule="gpipe"),
        ),
        (
            "llama-small",
            128,
            128,
            {"layers": 8},
            dict(data=16, stage=2, fsdp=2, microbatches=4, schedule="circular", virtual=2),
        ),
        ("llama-7b", 128, 2048, {"layers": 8}, dict(data=8, fsdp=8, remat="full")),
        ("llama-7b", 64, 4096, {"layers": 4}, dict(fsdp=16, context=2, tensor=2)),
    ],
}


def worker(devices: int) -> None:
    import shardlib

    shardlib.simulate_cpu_devices(devices)
    from shardlib.planner import PlanView, Workload, candidate
    from shardlib.planner.validate import validate

    for model, batch, seq, overrides, plan_kwargs in CASES[devices]:
        start = time.perf_counter()
        workload = Workload.from_preset(model, batch, seq, "fp32", **overrides)
        check = validate(workload, candidate(**plan_kwargs), peak=True)
        view = PlanView(check.plan)
        row = {
            "devices": devices,
            "model": model + "".join(f" {k}={v}" for k, v in overrides.items()),
            "batch": batch,
            "seq": seq,
            "plan": view.mesh_text(),
            "knobs": view.knobs_text(),
            "predicted_host": check.predicted_host,
            "compiled_host": check.compiled_host,
            "predicted_memory": check.predicted_memory,
            "compiled_memory": check.compiled_memory,
            "predicted_wire": check.predicted_wire,
            "compiled_wire": check.compiled_wire,
            "predicted_flops": check.predicted_flops,
            "compiled_flops": check.compiled_flops,
            # where XLA's heap simulation peaks, and its count then (analysis.peak)
            "peak_phase": check.compiled_peak.phase if check.compiled_peak else "",
            "compiled_live": check.compiled_peak.live_bytes if check.compiled_peak else 0,
            "seconds": time.perf_counter() - start,
        }
        print(json.dumps(row), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="*", default=[8, 64])
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    rows = []
    for n in args.devices:  # one process per device count: it is fixed when JAX starts
        out = subprocess.run(
            [sys.executable, __file__, "--worker", str(n)],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode:
            print(out.stderr[-3000:], file=sys.stderr)
            return out.returncode
        rows += [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    from rich.console import Console
    from rich.table import Table

    from shardlib.analysis.report import format_bytes

    table = Table(title="planner prediction (cpu backend, fp32) vs compiled, per device and step")
    for col in (
        "devices",
        "model",
        "batch x seq",
        "plan",
        "knobs",
        "memory pred",
        "compiled",
        "ratio",
        "wire pred",
        "compiled",
        "ratio",
        "FLOPs ratio",
        "peak in",
        "live at peak",
    ):
        table.add_column(col, justify="left" if col in ("model", "plan", "knobs") else "right")
    worst_mem = worst_wire = 0.0
    for r in rows:
        mem = r["predicted_memory"] / r["compiled_memory"]
        wire = r["predicted_wire"] / r["compiled_wire"] if r["compiled_wire"] else 1.0
        worst_mem, worst_wire = max(worst_mem, abs(mem - 1)), max(worst_wire, abs(wire - 1))
        table.add_row(
            str(r["devices"]),
            r["model"],
            f"{r['batch']} x {r['seq']}",
            r["plan"],
            r["knobs"],
            format_bytes(r["predicted_memory"]),
            format_bytes(r["compiled_memory"]),
            f"{mem:.3f}",
            format_bytes(r["predicted_wire"]),
            format_bytes(r["compiled_wire"]),
            f"{wire:.3f}",
            f"{r['predicted_flops'] / r['compiled_flops']:.3f}",
            r.get("peak_phase", ""),
            format_bytes(r["compiled_live"]) if r.get("compiled_live") else "",
        )
    console = Console(width=220)
    console.print(table)
    ok = worst_mem <= 0.10 and worst_wire <= 0.05
    within = sum(
        abs(r["predicted_memory"] / r["compiled_memory"] - 1) <= 0.10
        and (not r["compiled_wire"] or abs(r["predicted_wire"] / r["compiled_wire"] - 1) <= 0.05)
        for r in rows
    )
    console.print(
        f"{len(rows)} plans, {within} within both targets; worst memory error {worst_mem:.1%} "
        f"(target 10%), worst collective bytes error {worst_wire:.1%} (target 5%): "
        f"{'OK' if ok else 'MISSED'}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
