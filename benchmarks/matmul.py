"""Measured bf16 matmul throughput by shape on this device, against the planner's model.

    python benchmarks/matmul.py --cluster h200-1                 # on a GPU (30 s)
    python benchmarks/matmul.py --cluster h200-1 --json out.json

The planner prices every matmul of a step as ``planner.cost.kernels.Matmul.seconds``: a
roofline whose compute ceiling is ``peak x matmul_efficiency``, with a half-wave tail over
the streaming multiprocessors and the HBM slope below the ridge. This measures the same
products (square sweeps, and the per-block products of Llama 1B and 7B at 8k tokens) with
``jax.jit`` on one device, fits ``matmul_efficiency`` as the median achieved fraction of
peak over the compute-bound products (>= 1 TFLOP each), and prints measured / modelled time
for every shape at that fitted value: the calibration of the cluster preset's compute
figure. It also measures HBM bandwidth (an elementwise pass over 4 GiB, bytes
read + written) for the preset's ``hbm_gbps``.

On CPU it runs (smaller shapes, ``--quick``), but the figures describe the host, not a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

TOKENS = 8192  # one step of batch 4 x seq 2048 on one device
SQUARE = (512, 1024, 2048, 4096, 8192, 16384)
# (name, M, K, N) of one block's forward products at TOKENS tokens (models/llama/model.py fuses
# q/k/v and gate/up), and the output head
MODEL = (
    ("1b qkv", TOKENS, 2048, 3072),
    ("1b out", TOKENS, 2048, 2048),
    ("1b gate+up", TOKENS, 2048, 16384),
    ("1b down", TOKENS, 8192, 2048),
    ("1b head", TOKENS, 2048, 128256),
    ("7b qkv", TOKENS, 4096, 12288),
    ("7b out", TOKENS, 4096, 4096),
    ("7b gate+up", TOKENS, 4096, 22016),
    ("7b down", TOKENS, 11008, 4096),
    ("7b head", TOKENS, 4096, 32000),
    ("small m 256", 256, 4096, 4096),
    ("small m 1024", 1024, 4096, 4096),
)
LARGE_FLOPS = 1e12  # products this large are compute-bound: they fit the ceiling


def time_fn(fn, *args_sets, repeats: int = 20) -> float:
    """Median seconds per call: warm up, then queue ``repeats`` calls (rotating the input
    sets so no product reads another's cached result) and block on the last, three times."""
    import jax

    for args in args_sets:
        jax.block_until_ready(fn(*args))
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = None
        for i in range(repeats):
            out = fn(*args_sets[i % len(args_sets)])
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t0) / repeats)
    return statistics.median(runs)


def measure_matmul(m: int, k: int, n: int) -> float:
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(m * 7 + k * 3 + n), 4)
    sets = [
        (
            jax.random.normal(keys[2 * i], (m, k), jnp.bfloat16),
            jax.random.normal(keys[2 * i + 1], (k, n), jnp.bfloat16),
        )
        for i in range(2)
    ]
    fn = jax.jit(lambda a, b: a @ b)
    return time_fn(fn, *sets, repeats=10 if 2 * m * k * n > 2e12 else 30)


def measure_hbm(gib: float) -> float:
    """Bytes/s of an elementwise pass (read + write) over ``gib`` GiB of bf16."""
    import jax
    import jax.numpy as jnp

    n = int(gib * 2**30 / 2)
    xs = [jnp.full((n,), float(i + 1), jnp.bfloat16) for i in range(2)]
    fn = jax.jit(lambda x: x * 1.5 + 1.0)
    seconds = time_fn(fn, *[(x,) for x in xs], repeats=10)
    return 2 * n * 2 / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="h200-1", help="preset whose model is compared")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--quick", action="store_true", help="small shapes (CPU smoke run)")
    args = parser.parse_args()

    import dataclasses

    import jax
    from rich.console import Console
    from rich.table import Table

    from shardlib.planner import load_cluster
    from shardlib.planner.cost.kernels import Matmul

    cluster = load_cluster(args.cluster)
    device = jax.devices()[0]
    shapes = [(f"square {s}", s, s, s) for s in SQUARE] + list(MODEL)
    if args.quick:
        shapes = [
            (name, max(m // 16, 8), max(k // 16, 8), max(n // 16, 8)) for name, m, k, n in shapes
        ]
    rows = []
    for name, m, k, n in shapes:
        seconds = measure_matmul(m, k, n)
        rows.append({"name": name, "m": m, "k": k, "n": n, "seconds": seconds})
    hbm = measure_hbm(0.0625 if args.quick else 4.0)

    large = [r for r in rows if 2 * r["m"] * r["k"] * r["n"] >= LARGE_FLOPS]
    which = f"{len(large)} products >= 1 TFLOP" if large else f"all {len(rows)} products"
    large = large or rows
    achieved = [2 * r["m"] * r["k"] * r["n"] / r["seconds"] / cluster.peak_flops for r in large]
    # the ceiling the model's wave tail multiplies: achieved x (waves + 0.5) / waves
    ceilings = []
    for r, frac in zip(large, achieved, strict=True):
        mm = Matmul(r["name"], r["m"], r["k"], r["n"])
        waves = mm.waves(cluster) if cluster.sms else 0.0
        ceilings.append(frac * (waves + 0.5) / waves if waves else frac)
    efficiency = statistics.median(ceilings)
    fitted = dataclasses.replace(cluster, matmul_efficiency=efficiency, hbm_bw=hbm)

    table = Table(title=f"bf16 matmuls on {device.device_kind} (jax {jax.__version__})")
    for col in ("product", "M x K x N", "TFLOP/s", "of peak", "model (fitted)", "measured/model"):
        table.add_column(col, justify="right" if col != "product" else "left")
    for r in rows:
        mm = Matmul(r["name"], r["m"], r["k"], r["n"])
        model_s = mm.seconds(fitted, 2)
        r["tflops"] = mm.flops / r["seconds"] / 1e12
        r["model_seconds"] = model_s
        table.add_row(
            r["name"], f"{r['m']} x {r['k']} x {r['n']}", f"{r['tflops']:.1f}",
            f"{mm.flops / r['seconds'] / cluster.peak_flops:.1%}",
            f"{model_s * 1e3:.3f} ms", f"{r['seconds'] / model_s:.2f}",
        )  # fmt: skip
    console = Console(width=140)
    console.print(table)
    preset = f"preset {cluster.name}: {cluster.matmul_efficiency}"
    console.print(
        f"fitted matmul_efficiency (median over {which}, wave tail removed): "
        f"{efficiency:.3f} of {cluster.peak_flops / 1e12:.0f} TFLOP/s ({preset}); "
        f"HBM elementwise pass: {hbm / 1e9:,.0f} GB/s (preset: {cluster.hbm_bw / 1e9:,.0f})"
    )
    if device.platform == "cpu":
        console.print("note: CPU figures describe the host, not a GPU: they calibrate nothing.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": device.device_kind, "jax": jax.__version__,
                    "cluster": args.cluster, "matmul_efficiency": efficiency,
                    "hbm_bytes_per_s": hbm, "rows": rows,
                },
                f, indent=1,
            )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
