"""The throughput model against published measured runs: calibration rows and checks.

    python benchmarks/planner_calibration.py          # the tables
    python benchmarks/planner_calibration.py --fit    # also refit the two fitted constants
    python benchmarks/planner_calibration.py --blocks # the GPT block beside the stand-in

Each published run is costed as the planner costs a layout (``planner.estimate`` on the
``a100-8`` preset with ``--hosts``), running the publication's own program
(``planner.calibrate.megatron``: Megatron-LM's GPT block, tensor, pipeline and data-parallel
traffic, recompute) on the planner's hardware model: the GPT block of the published shape
(``models/gpt``: GELU MLP of 4h, learned positions, tied embeddings; vocab 51,200; its
parameter counts are Table 1's model names, 1.7B to 1008.0B), 1F1B costed as ``gpipe`` (the same
(p-1)/m bubble). Published and predicted throughput are counted with the publication's own
FLOP formula, so predicted/published = published step time / predicted step time.

Calibration rows (Megatron-LM), with the FSDP fit rows of ``fsdp_validation.py``, fit
``matmul_efficiency`` and ``tile_transfers`` (the A100 presets); the links' achieved bandwidths
are the nccl-tests figures the preset cites, not fitted here. MT-NLG (DeepSpeed + Megatron) is
printed as a check on another software stack, never fitted; the weak-scaling Table 1 of
Narayanan et al. 2021 (SC21) is held out: printed, never fitted. Sources and what was confirmed
where: docs/throughput_calibration.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too
from benchmarks.published_runs import CALIBRATION, HELD_OUT, OTHER_STACK, Run  # noqa: E402
from shardlib.planner import PlanView, Workload, candidate, estimate, load_cluster  # noqa: E402
from shardlib.planner.calibrate.megatron import megatron_program  # noqa: E402

BLOCKS = ("stand-in", "gpt")
"""How a run's model is costed: ``stand-in``, a Llama of GPT's widths with the SwiGLU width
8h/3 (GPT's 4h MLP FLOPs; what was costed before the GPT model existed, kept for the
side-by-side ``--blocks``), or ``gpt`` (the default), the GPT block as published
(``models/gpt``: LayerNorm with bias, GELU MLP of 4h, learned positions, tied embeddings, as
Megatron-LM's GPT)."""


@functools.lru_cache(maxsize=128)
def gpt_workload(run: Run, block: str = "gpt") -> Workload:
    """A GPT-3 style model of ``run``'s shape: the SwiGLU stand-in (width 8h/3, rounded to
    64·t) or the GPT block itself (``BLOCKS``)."""
    if block == "gpt":
        return Workload.from_preset(
            "gpt3-175b", run.global_batch, run.seq, embed=run.hidden, heads=run.heads,
            head_dim=run.hidden // run.heads, layers=run.layers, vocab=run.vocab,
            max_positions=run.seq,
        )  # fmt: skip
    mlp = round(8 * run.hidden / 3 / (64 * run.tensor)) * 64 * run.tensor
    return Workload.from_preset(
        "llama-70b",
        run.global_batch,
        run.seq,
        embed=run.hidden,
        heads=run.heads,
        kv_heads=run.heads,
        head_dim=run.hidden // run.heads,
        layers=run.layers,
        mlp=mlp,
        vocab=run.vocab,
    )


def _plan(run: Run, micro_batch: int, schedule: str = "gpipe"):
    m = run.global_batch // (run.data * micro_batch)
    # Megatron-LM's 2021 runs streamed the scores (its fused softmax, no flash attention)
    return candidate(
        **run.mesh(), microbatches=m, remat=run.remat, schedule=schedule, attention="dense"
    )


def micro_batch(run: Run, cluster, block: str = "gpt") -> int:
    """The published micro-batch size, else the fastest whose plan fits in memory under
    1F1B (shardlib's ``1f1b`` memory model: Megatron's schedule keeps at most p
    micro-batches in flight); 1 if none fits."""
    if run.micro_batch is not None:
        return run.micro_batch
    per_replica = run.global_batch // run.data
    sizes = [b for b in range(1, min(per_replica, 16) + 1) if per_replica % b == 0]
    workload, program = gpt_workload(run, block), megatron_program(run.program)
    fitting = [
        b
        for b in sizes
        if estimate(workload, _plan(run, b, "1f1b" if run.stage > 1 else "gpipe"), cluster).fits
    ]
    if not fitting:
        return 1
    return min(
        fitting, key=lambda b: estimate(workload, _plan(run, b), cluster, program=program).step_s
    )


def predict(run: Run, cluster_name: str = "a100-8", block: str = "gpt", **cluster_fields):
    """(predicted TFLOP/s per GPU by the publication's formula, the estimate)."""
    cluster = load_cluster(cluster_name).with_hosts(max(1, run.gpus // 8))
    cluster = dataclasses.replace(cluster, **cluster_fields)
    plan = _plan(run, micro_batch(run, cluster, block))
    workload = gpt_workload(run, block)
    est = estimate(workload, plan, cluster, program=megatron_program(run.program))
    return run.flops() / (est.step_s * run.gpus) / 1e12, est


def fit(console: Console) -> dict[str, float]:
    """``matmul_efficiency`` and ``tile_transfers`` (the A100 presets), jointly by least
    squares of log(predicted/published) over the calibration rows and the FSDP fit rows
    (``fsdp_validation.FIT`` + ``FIT_ATTENTION``: llm-foundry's A100 80GB one-host runs at seq
    2048 and 8192). The links are not fitted: their achieved bandwidths are the nccl-tests
    bus bandwidths the cluster preset cites (``planner.cost.links``)."""
    from benchmarks.fsdp_validation import FIT, FIT_ATTENTION, fsdp_ratio

    def loss(fields: dict[str, float]) -> float:
        megatron = [predict(r, **fields)[0] / r.published_tflops() for r in CALIBRATION]
        fsdp = [fsdp_ratio(r, **fields) for r in FIT + FIT_ATTENTION]
        return sum(math.log(x) ** 2 for x in megatron + fsdp)

    grid = [
        {"matmul_efficiency": eff / 100, "tile_transfers": tiles / 4}
        for eff in range(70, 83)
        for tiles in range(4, 15)
    ]
    best = min(grid, key=loss)
    console.print(
        "fit: "
        + ", ".join(f"{k}={v:.2f}" for k, v in best.items())
        + f" (sum of squared log ratios {loss(best):.3f})"
    )
    return best


COLUMNS = (
    "source",
    "model",
    "GPUs",
    "layout (t, p, d, m, b, B)",
    "shardlib knobs",
    "published TFLOP/s/GPU",
    "predicted",
    "ratio",
    "step (pred.)",
    "MFU (pred.)",
)


def rows(runs: list[Run], **cluster_fields) -> list[tuple[list[str], float]]:
    """Each run's cells (``COLUMNS``) and its predicted/published ratio."""
    out = []
    for run in runs:
        tflops, est = predict(run, **cluster_fields)
        ratio = tflops / run.published_tflops()
        m = PlanView(est.plan).microbatches
        b = run.global_batch // (run.data * m)
        cells = [
            run.source.split(",")[0],
            run.name,
            str(run.gpus),
            f"t={run.tensor} p={run.stage} d={run.data} m={m} b={b} B={run.global_batch}",
            PlanView(est.plan).knobs_text(),
            f"{run.published_tflops():.1f}",
            f"{tflops:.1f}",
            f"{ratio:.3f}",
            f"{est.step_s:.2f} s",
            f"{est.mfu:.1%}",
        ]
        out.append((cells, ratio))
    return out


def show(console: Console, title: str, body: list[tuple[list[str], float]], markdown: bool):
    if markdown:
        console.print(f"\n{title}\n\n| " + " | ".join(COLUMNS) + " |", highlight=False)
        console.print("|" + " --- |" * len(COLUMNS), highlight=False)
        for cells, _ in body:
            console.print("| " + " | ".join(cells) + " |", highlight=False)
        return
    out = Table(title=title)
    for i, col in enumerate(COLUMNS):
        out.add_column(col, justify="right" if i >= 5 else "left")
    for cells, _ in body:
        out.add_row(*cells)
    console.print(out)


def parity_axes(lo: float, hi: float, *, log: bool = False):
    """``(fig, ax)`` for predicted against published on [lo, hi]: the parity line, the ±15%
    band around it, the predicted axis labelled (log-log with ``log``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    ax.plot([lo, hi], [lo, hi], color="grey", lw=1)
    ax.fill_between(
        [lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="grey", alpha=0.15
    )
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_ylabel("predicted by shardlib's planner")
    return fig, ax


def compare_blocks(console: Console, markdown: bool) -> dict[str, list[float]]:
    """Every published run costed twice, with the SwiGLU stand-in and with the GPT block
    (``BLOCKS``), side by side; returns each block's predicted/published ratios."""
    header = ("set", "model", "GPUs", "published TFLOP/s/GPU", "stand-in", "GPT block",
              "params stand-in / GPT")  # fmt: skip
    sets = (("calibration", CALIBRATION), ("MT-NLG", OTHER_STACK), ("Table 1", HELD_OUT))
    lines, ratios = [], {b: [] for b in BLOCKS}
    for label, runs in sets:
        for run in runs:
            r = {b: predict(run, block=b)[0] / run.published_tflops() for b in BLOCKS}
            for b in BLOCKS:
                ratios[b].append(r[b])
            params = [gpt_workload(run, b).param_count / 1e9 for b in BLOCKS]
            lines.append([label, run.name, str(run.gpus), f"{run.published_tflops():.1f}",
                          f"{r['stand-in']:.3f}", f"{r['gpt']:.3f}",
                          f"{params[0]:.1f}B / {params[1]:.1f}B"])  # fmt: skip
    if markdown:
        console.print("\n| " + " | ".join(header) + " |\n|" + " --- |" * len(header))
        for cells in lines:
            console.print("| " + " | ".join(cells) + " |", highlight=False)
    else:
        table = Table(title="the GPT block against the SwiGLU stand-in: predicted / published")
        for col in header:
            table.add_column(col)
        for cells in lines:
            table.add_row(*cells)
        console.print(table)
    return ratios


def plot(path: str, cal: list, other: list, held: list) -> None:
    """Predicted against published TFLOP/s per GPU, the ±15% band around parity."""
    fig, ax = parity_axes(100, 200)
    for body, runs, marker, label in (
        (cal, CALIBRATION, "o", "calibration (Megatron-LM)"),
        (other, OTHER_STACK, "s", "check: MT-NLG (DeepSpeed + Megatron)"),
        (held, HELD_OUT, "^", "held out (Narayanan et al. 2021 Table 1)"),
    ):
        xs = [run.published_tflops() for run in runs]
        ys = [float(cells[6]) for cells, _ in body]
        ax.scatter(xs, ys, marker=marker, label=label)
        for x, y, run in zip(xs, ys, runs, strict=True):
            ax.annotate(
                f"{run.name}/{run.gpus}",
                (x, y),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
    ax.set_xlabel("published TFLOP/s per A100 (the publication's FLOP count)")
    ax.set_title("planner throughput model vs published runs (band: ±15%)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="refit the two fitted constants first")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--plot", default=None, metavar="PNG", help="draw predicted vs published")
    parser.add_argument(
        "--blocks", action="store_true", help="cost every run with the GPT block and the stand-in"
    )
    args = parser.parse_args(argv)
    console = Console(width=1000 if args.markdown else 200)
    if args.blocks:
        for name, rs in compare_blocks(console, args.markdown).items():
            within = sum(0.85 <= r <= 1.15 for r in rs)
            console.print(
                f"{name}: {within}/{len(rs)} within 15%, ratios {min(rs):.3f}-{max(rs):.3f}"
            )
        return 0
    fields = {}
    if args.fit:
        fields = fit(console)
    cal = rows(CALIBRATION, **fields)
    show(console, "calibration: predicted / published (target 0.85-1.15)", cal, args.markdown)
    other = rows(OTHER_STACK, **fields)
    show(console, "check, another stack: MT-NLG (never fitted)", other, args.markdown)
    held = rows(HELD_OUT, **fields)
    show(console, "held out: Narayanan et al. 2021 Table 1 (never fitted)", held, args.markdown)
    if args.plot:
        plot(args.plot, cal, other, held)
        console.print(f"wrote {args.plot}")
    ratios = {name: [r for _, r in body] for name, body in (("calibration", cal),
              ("MT-NLG", other), ("held out", held))}  # fmt: skip
    console.print(
        "; ".join(
            f"{name}: {sum(0.85 <= r <= 1.15 for r in rs)}/{len(rs)} within 15%, ratios "
            f"{min(rs):.3f}-{max(rs):.3f}"
            for name, rs in ratios.items()
        )
    )
    return 0 if all(0.85 <= r <= 1.15 for r in ratios["calibration"]) else 1


if __name__ == "__main__":
    sys.exit(main())
