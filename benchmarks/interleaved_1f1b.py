"""Interleaved 1F1B at GPT-3 scale: bubble from FLOPs, temp memory, data-axis bytes.

Run:  python benchmarks/interleaved_1f1b.py [--layouts 39b,146b] [--virtual 1,2,4]
          [--micro p,2p,4p]

The layouts of ``pipeline_scale.py`` (39B: tensor 8 x stage 2 x data 32; 146B: tensor 8 x
stage 8 x data 24; bf16, seq 2048, full recompute), 1F1B schedule with v virtual stages
and m micro-batches, compiled from abstract shapes on simulated CPU devices. Per (v, m):

* bubble: the matmul FLOPs the compiled step spends in the layers (every dot but the output
  head's, loop bodies times their trip counts: each chunk's forward, recomputed forward and
  backward) over the *ideal*, compiled separately: one device running the same L/p layers
  forward and backward (with the pipeline's recompute) on the replica's whole batch, once.
  Formula: (p-1)/(v·m) (Narayanan et al. 2021, REFERENCE.md);
* temp memory per device (``memory_analysis``), which should not grow with m;
* data-axis wire bytes per device and step against one ring reduction of the fp32
  gradients the device holds, 2(d-1)/d x held bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too

import argparse  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402
from rich.table import Table  # noqa: E402

from benchmarks.pipeline_scale import LAYOUTS, console  # noqa: E402  (simulates devices)
from shardlib import mesh_spec  # noqa: E402
from shardlib.analysis import explain, hlo, hlo_flops  # noqa: E402
from shardlib.analysis.report import format_bytes  # noqa: E402
from shardlib.core.layout import use_layout  # noqa: E402
from shardlib.core.ops import scan_blocks  # noqa: E402
from shardlib.parallel.layer_loop import cast_params  # noqa: E402
from shardlib.parallel.remat import remat_block  # noqa: E402
from shardlib.train.config import train_config  # noqa: E402
from shardlib.train.setup import make_setup  # noqa: E402


def _cfg(layout: str, v: int, m: int, axes: dict):
    model, _, per_replica = LAYOUTS[layout]
    return train_config(
        model="llama-70b",
        **{f"model.{k}": x for k, x in model.items()},
        **{"model.vocab": 51200},
        seq=2048,
        batch=per_replica * axes.get("data", 1),
        precision="bf16",
        remat="full",
        pipeline_schedule="1f1b",
        virtual_stages=v,
        pipeline_microbatches=m,
    )


class _Compiled:
    """Hands ``explain`` an executable compiled here, so its HLO is read once for both."""

    def __init__(self, compiled):
        self.compiled = compiled

    def lower(self, *args, **kwargs):
        return self

    def compile(self):
        return self.compiled


def matmul_flops(text: str, skip_dim: int | None = None) -> int:
    """Matmul FLOPs per device (loop bodies times their trips), without the dots that have a
    ``skip_dim``-sized dim (the output head's vocab shard: the head is not stage work).

    Matmuls, not every op, and picked by shape rather than by the ``pipeline_stage`` scope:
    the CPU backend rewrites bf16 dots to fp32 ones that carry no op_name."""
    module = hlo.parse_module(text)
    mult = hlo.call_multipliers(module)[0]
    total = 0
    for comp in module.computations.values():
        if not mult.get(comp.name):
            continue
        types = comp.types()
        for inst in comp.instructions:
            if inst.opcode not in ("dot", "convolution", "custom-call"):
                continue
            shapes = [inst.arrays] + [hlo.parse_type(types[o]) for o in inst.operands if o in types]
            if skip_dim is not None and any(skip_dim in a.dims for s in shapes for a in s):
                continue
            total += mult[comp.name] * hlo_flops.instruction_flops(inst, types)
    return total


def ideal_flops(layout: str) -> int:
    """One device's stage work without a bubble: L/p layers (tensor 8 only), forward, then
    forward again and backward (``jax.vjp``: the pipeline's recompute) on the whole batch of
    one data replica."""
    _, axes, per_replica = LAYOUTS[layout]
    p, t = axes["stage"], axes["tensor"]
    mesh = mesh_spec(tensor=t).build(jax.devices()[:t])
    setup = make_setup(_cfg(layout, 1, 1, {}), mesh)
    layers = setup.workload.blocks // p
    dtype = setup.compute_dtype
    params = setup.abstract_state()["params"]
    graph, _ = nnx.split(nnx.merge(setup.graphdef, params).blocks)
    block = remat_block(
        lambda w, x: nnx.merge(graph, w)(x, None), setup.plan.remat.spec(setup.workload)
    )

    def stage_of(a, sharding):  # the first L/p layers, laid out as the stacked blocks
        return jax.ShapeDtypeStruct((layers, *a.shape[1:]), a.dtype, sharding=sharding)

    stage = jax.tree.map(stage_of, params["blocks"], setup.param_shardings["blocks"])
    names = ("batch", "seq", "embed")
    x_sharding = jax.sharding.NamedSharding(mesh, setup.rules.spec(names))
    x_shape = (per_replica, setup.workload.seq, setup.workload.dims["embed"])
    x = jax.ShapeDtypeStruct(x_shape, dtype, sharding=x_sharding)

    def work(w, x):
        with use_layout(setup.mesh, setup.rules):
            w = cast_params({"blocks": nnx.State(w)}, dtype)["blocks"]
            y = scan_blocks(block, w, x)
            _, pull = jax.vjp(lambda w, x: scan_blocks(block, w, x), w, x)
            return y, pull(y)

    return matmul_flops(jax.jit(work).lower(stage, x).compile().as_text())


def vocab_shard(layout: str) -> int:
    return 51200 // LAYOUTS[layout][1]["tensor"]


def measure(layout: str, v: int, m: int) -> dict:
    _, axes, _ = LAYOUTS[layout]
    mesh = mesh_spec(**axes).build(jax.devices()[: math.prod(axes.values())])
    setup = make_setup(_cfg(layout, v, m, axes), mesh)
    state, batch = setup.abstract_state(), setup.abstract_batch()
    compiled = setup.train_step.lower(state, batch).compile()
    report = explain(_Compiled(compiled), state, batch, mesh=mesh, params=state["params"])
    shapes, shardings = setup.param_shapes, setup.param_shardings
    held = jax.tree.map(lambda s, sh: math.prod(sh.shard_shape(s.shape)) * 4, shapes, shardings)
    d = axes["data"]
    return {
        "stage": matmul_flops(compiled.as_text(), vocab_shard(layout)),
        "wire": sum(op.total_wire_bytes for op in report.collectives if "data" in op.axes),
        "ring": 2 * (d - 1) / d * sum(jax.tree.leaves(held)),
        "temp": report.memory.temp_bytes,
    }


def table(layout: str, virtual: list[int], micro: list[str]) -> Table:
    _, axes, _ = LAYOUTS[layout]
    p = axes["stage"]
    shape = " x ".join(f"{a} {n}" for a, n in axes.items())
    out = Table(title=f"{layout}-class, {shape}: interleaved 1F1B (full recompute)")
    for col in ("v", "m", "bubble (FLOPs)", "(p-1)/(v·m)", "temp", "data wire", "2(d-1)/d held"):
        out.add_column(col, justify="right")
    ideal = ideal_flops(layout)
    for v in virtual:
        for spec in micro:
            m = int(spec.replace("p", "")) * p if spec.endswith("p") else int(spec)
            start = time.perf_counter()
            r = measure(layout, v, m)
            console.log(f"{layout} v={v} m={m}: {time.perf_counter() - start:.0f} s")
            out.add_row(
                str(v),
                str(m),
                f"{r['stage'] / ideal - 1:.4f}",
                f"{(p - 1) / (v * m):.4f}",
                format_bytes(r["temp"]),
                format_bytes(r["wire"]),
                format_bytes(r["ring"]),
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="39b,146b")
    parser.add_argument("--virtual", default="1,2,4")
    parser.add_argument("--micro", default="1p,2p,4p", help="m as multiples of p (or numbers)")
    args = parser.parse_args()
    console.print(f"jax {jax.__version__}, backend {jax.default_backend()}, simulated devices")
    virtual = [int(v) for v in args.virtual.split(",")]
    for layout in args.layouts.split(","):
        console.print(table(layout, virtual, args.micro.split(",")))


if __name__ == "__main__":
    main()
