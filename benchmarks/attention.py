"""Sequence, context and tensor parallelism measured against the published formulas.

Everything is compiled from abstract inputs on simulated CPU devices and measured by
``explain`` (memory_analysis, collectives of the optimized HLO); nothing is trained. One
table, one row per figure: plan, measured, formula (REFERENCE.md), ratio.

    PYTHONPATH=$PWD python benchmarks/attention.py            # everything, ~2-5 min on CPU
    PYTHONPATH=$PWD python benchmarks/attention.py --quick    # smaller series

Sections:
1. Megatron-SP vs TP: wire bytes per layer, all-reduces left in the layer. CPU compiles
   reduce-scatter as all-reduce + dynamic-slice; "GPU form" counts those pairs as the
   reduce-scatter GPU/TPU pipelines fuse them into (shardlib/analysis/reduce_scatter.py).
2. Ulysses: all-to-all bytes per device per layer (forward) vs 4·s·h/N.
3. Ring attention: temp bytes of the train step at a fixed global s over N = 1, 2, 4, 8.
4. Chunked attention: temp bytes over s = 1k..16k on one device, next to dense.
5. 1D/2D/2.5D/3D tensor parallelism: parameter bytes, temp bytes and wire bytes per device,
   next to Colossal-AI's table.
"""

from __future__ import annotations

import argparse
import math

import shardlib

shardlib.simulate_cpu_devices(8)

import jax  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from shardlib import mesh_spec  # noqa: E402
from shardlib.analysis import explain  # noqa: E402
from shardlib.analysis.reduce_scatter import gpu_collectives  # noqa: E402
from shardlib.core.layout import use_layout  # noqa: E402
from shardlib.train.config import TrainConfig, override, train_config  # noqa: E402
from shardlib.train.setup import make_setup  # noqa: E402
from shardlib.train.step import make_loss_fn  # noqa: E402

MiB = 2**20


def _mesh(**axes):
    return mesh_spec(**axes).build(jax.devices()[: math.prod(axes.values())])


def _compiled(setup):
    return setup.train_step.lower(setup.abstract_state(), setup.abstract_batch()).compile()


def _layers(cfg: TrainConfig) -> int:
    return dict(cfg.model_overrides)["layers"]


def _per_layer(ops, layers: int) -> list:
    return [op for op in ops if op.count == layers]


def sequence_parallel_rows(rows: list) -> None:
    cfg = train_config(batch=8, seq=256, **{"model.layers": 2})
    mesh, t = _mesh(tensor=4), 4
    m = cfg.dataset.batch * cfg.dataset.seq * 64 * 4  # b·s·h fp32 bytes (llama-tiny, embed 64)
    formula = 8 * (t - 1) / t * m  # 4 all-reduces (2 fwd + 2 bwd) of M, or 4 AG + 4 RS
    for sp in (False, True):
        setup = make_setup(override(cfg, {"sequence_parallel": sp}), mesh)
        text = _compiled(setup).as_text()
        gpu = _per_layer(gpu_collectives(text, setup.mesh), _layers(cfg))
        cpu_wire = sum(
            op.buffer_bytes
            * (2 if op.kind in ("all-reduce", "reduce-scatter") else 1)
            * (t - 1)
            / t
            for op in gpu
        )
        gpu_wire = sum(op.wire_bytes for op in gpu)
        big_ar = sum(op.kind == "all-reduce" and op.buffer_bytes >= m for op in gpu)
        kinds = ", ".join(
            f"{sum(o.kind == k and o.buffer_bytes >= m for o in gpu)} {k}"
            for k in ("all-gather", "reduce-scatter", "all-reduce")
        )
        plan = f"{'TP+SP' if sp else 'TP'} t=4, llama-tiny b=8 s=256"
        rows.append(
            (
                "SP wire/layer (GPU form)",
                plan,
                f"{gpu_wire / MiB:.3f} MiB",
                f"{formula / MiB:.3f} MiB",
                gpu_wire / formula,
                f"{kinds} of b·s·h",
            )
        )
        rows.append(
            (
                "SP wire/layer (CPU as compiled)",
                plan,
                f"{cpu_wire / MiB:.3f} MiB",
                f"{formula / MiB:.3f} MiB",
                cpu_wire / formula,
                f"b·s·h all-reduces left (GPU form): {big_ar}",
            )
        )


