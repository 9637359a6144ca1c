"""LoRA against full fine-tuning: optimizer state, step memory and FLOPs per device.

    python benchmarks/lora.py    # llama-small (~12M params), fp32 Adam, cpu-8-3d (2x2x2)

Compiles (never runs) the train step from abstract shapes with and without adapters
(rank 8 on q, k, v, o, gate, up, down) and prints, per device: the optimizer state's bytes
(``abstract_state``, sharded), the compiled step's memory (``memory_analysis``) and FLOPs
(``cost_analysis``, loops counted per trip). Expected: the optimizer state shrinks to the
adapters' 2 x 4 bytes per adapter parameter; the step's FLOPs lose the base weights'
gradient products, about a third of a full step's (forward 1, activation gradients 1,
weight gradients 1).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too

import shardlib


def _shard_bytes(x) -> int:
    import math

    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


def main() -> None:
    shardlib.simulate_cpu_devices(8)
    import jax
    from rich.console import Console
    from rich.table import Table

    from shardlib.train.config import override, train_config
    from shardlib.train.metrics import compiled_flops
    from shardlib.train.setup import make_setup

    cfg = train_config(model="llama-small", batch=16, seq=128, optimizer="adam")
    mesh = shardlib.mesh_spec(data=2, fsdp=2, tensor=2).build()
    table = Table(title="llama-small on data x fsdp x tensor = 2x2x2, per device, fp32 Adam")
    for col in ("run", "params", "trainable", "opt state", "step temp", "step GFLOPs"):
        table.add_column(col, justify="right")
    rows = {}
    for name, settings in (
        ("full", {}),
        ("LoRA r=8", {"lora.rank": 8, "lora.targets": "q,k,v,o,gate,up,down"}),
    ):
        setup = make_setup(override(cfg, settings), mesh)
        state = setup.abstract_state()
        compiled = setup.train_step.lower(state, setup.abstract_batch()).compile()
        params = jax.tree_util.tree_leaves_with_path(state["params"])
        total = sum(x.size for _, x in params)
        trainable = total if name == "full" else sum(
            x.size for p, x in params if "lora_" in jax.tree_util.keystr(p)
        )  # fmt: skip
        opt = sum(_shard_bytes(x) for x in jax.tree.leaves(state["opt_state"]))
        temp = compiled.memory_analysis().temp_size_in_bytes
        flops = compiled_flops(compiled)
        rows[name] = (opt, flops)
        table.add_row(
            name, f"{total:,}", f"{trainable:,}", f"{opt / 2**20:.2f} MiB",
            f"{temp / 2**20:.2f} MiB", f"{flops / 1e9:.3f}",
        )  # fmt: skip
    Console().print(table)
    (opt_full, f_full), (opt_lora, f_lora) = rows.values()
    print(f"optimizer state: LoRA / full = {opt_lora / opt_full:.4f}")
    print(f"step FLOPs:      LoRA / full = {f_lora / f_full:.3f} (2/3 + attention, adapters)")


if __name__ == "__main__":
    main()
