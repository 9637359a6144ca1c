"""The planner on FSDP and ZeRO-3 runs across hosts, against published throughput and memory.

    python benchmarks/fsdp_validation.py              # SC21 Table 2, then the FSDP runs
    python benchmarks/fsdp_validation.py --all        # every FSDP row, not only the summary
    python benchmarks/fsdp_validation.py --plot docs/fsdp_validation.png

Two sets of published runs, costed as a user costs a layout (``planner.estimate`` on a
cluster preset with ``--hosts``):

* **Narayanan et al. 2021 (SC21), Table 2**: 175B with ZeRO-3 and no model parallelism
  (DeepSpeed, batch 1536, micro-batch 4/2/1 on 384/768/1536 A100s: 144/88/44 TFLOP/s per
  GPU) beside PTD-P on the same GPUs (153/149/141). ZeRO-3 is costed with DeepSpeed 2021's
  program (``planner.calibrate.deepspeed``) and, for comparison, with shardlib's own FSDP
  program (``fsdp=N, remat=full``, as ``shardlib estimate --set`` does); PTD-P with
  Megatron-LM's (``planner.calibrate.megatron``, as ``planner_calibration.py``).
* **llm-foundry's FSDP runs** (``fsdp_runs.py``: PyTorch FSDP FULL_SHARD, 8-128 A100 40/80GB
  and H100 80GB, 125M-70B, seq 512-65536), costed with shardlib's FSDP program and fused
  attention (their FlashAttention kernel), activation checkpointing as ``remat=full``:
  throughput predicted / published, and whether the plan is predicted to fit.

Throughput ratios are predicted / published tokens per second (the same FLOP count on both
sides cancels); within 0.85-1.15 counts as a hit. The A100 80GB runs at seq 2048 are the
ones ``--fit`` may fit ``matmul_efficiency`` on (with planner_calibration.py's rows); the
rest are checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too
from benchmarks import fsdp_runs  # noqa: E402
from benchmarks.planner_calibration import gpt_workload, parity_axes  # noqa: E402
from benchmarks.planner_calibration import predict as megatron_predict  # noqa: E402
from benchmarks.published_runs import _175B, MEGATRON_2021, TABLE2, Run  # noqa: E402
from shardlib.planner import Workload, candidate, estimate, load_cluster  # noqa: E402
from shardlib.planner.calibrate.deepspeed import zero3_program  # noqa: E402
from shardlib.planner.calibrate.llmfoundry import (  # noqa: E402
    TRITON_ATTENTION,
    llmfoundry_program,
)
from shardlib.planner.cost.total import SHARDLIB  # noqa: E402

CLUSTERS = {"a100_80gb": "a100-8", "a100_40gb": "a100-40-8", "h100_80gb": "h100-8"}
SC21_ZERO3 = ((384, 144.0), (768, 88.0), (1536, 44.0))
SC21_PTDP = ((384, 153.0), (768, 149.0), (1536, 141.0))


def hit(ratio: float) -> bool:
    return 0.85 <= ratio <= 1.15


def fsdp_workload(run: fsdp_runs.R) -> Workload:
    """An MPT model of ``run``'s shape in shardlib's block: SwiGLU of width 8d/3 (the FLOPs of
    MPT's 4d GELU MLP), kv heads = heads, vocab 50,368."""
    d, heads, layers = fsdp_runs.SHAPES[run.model]
    return Workload.from_preset(
        "llama-70b",
        run.global_batch,
        run.seq,
        embed=d,
        heads=heads,
        kv_heads=heads,
        head_dim=d // heads,
        layers=layers,
        mlp=round(8 * d / 3 / 64) * 64,
        vocab=fsdp_runs.VOCAB,
    )


def fsdp_estimate(run: fsdp_runs.R, program=None, **cluster_fields):
    """``run`` costed with llm-foundry's program (``planner.calibrate.llmfoundry``)."""
    plan = candidate(
        fsdp=run.gpus,
        microbatches=run.grad_accum,
        remat="full" if run.checkpointing else "none",
        attention="cudnn",
    )
    cluster = load_cluster(CLUSTERS[run.gpu]).with_hosts(max(1, run.gpus // 8))
    cluster = dataclasses.replace(cluster, **cluster_fields)
    program = llmfoundry_program(run.mixed_precision) if program is None else program
    return estimate(fsdp_workload(run), plan, cluster, program=program)


def fsdp_ratio(run: fsdp_runs.R, program=None, **cluster_fields) -> float:
    return fsdp_estimate(run, program, **cluster_fields).tokens_per_s / run.tokens_per_s


def zero3_run(gpus: int, tflops: float) -> Run:
    return Run(source=TABLE2, **_175B, tensor=1, stage=1, gpus=gpus, global_batch=1536,
               tflops=tflops, program=MEGATRON_2021, micro_batch=1536 // gpus)  # fmt: skip


def zero3_predict(run: Run, program=SHARDLIB) -> tuple[float, object]:
    """(TFLOP/s per GPU by the paper's count, the estimate) of ``program``: shardlib's FSDP,
    or DeepSpeed 2021's ZeRO-3 (``planner.calibrate.deepspeed``)."""
    cluster = load_cluster("a100-8").with_hosts(run.gpus // 8)
    plan = candidate(fsdp=run.gpus, remat="full", attention="dense")  # 2021: no flash kernel
    est = estimate(gpt_workload(run), plan, cluster, program=program)
    return run.flops() / (est.step_s * run.gpus) / 1e12, est


def sc21_table(console: Console) -> list[float]:
    table = Table(title="Narayanan et al. 2021 (SC21) Table 2: 175B, batch 1536, A100 80GB")
    for col in ("GPUs", "scheme", "published TFLOP/s", "predicted", "ratio", "step (pred.)",
                "exposed comm", "collectives"):  # fmt: skip
        table.add_column(col, justify="right")
    ratios = []
    for (gpus, z_pub), (_, p_pub) in zip(SC21_ZERO3, SC21_PTDP, strict=True):
        z_pred, z_est = zero3_predict(zero3_run(gpus, z_pub), zero3_program())
        s_pred, s_est = zero3_predict(zero3_run(gpus, z_pub))
        ptdp = Run(source=TABLE2, **_175B, tensor=8, stage=12, gpus=gpus, global_batch=1536,
                   tflops=p_pub, program=MEGATRON_2021)  # fmt: skip
        p_pred, p_est = megatron_predict(ptdp)
        for scheme, pub, pred, est in (
            (f"ZeRO-3, DeepSpeed 2021's program (b={1536 // gpus})", z_pub, z_pred, z_est),
            ("ZeRO-3 layout, shardlib's FSDP program (not counted)", z_pub, s_pred, s_est),
            ("PTD-P (t=8, p=12, Megatron-LM's program)", p_pub, p_pred, p_est),
        ):
            if "not counted" not in scheme:
                ratios.append(pred / pub)
            table.add_row(str(gpus), scheme, f"{pub:.0f}", f"{pred:.0f}", f"{pred / pub:.3f}",
                          f"{est.step_s:.1f} s", f"{est.exposed_comm_s:.1f} s",
                          f"{est.comm_s:.1f} s")  # fmt: skip
    console.print(table)
    return ratios


FIT = tuple(r for r in fsdp_runs.A100_80GB if r.seq == 2048)
"""The FSDP runs ``planner_calibration.py --fit`` fits ``matmul_efficiency`` on (with the
Megatron-LM calibration rows)."""
FIT_ATTENTION = tuple(r for r in fsdp_runs.A100_80GB if r.seq == 8192)
"""The FSDP runs ``--fit`` fits llm-foundry's Triton attention ceiling on (with ``FIT``, at the
preset's ``matmul_efficiency``): attention is a fifth to a half of their step. Every other row
(A100 80GB at other lengths and across hosts, A100 40GB, every H100 row) is held out."""
FITTED = frozenset(FIT + FIT_ATTENTION)
RUN_SETS = (
    ("A100 80GB", fsdp_runs.A100_80GB),
    ("A100 40GB (16-128 GPUs)", fsdp_runs.A100_40GB),
    ("H100 80GB", fsdp_runs.H100_80GB),
)


def fsdp_tables(console: Console, show_all: bool) -> dict[str, list[tuple]]:
    """Per set: (run, ratio, fits) rows; a table per set (all rows or the misses)."""
    out: dict[str, list[tuple]] = {}
    for name, runs in RUN_SETS:
        body = []
        for run in runs:
            est = fsdp_estimate(run)
            body.append((run, est.tokens_per_s / run.tokens_per_s, est))
        out[name] = body
        shown = body if show_all else [b for b in body if not (hit(b[1]) and b[2].fits)]
        table = Table(title=f"{fsdp_runs.SOURCE}: {name} ({'all' if show_all else 'misses'})")
        for col in ("model", "seq", "GPUs", "b x accum", "ckpt", "published tok/s",
                    "predicted", "ratio", "memory (pred.)", "fits"):  # fmt: skip
            table.add_column(col, justify="right")
        for run, ratio, est in shown:
            table.add_row(run.model, str(run.seq), str(run.gpus),
                          f"{run.micro_batch} x {run.grad_accum}", "yes" if run.checkpointing
                          else "no", f"{run.tokens_per_s:,}", f"{est.tokens_per_s:,.0f}",
                          f"{ratio:.3f}", f"{est.memory_bytes / 2**30:.1f} GiB",
                          "yes" if est.fits else "[red]no[/red]")  # fmt: skip
        console.print(table)
    return out


def fit_attention(console: Console) -> float:
    """llm-foundry's Triton attention ceiling (``llmfoundry.TRITON_ATTENTION.ceiling``) by least
    squares of log(predicted/published) over the fit rows (``FIT`` + ``FIT_ATTENTION``)."""

    def loss(ceiling: float) -> float:
        kernel = dataclasses.replace(TRITON_ATTENTION, ceiling=ceiling)
        runs = FIT + FIT_ATTENTION
        return sum(
            math.log(fsdp_ratio(r, llmfoundry_program(r.mixed_precision, kernel))) ** 2
            for r in runs
        )

    best = min((loss(c), c) for c in [x / 100 for x in range(60, 101)])
    console.print(f"fit: Triton attention ceiling={best[1]:.2f} (sum of squared log ratios "
                  f"{best[0]:.3f} over {len(FIT + FIT_ATTENTION)} fit rows)")  # fmt: skip
    return best[1]


def summary(sets: dict[str, list[tuple]]) -> list[str]:
    lines = []
    for name, body in sets.items():
        by_hosts: dict[str, list[tuple]] = defaultdict(list)
        for row in body:
            by_hosts["one host" if row[0].gpus <= 8 else "across hosts"].append(row)
        for where, rows in by_hosts.items():
            ratios = [r for _, r, _ in rows]
            fits = sum(est.fits for _, _, est in rows)
            lines.append(
                f"{name}, {where}: {sum(map(hit, ratios))}/{len(rows)} within 15% (ratios "
                f"{min(ratios):.3f}-{max(ratios):.3f}), {fits}/{len(rows)} predicted to fit"
            )
    for label, fitted in (("fit rows", True), ("held out", False)):
        ratios = [r for body in sets.values() for run, r, _ in body if (run in FITTED) == fitted]
        lines.append(f"{label}: {sum(map(hit, ratios))}/{len(ratios)} within 15%")
    return lines


def plot(path: str, sets: dict[str, list[tuple]]) -> None:
    """Predicted against published tokens/s per GPU, log-log, the ±15% band around parity."""
    fig, ax = parity_axes(3e2, 3e5, log=True)
    for (name, body), marker, color in zip(sets.items(), "os^", ("C0", "C2", "C1"), strict=True):
        for where, hosts in (("one host", False), ("across hosts", True)):
            rows = [(run, est) for run, _, est in body if (run.gpus > 8) == hosts]
            if not rows:
                continue
            xs = [run.tokens_per_s / run.gpus for run, _ in rows]
            ys = [est.tokens_per_s / run.gpus for run, est in rows]
            ax.scatter(xs, ys, marker=marker, s=20, facecolors="none" if hosts else color,
                       edgecolors=color, label=f"{name}, {where}")  # fmt: skip
    ax.set_xlabel("published tokens/s per GPU (llm-foundry, PyTorch FSDP)")
    ax.set_title("planner vs published FSDP runs (band: ±15%)")
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every FSDP row, not the misses")
    parser.add_argument("--plot", default=None, metavar="PNG", help="draw predicted vs published")
    parser.add_argument("--fit", action="store_true", help="refit the Triton attention ceiling")
    args = parser.parse_args(argv)
    console = Console(width=200)
    if args.fit:
        fit_attention(console)
    sc21 = sc21_table(console)
    sets = fsdp_tables(console, args.all)
    console.print(
        f"SC21 Table 2: {sum(map(hit, sc21))}/{len(sc21)} within 15% (ZeRO-3 "
        + ", ".join(f"{r:.2f}" for r in sc21[0::2])
        + "; PTD-P "
        + ", ".join(f"{r:.2f}" for r in sc21[1::2])
        + ")"
    )
    for line in summary(sets):
        console.print(line)
    if args.plot:
        plot(args.plot, sets)
        console.print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