def ulysses_rows(rows: list, sizes) -> None:
    for n in sizes:
        for kv in (16, 8):
            cfg = train_config(
                batch=8,
                seq=256,
                attention="all_to_all",
                **{"model.layers": 2, "model.kv_heads": kv},
            )
            setup = make_setup(cfg, _mesh(context=n))
            loss_fn = make_loss_fn(setup)

            def loss(params, tokens, setup=setup, loss_fn=loss_fn):
                with use_layout(setup.mesh, setup.rules):
                    return loss_fn(params, tokens)

            report = explain(
                loss, setup.abstract_state()["params"], setup.abstract_batch(), mesh=setup.mesh
            )
            got = sum(
                op.buffer_bytes
                for op in _per_layer(report.collectives, 2)
                if op.kind == "all-to-all"
            )
            formula = (
                4 * cfg.dataset.batch * cfg.dataset.seq * 128 / n * 4
            )  # 4·b·s·h/N fp32, h = 16 x 8
            note = "MHA (paper's setting)" if kv == 16 else "GQA: k, v are half of q: (2+2·8/16)/4"
            rows.append(
                (
                    "Ulysses a2a bytes/layer fwd",
                    f"context={n}, 16 heads, kv={kv}",
                    f"{got / MiB:.3f} MiB",
                    f"{formula / MiB:.3f} MiB",
                    got / formula,
                    note,
                )
            )


def ring_rows(rows: list, seq: int) -> None:
    base = train_config(batch=1, seq=seq, **{"model.layers": 1})
    dense = explain(*_explain_args(make_setup(base, _mesh(data=1))))
    for impl in ("dense", "chunked"):
        first = None
        for n in (1, 2, 4, 8):
            # chunked blocks of 128: the (s/N)² block term no longer hides the linear terms
            cfg = override(
                base, {"attention": "ring", "attention_impl": impl, "attention_chunk": 128}
            )
            temp = explain(*_explain_args(make_setup(cfg, _mesh(context=n)))).memory.temp_bytes
            first = first or temp
            rows.append(
                (
                    f"ring temp bytes, {impl} blocks" + (" of 128" if impl == "chunked" else ""),
                    f"context={n}, s={seq}, b=1, tiny 1 layer",
                    f"{temp / MiB:.1f} MiB",
                    f"1/N of N=1: {first / n / MiB:.1f} MiB",
                    temp / (first / n),
                    f"dense attention, 1 device: {dense.memory.temp_bytes / MiB:.1f} MiB",
                )
            )


def _explain_args(setup):
    return (setup.train_step, setup.abstract_state(), setup.abstract_batch())


def chunked_rows(rows: list, seqs) -> None:
    first = None
    for seq in seqs:
        cfg = train_config(batch=1, seq=seq, **{"model.layers": 1})
        temps = {}
        for impl in ("dense", "chunked"):
            setup = make_setup(override(cfg, {"attention_impl": impl}), _mesh(data=1))
            temps[impl] = explain(*_explain_args(setup)).memory.temp_bytes
        first = first or (seq, temps["chunked"])
        linear = first[1] * seq / first[0]
        rows.append(
            (
                "chunked temp bytes (train step)",
                f"1 device, s={seq}, chunk 512",
                f"{temps['chunked'] / MiB:.1f} MiB",
                f"linear from s={first[0]}: {linear / MiB:.1f} MiB",
                temps["chunked"] / linear,
                f"dense: {temps['dense'] / MiB:.1f} MiB",
            )
        )


