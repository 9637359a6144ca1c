"""No framework tax: shardlib's train step next to the same step written in plain JAX.

    python benchmarks/peers.py            # 3 meshes x (fp32, bf16) x remat (full, none, dots)
    python benchmarks/peers.py --quick    # fp32 remat=full only

On 8 simulated CPU devices, for a small Llama (vocab 8192, width 512, 8 heads of 64,
SwiGLU 2048, 4 layers, untied head; seq 256, batch 8, AdamW) on fsdp=8, data2 x fsdp2 x
tensor2 and tensor=8, it prints per device, for shardlib and for the hand-written baseline
(``benchmarks/plain_jax.py``):

* memory: argument + output + temp - alias of the compiled step's ``memory_analysis()``;
* collective bytes per step: the result-shape bytes of every collective of the optimized
  HLO, a collective inside a loop counted once per trip (``shardlib.analysis.hlo``);
* step time as shardlib / baseline: the median of 3 rounds of paired runs, the order of the
  two programs alternating from round to round so that neither always runs on a warmer (or
  busier) machine.

The fp32 remat=full rows are also checked against the best peer measured (plain JAX by
hand, MaxText): shardlib must be at or below it. Figures come from the CPU backend.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script too

import shardlib  # noqa: E402

MODEL = ("model.embed=512", "model.heads=8", "model.kv_heads=8", "model.head_dim=64",
         "model.mlp=2048", "model.layers=4", "model.vocab=8192", "seq=256", "batch=8")  # fmt: skip
MESH_FILES = {"fsdp": "cpu-8-fsdp.toml", "3d": "cpu-8-3d.toml", "tp": "cpu-8-tp.toml"}
# the best peer per mesh at fp32, remat=full: (memory B/device, collective B/step)
BEST_PEER = {"fsdp": (102_326_392, 236.0e6), "3d": (140_635_512, 205.6e6),
             "tp": (106_583_100, 142.6e6)}  # fmt: skip
ROWS = (("fp32", "full"), ("bf16", "full"), ("fp32", "none"), ("fp32", "dots"))


def figures(compiled) -> tuple[int, int]:
    """(memory bytes, collective result bytes per step) of one compiled step."""
    from shardlib.analysis import hlo

    mem = compiled.memory_analysis()
    memory = (mem.argument_size_in_bytes + mem.output_size_in_bytes
              + mem.temp_size_in_bytes - mem.alias_size_in_bytes)  # fmt: skip
    module = hlo.parse_module(compiled.as_text())
    multipliers, _ = hlo.call_multipliers(module)
    total = 0
    for c in hlo.collectives(module, multipliers):
        group = max((len(g) for g in c.groups), default=1)
        result = c.buffer_bytes // group if c.kind == "reduce-scatter" else c.buffer_bytes
        total += result * c.count
    return memory, total


def shardlib_program(mesh_name: str, precision: str, remat: str):
    """``(compiled, state, batch)`` of shardlib's step, as ``shardlib explain`` builds it."""
    import jax
    import numpy as np

    from shardlib.core.mesh import load_mesh
    from shardlib.core.values import flatten_table
    from shardlib.parallel.plan import ParallelPlan
    from shardlib.train.config import TrainConfig, override, parse_overrides
    from shardlib.train.setup import make_setup

    spec = load_mesh(ROOT / "meshes" / MESH_FILES[mesh_name])
    base = override(TrainConfig(parallel=ParallelPlan.from_mesh_spec(spec)),
                    flatten_table(spec.train))  # fmt: skip
    cfg = parse_overrides([*MODEL, f"precision={precision}", f"remat={remat}"], base)
    setup = make_setup(cfg, cfg.parallel.with_devices(8).build_mesh())
    compiled = setup.train_step.lower(setup.abstract_state(), setup.abstract_batch()).compile()
    tokens = np.random.default_rng(0).integers(0, 8192, (8, 257), dtype=np.int32)
    return compiled, (lambda: setup.init_state()), jax.device_put(tokens, setup.batch_sharding)


def baseline_program(mesh_name: str, precision: str, remat: str):
    import jax
    import numpy as np

    from benchmarks import plain_jax

    s = plain_jax.Shape()
    step, shardings, batch_sharding, tx = plain_jax.make_step(
        mesh_name, s=s, precision=precision, remat=remat
    )
    batch = jax.ShapeDtypeStruct((8, 257), jax.numpy.int32, sharding=batch_sharding)
    compiled = step.lower(plain_jax.abstract_state(s, tx, shardings), batch).compile()
    tokens = np.random.default_rng(0).integers(0, 8192, (8, 257), dtype=np.int32)
    state = lambda: plain_jax.init_state(s, tx, shardings)  # noqa: E731
    return compiled, state, jax.device_put(tokens, batch_sharding)


def paired_ratio(a, b, rounds: int = 3, steps: int = 1) -> float:
    """Median over ``rounds`` of (time of a) / (time of b), the order alternating."""
    import jax

    states = {id(a): a[1](), id(b): b[1]()}

    def run(prog) -> float:
        compiled, _, batch = prog
        state = states[id(prog)]
        start = time.perf_counter()
        for _ in range(steps):
            state, _ = compiled(state, batch)
        jax.block_until_ready(state)
        states[id(prog)] = state
        return (time.perf_counter() - start) / steps

    run(a), run(b)  # warm-up: first-run allocations and caches
    ratios = []
    for i in range(rounds):
        if i % 2 == 0:
            ta, tb = run(a), run(b)
        else:
            tb, ta = run(b), run(a)
        ratios.append(ta / tb)
    return statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fp32 remat=full rows only")
    parser.add_argument("--no-time", action="store_true", help="skip the paired step timing")
    parser.add_argument("--meshes", default="fsdp,3d,tp", help="comma-separated: fsdp,3d,tp")
    args = parser.parse_args()
    shardlib.simulate_cpu_devices(8)
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    rows = ROWS[:1] if args.quick else ROWS
    table = Table(title="shardlib vs plain JAX (per device, 8 simulated CPU devices)")
    for col in ("mesh", "precision", "remat", "shardlib memory B", "plain JAX memory B",
                "shardlib collective B", "plain JAX collective B", "step time ratio",
                "vs best peer"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("mesh", "precision", "remat") else "right")
    for mesh_name in args.meshes.split(","):
        for precision, remat in rows:
            ours = shardlib_program(mesh_name, precision, remat)
            base = baseline_program(mesh_name, precision, remat)
            (mem_a, coll_a), (mem_b, coll_b) = figures(ours[0]), figures(base[0])
            ratio = "-" if args.no_time else f"{paired_ratio(ours, base):.2f}x"
            verdict = ""
            if (precision, remat) == ROWS[0]:
                peer_mem, peer_coll = BEST_PEER[mesh_name]
                ok = mem_a <= peer_mem and coll_a <= peer_coll
                verdict = f"{'OK' if ok else 'MISS'} ({peer_mem:,} / {peer_coll / 1e6:.1f}M)"
            table.add_row(mesh_name, precision, remat, f"{mem_a:,}", f"{mem_b:,}",
                          f"{coll_a:,}", f"{coll_b:,}", ratio, verdict)  # fmt: skip
            console.print(f"{mesh_name} {precision} remat={remat}: measured")
    console.print(table)


if __name__ == "__main__":
    main()
