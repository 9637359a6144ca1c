"""1-bit Adam and ZeRO++: wire bytes per device per step against the papers, and loss curves.

    python benchmarks/comm_compression.py            # bytes (compile only) + 120-step curves
    python benchmarks/comm_compression.py --steps 0  # bytes only

Bytes: each program is compiled on 8 simulated CPU devices from abstract shapes (nothing
runs) and its optimized HLO's collectives are summed by kind, dtype and mesh axis
(``shardlib.analysis``'s parser; ring wire bytes of REFERENCE.md). Formulas:

* 1-bit Adam after warm-up: an all-to-all and an all-gather of Ψ/8 bytes of signs,
  2(N-1)/N · Ψ/8, against the fp32 gradient all-reduce's 2(N-1)/N · 4Ψ: 1/32 (+ scales).
* ZeRO++ (Wang et al. 2023), each part against ZeRO-3's collective it replaces. CPU runs
  bf16 collectives in fp32, so the baseline is measured in fp32 and the paper's fp16
  figure is half of it: qwZ's int8 gather ~ 1/2 of fp16 (1/4 of fp32), qgZ's int4
  all-to-all ~ 1/4 of the fp16 reduce-scatter, hpZ's cross-node backward gather -> 0; all
  three: cross-node bytes 3Ψ (fp16) -> 0.75Ψ. On data=2 x fsdp=4 ("2 nodes of 4") every
  gather runs in two hops (across, then inside nodes), so the cross-node share is the
  ``data`` axis's bytes: (D-1)/N · Ψ elements per hop.

Curves: the default data (the embedded stdlib corpus), llama-tiny, 8 simulated devices,
the same steps and schedule for AdamW, 1-bit Adam (warm-up 20% of the steps) and ZeRO++
(all three parts, data=2 x fsdp=4); the plot goes to ``benchmarks/comm_compression.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too

import shardlib

PNG = Path(__file__).with_name("comm_compression.png")


def collective_bytes(hlo_text: str, mesh) -> dict[tuple[str, str], dict]:
    """{(kind, dtype): {"buffer_bytes", "wire_bytes", "by_axis", "count"}} per device and
    step; ``by_axis`` splits the wire bytes by the mesh axes spanned ("data", "data,fsdp").

    A tuple-shaped collective (XLA combines several into one) is split by its arrays'
    dtypes; loop bodies count once per trip (``hlo.call_multipliers``).
    """
    from shardlib.analysis import hlo
    from shardlib.analysis.collective import collective_op
    from shardlib.analysis.report import axes_key, ring_wire_bytes

    module = hlo.parse_module(hlo_text)
    multipliers, _ = hlo.call_multipliers(module)
    insts = {i.name: i for c in module.computations.values() for i in c.instructions}
    shape, names = tuple(mesh.devices.shape), tuple(mesh.axis_names)
    out: dict[tuple[str, str], dict] = {}
    for raw in hlo.collectives(module, multipliers):
        op = collective_op(raw, shape, names)
        arrays = insts[raw.name].arrays
        if insts[raw.name].opcode.endswith("-start"):  # (operands, results): the results
            arrays = arrays[len(arrays) // 2 :]
        total = sum(a.bytes for a in arrays) or 1
        for a in arrays:
            m = raw.buffer_bytes * a.bytes / total
            t = out.setdefault((raw.kind, a.dtype), {"buffer_bytes": 0, "wire_bytes": 0.0,
                                                     "by_axis": {}, "count": 0})  # fmt: skip
            wire = ring_wire_bytes(raw.kind, m, op.group_size) * raw.count
            t["buffer_bytes"] += m * raw.count
            t["wire_bytes"] += wire
            axes = axes_key(op.axes)
            t["by_axis"][axes] = t["by_axis"].get(axes, 0.0) + wire
            t["count"] += raw.count
    return out


def _grad_program(setup):
    """ZeRO++'s gradient program (the update adds no collectives under ZeRO-3), compiled
    from abstract shapes."""
    import jax

    from shardlib.parallel import zeropp
    from shardlib.train.step import make_loss_fn

    loss_fn = make_loss_fn(setup, with_metrics=True)
    fn = jax.jit(zeropp.value_and_grad(setup.plan, loss_fn, setup.step_layout))
    params = setup.abstract_state()["params"]
    return fn.lower(params, setup.abstract_batch()).compile().as_text()


def _step_program(setup):
    return setup.train_step.lower(setup.abstract_state(), setup.abstract_batch()).compile()


def wire_rows(model: str, console) -> list[tuple]:
    """(name, measured wire bytes, formula bytes, what) per compressed collective."""
    import jax

    from shardlib.train.config import train_config
    from shardlib.train.onebit import padded_size
    from shardlib.train.setup import make_setup

    n = 8
    base = dict(model=model, batch=16, seq=64, optimizer="adam")
    flat, nodes = shardlib.mesh_spec(data=n).build(), shardlib.mesh_spec(data=2, fsdp=4).build()
    rows = []

    def total(found, kind=None, axis=None, dtypes=None):
        return sum(
            (v["wire_bytes"] if axis is None else v["by_axis"].get(axis, 0.0))
            for (k, d), v in found.items()
            if (kind is None or k == kind) and (dtypes is None or d in dtypes)
        )

    with console.status("compiling AdamW and 1-bit Adam (after warm-up) on data=8") as status:
        adam = make_setup(train_config(**base), flat)
        psi = sum(x.size for x in jax.tree.leaves(adam.param_shapes))
        dense = collective_bytes(_step_program(adam).as_text(), flat)
        onebit = make_setup(train_config(**{**base, "optimizer": "onebit_adam"}, freeze_step=0),
                            flat)  # fmt: skip
        packed = collective_bytes(_step_program(onebit).as_text(), flat)
        ring = 2 * (n - 1) / n
        p = padded_size(onebit.param_shapes, n)
        rows.append(("AdamW gradient all-reduce (fp32)", total(dense), ring * 4 * psi,
                     "2(N-1)/N · 4Ψ"))  # fmt: skip
        rows.append(("1-bit Adam after warm-up: all bytes", total(packed), ring * (p / 8 + 4 * n),
                     "2(N-1)/N · (Ψ/8 + 4N): 1/32 of the above + scales"))  # fmt: skip
        status.update("compiling ZeRO-3 exact, qwZ, qgZ on data=8 (gradient programs)")
        z3 = dict(base, zero=3)
        setups = {
            "exact": make_setup(train_config(**z3), flat),  # zeropp with every part off
            "qwz": make_setup(train_config(**z3, quantized_weights=True), flat),
            "qgz": make_setup(train_config(**z3, quantized_gradients=True), flat),
        }
        found = {k: collective_bytes(_grad_program(s), flat) for k, s in setups.items()}
        one = (n - 1) / n
        gather_fp16 = total(found["exact"], "all-gather") / 2  # fp32 -> fp16 bytes
        rs_fp16 = total(found["exact"], "reduce-scatter") / 2
        rows.append(("ZeRO-3 weight all-gathers, fwd + bwd (fp16 form)", gather_fp16,
                     2 * one * 2 * psi, "2 · (N-1)/N · 2Ψ"))  # fmt: skip
        rows.append(("qwZ: int8 all-gathers + scales", total(found["qwz"], "all-gather"),
                     2 * one * psi * (1 + 4 / 256), "1/2 of fp16 (+ 4 B per 256)"))  # fmt: skip
        rows.append(("ZeRO-3 gradient reduce-scatter (fp16 form)", rs_fp16, one * 2 * psi,
                     "(N-1)/N · 2Ψ"))  # fmt: skip
        rows.append(("qgZ: int4 all-to-all + scales", total(found["qgz"], "all-to-all"),
                     one * psi * (0.5 + 4 / 256), "1/4 of fp16 (+ 4 B per 256)"))  # fmt: skip
        status.update("compiling ZeRO-3, hpZ and all of ZeRO++ on data=2 x fsdp=4")
        two = {
            "exact": make_setup(train_config(**z3), nodes),
            "hpz": make_setup(train_config(**z3, hpz=True), nodes),
            "all": make_setup(
                train_config(**z3, hpz=True, quantized_weights=True, quantized_gradients=True),
                nodes,
            ),  # fmt: skip
        }
        axes = {k: collective_bytes(_grad_program(s), nodes) for k, s in two.items()}
        cross = total(axes["exact"], axis="data") / 2  # fp16 form of ZeRO-3's cross-node
        hop = (2 - 1) / n * 2 * psi  # one data hop: (D-1)/N · Ψ elements of 2 bytes, D = 2
        rows.append(("ZeRO-3 cross-node (data axis), 3 hops (fp16 form)", cross, 3 * hop,
                     "3 · (D-1)/N · 2Ψ (fwd gather, bwd gather, grad)"))  # fmt: skip
        bwd = total(axes["hpz"], "all-gather", axis="data") - total(
            axes["exact"], "all-gather", axis="data") / 2  # fmt: skip
        rows.append(("hpZ: cross-node backward all-gather", bwd, 0.0,
                     "-> 0 (the forward one stays)"))  # fmt: skip
        rows.append(("qwZ + hpZ + qgZ: cross-node total", total(axes["all"], axis="data"),
                     0.75 * hop, "(1/2 + 0 + 1/4) of 3 hops (paper: 3Ψ -> 0.75Ψ)"))  # fmt: skip
    return rows, psi


def train_curves(runs: dict[str, tuple[dict, object]], steps: int, console):
    """{name: loss per step} of each ``(settings, mesh spec)`` run on the default data, the
    same steps and schedule for all (``benchmarks/onebit_lamb.py`` uses it too)."""
    from shardlib.train.config import train_config
    from shardlib.train.loop import run
    from shardlib.train.setup import make_setup

    out = {}
    for name, (settings, spec) in runs.items():
        console.print(f"[bold]{name}[/]: {steps} steps")
        setup = make_setup(train_config(steps=steps, **settings), spec.build())
        out[name] = run(setup, console=console).losses
    return out


def plot_curves(losses: dict[str, list[float]], png: Path, console, marks=()) -> None:
    """The curves in one picture (``marks``: (step, label) vertical lines), then each run's
    last loss and the gap of its last-10 mean to the first run's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ys in losses.items():
        ax.plot(range(1, len(ys) + 1), ys, label=name, lw=1.2)
    for step, label in marks:
        ax.axvline(step, color="grey", ls=":", lw=1, label=label)
    ax.set(xlabel="step", ylabel="loss", title="llama-tiny, embedded stdlib corpus, 8 CPU devices")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    first, ref = next(iter(losses.items()))
    tail = lambda ys: sum(ys[-10:]) / len(ys[-10:])  # noqa: E731
    for name, ys in losses.items():
        gap = tail(ys) - tail(ref)
        gaps = f"gap to {first} {gap:+.4f} ({gap / tail(ref):+.2%})"
        console.print(f"{name}: loss at step {len(ys)} {ys[-1]:.4f}, mean of last 10 "
                      f"{tail(ys):.4f}, {gaps}")  # fmt: skip
    console.print(f"wrote {png}")


