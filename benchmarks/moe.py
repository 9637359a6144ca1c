"""Expert parallelism, measured: all-to-all traffic and expert weight bytes per device.

Compiles the MoE train step on several meshes from abstract inputs (nothing runs, nothing is
allocated) and reads, from the optimized HLO, every all-to-all per MoE layer (count x ring
wire bytes, loops counted per trip) and, from the compiled input shardings, the bytes of
expert weights each device holds. The formula is REFERENCE.md's: per MoE layer 4
all-to-alls (dispatch and combine, forward and backward), each k*b*s*h*(N-1)/N elements per
device, b the per-device batch; with a capacity factor cf the buffers grow by cf.

On the CPU backend a bf16 run moves the dispatched tokens in fp32 (XLA's CPU pipeline runs
bf16 dots in fp32 and places the convert after the all-to-all), so bf16 rows read 2x the
bf16 formula there; fp32 rows are exact. (GPU/TPU backends run bf16 dots natively; not
measured here.)

    python benchmarks/moe.py                       # moe-tiny on 8 simulated CPU devices
    python benchmarks/moe.py --model mixtral-8x7b --devices 64 --batch 64 --seq 4096 \\
        --precision bf16 --meshes e8d8 e8f8 e8t8
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shardlib import simulate_cpu_devices  # noqa: E402 - before JAX starts

MESHES = {  # name: mesh axes
    "e1": {"expert": 1},
    "e2": {"expert": 2},
    "e4": {"expert": 4},
    "e8": {"expert": 8},
    "d2e4": {"data": 2, "expert": 4},
    "f2e4": {"fsdp": 2, "expert": 4},
    "e4t2": {"expert": 4, "tensor": 2},
    "e8d8": {"data": 8, "expert": 8},
    "e8f8": {"fsdp": 8, "expert": 8},
    "e8t8": {"expert": 8, "tensor": 8},
}
DEFAULT_MESHES = ["e1", "e2", "e4", "e8", "d2e4", "f2e4", "e4t2"]


def measure(cfg, axes: dict, devices) -> dict:
    from shardlib import mesh_spec
    from shardlib.analysis import explain
    from shardlib.train.setup import make_setup

    setup = make_setup(cfg, mesh_spec(**axes).build(devices[: math.prod(axes.values())]))
    args = (setup.abstract_state(), setup.abstract_batch())
    report = explain(setup.train_step, *args, mesh=setup.mesh)
    model, layers = setup.model_cfg, setup.model_cfg.moe_layers
    a2a = [op for op in report.collectives if op.kind == "all-to-all"]
    n = axes.get("expert", 1)
    seq = cfg.dataset.seq
    b = cfg.dataset.batch / math.prod(axes.get(a, 1) for a in setup.rules.activations["batch"])
    itemsize = 2 if cfg.precision.compute == "bf16" else 4
    cf = model.capacity(seq) * model.experts / (model.top_k * seq)  # effective factor
    formula = 4 * model.top_k * cf * b * seq * model.embed * (n - 1) / n * itemsize
    measured = sum(op.total_wire_bytes for op in a2a) / layers
    expert = [t for t in report.tensors if t.is_param and ".experts." in t.path]
    gathers = [op for op in report.collectives if op.kind == "all-gather" and "expert" in op.axes]
    return {
        "a2a_per_layer": sum(op.count for op in a2a) / layers,
        "measured": measured,
        "formula": formula,
        "cf": cf,
        "expert_gathers": len(gathers),
        "expert_bytes": sum(t.bytes_per_device for t in expert),
        "expert_total": sum(t.bytes for t in expert),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="moe-tiny")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--capacity-factor", type=float, default=1.0)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--meshes", nargs="*", default=DEFAULT_MESHES, choices=sorted(MESHES))
    p.add_argument("--dispatch", nargs="*", default=["einsum", "shard_map"])
    args = p.parse_args()
    simulate_cpu_devices(args.devices)

    import jax
    from rich.console import Console
    from rich.table import Table

    from shardlib.analysis import format_bytes
    from shardlib.train.config import train_config

    table = Table(
        title=f"{args.model}: batch {args.batch} x seq {args.seq}, {args.precision}, "
        f"capacity factor {args.capacity_factor} ({jax.default_backend()} backend)"
    )
    for col in (
        "mesh",
        "dispatch",
        "a2a/layer",
        "a2a wire B/layer",
        "formula",
        "ratio",
        "expert all-gathers",
        "expert weights/device",
        "x E_axis / total",
    ):
        table.add_column(col, justify="right")
    for mesh in args.meshes:
        axes = MESHES[mesh]
        for dispatch in args.dispatch if axes.get("expert", 1) > 1 else ["einsum"]:
            cfg = train_config(
                model=args.model,
                batch=args.batch,
                seq=args.seq,
                precision=args.precision,
                dispatch=dispatch,
                **{"model.capacity_factor": args.capacity_factor},
            )
            r = measure(cfg, axes, jax.devices())
            ratio = r["measured"] / r["formula"] if r["formula"] else float("nan")
            shape = " x ".join(f"{k}={v}" for k, v in axes.items())
            e_axis = axes.get("expert", 1)
            table.add_row(
                shape,
                dispatch,
                f"{r['a2a_per_layer']:g}",
                format_bytes(r["measured"]),
                format_bytes(r["formula"]),
                f"{ratio:.3f}" if r["formula"] else "-",
                str(r["expert_gathers"]),
                format_bytes(r["expert_bytes"]),
                f"{r['expert_bytes'] * e_axis / r['expert_total']:.3f}",
            )
            print(f"measured {shape} {dispatch}", file=sys.stderr, flush=True)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
