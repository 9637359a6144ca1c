"""Training throughput on one real GPU: tokens/s, step time, MFU and memory per configuration.

    python benchmarks/gpu_train.py --jsonl runs.jsonl                  # every run below
    python benchmarks/gpu_train.py --jsonl runs.jsonl --only 1b-none,1b-full
    python benchmarks/gpu_train.py --jsonl runs.jsonl --table          # print what is there

Each run is ``shardlib.train.loop.run`` on a one-device mesh with bf16 compute and fp32
master weights (AdamW), the embedded corpus, batch 4 x seq 2048 unless the run says
otherwise. The first step compiles and is left out; the step time is the median of the
others. MFU is model FLOPs (6 per parameter per token plus attention, no recompute) over
the device's published dense bf16 peak (``train.metrics.PEAK_FLOPS``); HFU counts the
compiled program's FLOPs (recompute included). Memory is the compiled step's
(``memory_analysis``: device and pinned-host bytes) and the allocator's peak. The planner's
prediction for the same plan on ``--cluster`` is printed beside each run.

Runs go in order of importance, each appended to ``--jsonl`` as it finishes; runs already
there are skipped, so a run that died (an XLA abort) is resumed by starting it again. A run
that fails (out of memory, a kernel cuDNN refuses) is recorded with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

SEVEN_B = {"model": "llama-7b", "model.layers": "8"}  # 7B's width, 8 of its 32 layers
DENSE = {"attention_impl": "dense"}  # the first GPU session's runs, before auto was the default
RUNS: dict[str, dict[str, str]] = {
    # the defaults, nothing set but the model and remat (attention_impl=auto)
    "1b-auto-none": {"model": "llama-1b", "remat": "none"},
    "1b-auto-selective": {"model": "llama-1b", "remat": "selective"},
    "7b8-auto-none": {**SEVEN_B, "remat": "none"},
    "7b8-auto-selective": {**SEVEN_B, "remat": "selective"},
    "1b-auto-none-b8": {"model": "llama-1b", "remat": "none", "batch": "8"},
    "7b8-auto-none-b8": {**SEVEN_B, "remat": "none", "batch": "8"},
    # the first session's runs, each kernel named
    "1b-none": {"model": "llama-1b", "remat": "none", **DENSE},
    "1b-selective": {"model": "llama-1b", "remat": "selective", **DENSE},
    "1b-full": {"model": "llama-1b", "remat": "full", **DENSE},
    "1b-cudnn-none": {"model": "llama-1b", "remat": "none", "attention_impl": "cudnn"},
    "1b-cudnn-full": {"model": "llama-1b", "remat": "full", "attention_impl": "cudnn"},
    "1b-full-offload-opt": {
        "model": "llama-1b",
        "remat": "full",
        "offload_optimizer": "true",
        **DENSE,
    },  # fmt: skip
    "1b-offload-residuals": {
        "model": "llama-1b",
        "remat": "offload:attn_residual,mlp_hidden",
        **DENSE,
    },  # fmt: skip
    "7b8-none": {**SEVEN_B, "remat": "none", **DENSE},
    "7b8-selective": {**SEVEN_B, "remat": "selective", **DENSE},
    "7b8-full": {**SEVEN_B, "remat": "full", **DENSE},
    "1b-cudnn-seq8192": {
        "model": "llama-1b",
        "remat": "full",
        "attention_impl": "cudnn",
        "batch": "1",
        "seq": "8192",
    },  # fmt: skip
    # FP8 projections (e4m3/e5m2, delayed scaling) against bf16, 200 steps each: tokens/s
    # (median step) and the loss curves; the 6-step 7b8-fp8 times the default run's twin
    "7b8-fp8": {**SEVEN_B, "remat": "none", "precision": "fp8"},
    "7b8-bf16-200": {**SEVEN_B, "remat": "none", "steps": "200"},
    "7b8-fp8-200": {**SEVEN_B, "remat": "none", "precision": "fp8", "steps": "200"},
    # the chunked loss (parallel.loss.chunk) on the 128K vocabulary, against 1b-auto-none
    "1b-auto-none-chunked-loss": {"model": "llama-1b", "remat": "none", "loss_chunk": "256"},
    "1b-dense-seq8192": {
        "model": "llama-1b",
        "remat": "full",
        "batch": "1",
        "seq": "8192",
        **DENSE,
    },
}
COMMON = {"precision": "bf16", "batch": "4", "seq": "2048", "steps": "6", "compile_cache": "off"}


def one_run(name: str, settings: dict[str, str], cluster_name: str, extra: dict) -> dict:
    import jax

    from shardlib.train.config import parse_overrides
    from shardlib.train.loop import run
    from shardlib.train.setup import make_setup

    args = {**COMMON, **settings, **extra}
    cfg = parse_overrides([f"{k}={v}" for k, v in args.items()])
    setup = make_setup(cfg)
    t0 = time.perf_counter()
    result = run(setup, show=False)
    wall = time.perf_counter() - t0
    steady = [r for r in result.records if not r["warmup"]]
    mid = sorted(steady, key=lambda r: r["step_time_s"])[len(steady) // 2]
    out = {
        "run": name, "settings": args, "device": jax.devices()[0].device_kind,
        "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "steps_timed": len(steady), "wall_s": wall, "loss_last": result.records[-1]["loss"],
        "step_s_all": [r["step_time_s"] for r in steady], "peak_flops": result.peak_flops,
        "losses": [r["loss"] for r in result.records],
        "attention": setup.attention.describe() if setup.attention else "",
    }  # fmt: skip
    for key in (
        "step_time_s", "tokens_per_s", "mfu", "hfu", "memory_step_bytes", "memory_host_bytes",
        "memory_peak_bytes_in_use",
    ):  # fmt: skip
        if key in mid:
            out[key] = mid[key]
    out.update(predict(args, cluster_name))
    del result, setup
    return out


def predict(settings: dict, cluster_name: str) -> dict:
    """The planner's step time and memory for a run's settings on one device of the preset
    (computed again when the table is printed, so a recalibrated model is compared)."""
    from shardlib.planner import Workload, estimate, load_cluster
    from shardlib.train.config import parse_overrides

    try:
        cfg = parse_overrides([f"{k}={v}" for k, v in settings.items()])
        plan = cfg.parallel.with_devices(1)
        predicted = estimate(Workload.from_train_config(cfg), plan, load_cluster(cluster_name))
        return {
            "predicted_step_s": predicted.step_s,
            "predicted_memory_bytes": predicted.memory_bytes,
        }
    except Exception as err:  # the planner may not cost every setting: say so, keep the run
        return {"predicted_error": f"{type(err).__name__}: {err}"}


def print_table(path: str, cluster_name: str) -> None:
    from rich.console import Console
    from rich.table import Table

    records = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    if not records:
        print("no runs recorded")
        return
    first = next((r for r in records if "device" in r), records[0])
    table = Table(title=f"training on one {first.get('device')} (jax {first.get('jax')})")
    for col in (
        "run", "step", "tokens/s", "MFU", "device mem", "host mem", "planner step",
        "planner mem",
    ):  # fmt: skip
        table.add_column(col, justify="left" if col == "run" else "right")
    gib = 2**30
    for r in records:
        if "error" in r:
            table.add_row(r["run"], f"[red]{r['error'][:60]}[/red]", *[""] * 6)
            continue
        r.update(predict(r["settings"], cluster_name))  # today's model, not the stored one
        pred, mem = r.get("predicted_step_s"), r.get("memory_step_bytes", 0)
        pred_mem, host = r.get("predicted_memory_bytes"), r.get("memory_host_bytes", 0)
        table.add_row(
            r["run"], f"{r['step_time_s'] * 1e3:.1f} ms", f"{r['tokens_per_s']:,.0f}",
            f"{r['mfu']:.1%}", f"{mem / gib:.1f} GiB", f"{host / gib:.1f} GiB",
            f"{pred * 1e3:.1f} ms ({r['step_time_s'] / pred:.2f}x)" if pred else "-",
            f"{pred_mem / gib:.1f} GiB ({pred_mem / mem:.2f})" if pred_mem and mem else "-",
        )  # fmt: skip
    Console(width=160).print(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jsonl", default="gpu_runs.jsonl")
    parser.add_argument("--only", default="", help="comma-separated run names (default: all)")
    parser.add_argument("--cluster", default="h200-1", help="preset the planner predicts for")
    parser.add_argument("--deadline", type=float, default=0.0, help="stop starting runs after "
                        "this many seconds")  # fmt: skip
    parser.add_argument("--no-gpu-flags", action="store_true", help="leave XLA_FLAGS as is")
    parser.add_argument("--tag", default="", help="suffix of the run names (e.g. -noflags)")
    parser.add_argument("--set", default="", help="NAME=VALUE,... applied to every run "
                        "(a CPU smoke run: --set model=llama-small,seq=128)")  # fmt: skip
    parser.add_argument("--table", action="store_true", help="print the recorded runs, run none")
    args = parser.parse_args()
    if args.table:
        print_table(args.jsonl, args.cluster)
        return 0

    from shardlib.train.xla_flags import apply_gpu_defaults

    added = apply_gpu_defaults(not args.no_gpu_flags)  # before JAX starts its backend
    print(f"XLA flags added: {added or 'none'}", flush=True)
    names = [n for n in (args.only.split(",") if args.only else RUNS) if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        print(f"unknown runs {unknown}; known: {', '.join(RUNS)}", file=sys.stderr)
        return 2
    done = set()
    if os.path.exists(args.jsonl):
        done = {json.loads(line)["run"] for line in open(args.jsonl)}
    start = time.perf_counter()
    for name in names:
        tagged = name + args.tag
        if tagged in done:
            continue
        if args.deadline and time.perf_counter() - start > args.deadline:
            print(f"deadline: {tagged} not started", flush=True)
            continue
        print(f"run {tagged}: {RUNS[name]}", flush=True)
        try:
            extra = dict(kv.split("=", 1) for kv in args.set.split(",") if kv)
            record = one_run(name, RUNS[name], args.cluster, extra)
            record["run"] = tagged
        except Exception as err:
            traceback.print_exc()
            record = {
                "run": tagged,
                "settings": RUNS[name],
                "error": f"{type(err).__name__}: {err}",
            }
        with open(args.jsonl, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps({k: v for k, v in record.items() if k != "xla_flags"}), flush=True)
        import gc

        import jax

        gc.collect()
        jax.clear_caches()
    print_table(args.jsonl, args.cluster)
    return 0


if __name__ == "__main__":
    sys.exit(main())