def curves(steps: int, console) -> dict[str, list[float]]:
    """Loss per step of AdamW, 1-bit Adam and ZeRO++ on the default data, 8 devices."""
    return train_curves({
        "AdamW (data=8)": (dict(), shardlib.mesh_spec(data=8)),
        "1-bit Adam (data=8, freeze 20%)": (
            dict(optimizer="onebit_adam", freeze_step=steps // 5), shardlib.mesh_spec(data=8)),
        "ZeRO++ qwZ+hpZ+qgZ (data=2 x fsdp=4)": (
            dict(zero=3, hpz=True, quantized_weights=True, quantized_gradients=True),
            shardlib.mesh_spec(data=2, fsdp=4)),
    }, steps, console)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120, help="curve length (0: bytes only)")
    parser.add_argument("--model", default="llama-tiny", help="model for the byte counts")
    args = parser.parse_args()
    shardlib.simulate_cpu_devices(8)
    from rich.console import Console
    from rich.table import Table

    from shardlib.analysis.report import format_bytes

    console = Console()
    rows, psi = wire_rows(args.model, console)
    title = f"wire bytes per device per step, {args.model} (Ψ = {psi:,}), 8 CPU devices"
    table = Table(title=title)
    for col in ("collective", "measured", "formula", "ratio", "formula says"):
        left = col in ("collective", "formula says")
        table.add_column(col, justify="left" if left else "right")
    for name, got, want, what in rows:
        ratio = f"{got / want:.3f}" if want else "-"
        table.add_row(name, format_bytes(got), format_bytes(want), ratio, what)
    console.print(table)
    console.print(
        f"1-bit Adam / AdamW all-reduce: {rows[1][1] / rows[0][1]:.4f} (1/32 = {1 / 32:.4f}); "
        f"qwZ / fp16 gather: {rows[3][1] / rows[2][1]:.3f}; qgZ / fp16 reduce-scatter: "
        f"{rows[5][1] / rows[4][1]:.3f}; ZeRO++ / ZeRO-3 cross-node: "
        f"{rows[8][1] / rows[6][1]:.3f} (paper 0.25).\n"
        "CPU runs bf16 collectives in fp32, so ZeRO-3 is measured in fp32 and halved (fp16 "
        "form); the compressed collectives carry int8/uint8 as on GPU. Each ZeRO++ figure "
        "comes from the gradient program (forward gathers, backward re-gathers, gradient "
        "reduction); the optimizer update of ZeRO-3 has no collectives."
    )
    if args.steps <= 0:
        return
    plot_curves(curves(args.steps, console), PNG, console)


if __name__ == "__main__":
    main()