# Colossal-AI's table (REFERENCE.md): parameter and activation memory fractions per device
# and their bandwidth coefficient.
def _colossal(mode: str, p: int, depth: int = 1) -> tuple[float, float, float]:
    if mode == "1D":
        return 1 / p, 1.0, 2 * (p - 1) / p
    if mode == "2.5D":  # Tesseract: P = d·q²
        q, d = round((p / depth) ** 0.5), depth
        return 1 / q**2, 1 / (d * q**2), 3 * (q - 1) * (d + 1) / (d * q)
    q = round(p ** (1 / 2 if mode == "2D" else 1 / 3))
    if mode == "2D":
        return 1 / q**2, 1 / q**2, 6 * (q - 1) / q
    return 1 / q**3, 1 / q**3, 6 * (q - 1) / q**3


def tensor_mode_rows(rows: list) -> None:
    cfg = train_config(
        batch=16, seq=256, model="llama-small", **{"model.layers": 2, "model.kv_heads": 8}
    )
    m = cfg.dataset.batch * cfg.dataset.seq * 256 * 4  # b·s·h bytes
    one = explain(*_explain_args(make_setup(cfg, _mesh(data=1))))
    plans = [
        ("1D", {"tensor": 4}),
        ("2D", {"tensor": 2, "tensor2": 2}),
        ("1D", {"tensor": 8}),
        ("3D", {"tensor": 2, "tensor2": 2, "tensor3": 2}),
        ("2.5D", {"tensor_depth": 2, "tensor2": 2, "tensor": 2}),
    ]
    for mode, axes in plans:
        setup = make_setup(cfg, _mesh(**axes))
        report = explain(*_explain_args(setup))
        text = _compiled(setup).as_text()
        gpu = gpu_collectives(text, setup.mesh)
        p = math.prod(axes.values())
        param_frac, act_frac, bw = _colossal(mode, p, axes.get("tensor_depth", 1))
        shape = " x ".join(f"{a}={s}" for a, s in axes.items())
        params = _param_bytes(report)
        rows.append(
            (
                f"{mode} TP params/device",
                shape,
                f"{params / MiB:.2f} MiB",
                f"Colossal {param_frac:.3f} x {one.params_bytes / MiB:.2f} MiB",
                params / (param_frac * one.params_bytes),
                "measured: shard shapes",
            )
        )
        temp = report.memory.temp_bytes
        rows.append(
            (
                f"{mode} TP temp/device",
                shape,
                f"{temp / MiB:.2f} MiB",
                f"Colossal act. {act_frac:.3f} x {one.memory.temp_bytes / MiB:.2f} MiB",
                temp / (act_frac * one.memory.temp_bytes),
                "temp = activations + grads + workspace",
            )
        )
        layer = sum(op.wire_bytes for op in _per_layer(gpu, _layers(cfg)))
        step = sum(op.wire_bytes * op.count for op in gpu)
        rows.append(
            (
                f"{mode} TP wire/layer (GPU form)",
                shape,
                f"{layer / m:.2f} x b·s·h",
                f"Colossal bandwidth {bw:.2f}",
                float("nan"),
                f"whole step {step / MiB:.1f} MiB; units differ, see docstring",
            )
        )


def _param_bytes(report) -> float:
    return sum(t.bytes_per_device for t in report.tensors if t.is_param)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sequences")
    args = parser.parse_args()
    rows: list = []
    sequence_parallel_rows(rows)
    ulysses_rows(rows, (2, 4, 8))
    ring_rows(rows, 1024 if args.quick else 4096)
    chunked_rows(rows, (1024, 2048, 4096) if args.quick else (1024, 2048, 4096, 8192, 16384))
    tensor_mode_rows(rows)
    table = Table(title=f"sequence, context and tensor parallelism (CPU, jax {jax.__version__})")
    for col in ("figure", "plan", "measured", "formula / reference", "ratio", "note"):
        table.add_column(col, justify="right" if col in ("measured", "ratio") else "left")
    for figure, plan, measured, formula, ratio, note in rows:
        ratio_text = "-" if ratio != ratio else f"{ratio:.3f}"
        table.add_row(figure, plan, measured, formula, ratio_text, note)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
