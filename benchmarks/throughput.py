"""Tokens/s and MFU of `shardlib train` on the devices present, and the planner's calibration.

    python benchmarks/throughput.py --mesh cpu-8-3d --cluster cpu-8-small steps=6 batch=16 seq=128
    python benchmarks/throughput.py --mesh plan.toml --cluster h100-8            # on a GPU host

Runs the train step ``steps`` times (the first, compiling, step is left out), counts model
FLOPs as the planner does (6 per parameter per token plus attention, no recompute) and
divides by the cluster preset's peak: MFU. It also times an all-reduce over every device
(bus bandwidth 2(N-1)/N x bytes / time) and prints the planner's predicted step for the same
plan next to the measured one, with the ``matmul_efficiency`` that would make them agree:
on a GPU or TPU that is how the preset's compute and bandwidth figures get calibrated.
With simulated CPU devices (this repository's CI) the numbers describe 8 fake devices
sharing a few cores, not hardware. On one real GPU, ``benchmarks/gpu_train.py`` runs this
same loop over its configurations in one process (docs/gpu.md: an H200).
"""

from __future__ import annotations

import argparse
import sys
import time


def allreduce_bandwidth(nbytes: int, repeats: int = 5) -> tuple[float, int]:
    """Bus bandwidth (bytes/s per device) of an all-reduce of ``nbytes`` over all devices."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("x",))
    per = max(nbytes // 4 // n, 1)
    x = jax.device_put(jnp.ones((n, per), jnp.float32), NamedSharding(mesh, P("x")))
    total = jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P()))
    total(x).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        total(x).block_until_ready()
    seconds = (time.perf_counter() - start) / repeats
    moved = 2 * (n - 1) / n * per * 4
    return (moved / seconds if seconds > 0 else float("inf")), n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="cpu-8-3d", help="mesh preset (or a written plan)")
    parser.add_argument("--cluster", default="cpu-8-small", help="cluster preset (peak FLOP/s)")
    parser.add_argument("--allreduce-mib", type=int, default=64)
    parser.add_argument("overrides", nargs="*", metavar="NAME=VALUE")
    args = parser.parse_args()

    from shardlib.core.mesh import load_mesh, simulate_cpu_devices

    spec = load_mesh(args.mesh)
    if spec.platform == "cpu":
        simulate_cpu_devices(spec.fixed_size or 8)
    from rich.console import Console
    from rich.table import Table

    from shardlib.core.values import flatten_table
    from shardlib.parallel.plan import ParallelPlan
    from shardlib.planner import PlanView, Workload, estimate, load_cluster
    from shardlib.train.config import TrainConfig, override, parse_overrides
    from shardlib.train.loop import run
    from shardlib.train.setup import make_setup

    # as the CLI reads a preset: [mesh] and [parallel.*] make the plan, [train] the settings
    parallel = ParallelPlan.from_mesh_spec(spec)
    base = override(TrainConfig(parallel=parallel), flatten_table(spec.train))
    cfg = parse_overrides(["steps=6", *args.overrides], base)
    mesh = spec.build()
    setup = make_setup(cfg, mesh)
    result = run(setup, show=False)
    steady = [r["step_time_s"] for r in result.records if not r["warmup"]]
    if not steady:
        print("need steps >= 2 (the first step compiles)", file=sys.stderr)
        return 2
    step_s = sorted(steady)[len(steady) // 2]  # median
    workload = Workload.from_train_config(cfg)
    cluster = load_cluster(args.cluster)
    n = mesh.devices.size
    platform = mesh.devices.flat[0].platform
    mfu = workload.model_flops / (step_s * n * cluster.peak_flops)
    bandwidth, _ = allreduce_bandwidth(args.allreduce_mib * 2**20)

    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    plan = cfg.parallel.with_mesh_axes(sizes)  # the plan that ran, on the built mesh
    sized = cluster if cluster.num_devices == n else None
    predicted = estimate(workload, plan, sized) if sized else None

    table = Table(
        title=f"throughput: {cfg.model} on {PlanView(plan).mesh_text()} ({n} {platform} devices)"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("step time (median of steady steps)", f"{step_s:.4f} s")
    table.add_row("tokens/s", f"{workload.tokens / step_s:,.0f}")
    table.add_row("model FLOPs per step (6Ψ + attention)", f"{workload.model_flops:.3e}")
    table.add_row("achieved FLOP/s per device", f"{workload.model_flops / step_s / n:.3e}")
    table.add_row(f"MFU vs {cluster.name} peak", f"{mfu:.2%}")
    table.add_row(
        f"all-reduce bus bandwidth ({args.allreduce_mib} MiB)", f"{bandwidth / 1e9:.2f} GB/s"
    )
    if predicted is not None:
        table.add_row("planner's predicted step", f"{predicted.step_s:.4f} s")
        table.add_row("measured / predicted", f"{step_s / predicted.step_s:.2f}")
        compute_share = predicted.compute_s / predicted.step_s
        # compute time scales about as 1 / matmul_efficiency (memory-bound parts do not)
        eff = (
            cluster.matmul_efficiency
            * predicted.compute_s
            / max(step_s - (predicted.step_s - predicted.compute_s), 1e-12)
        )
        table.add_row(
            f"matmul_efficiency that fits (preset: {cluster.matmul_efficiency})",
            f"{eff:.3f} (compute is {compute_share:.0%} of the prediction)",
        )
    Console(width=140).print(table)
    if platform == "cpu":
        print(
            "note: simulated CPU devices share this machine's cores; these are not hardware "
            "figures and must not calibrate a GPU/TPU preset."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
