"""Sublinear-memory checkpointing (Chen et al. 2016): activation memory against L, compiled.

Run:  python benchmarks/sublinear_remat.py [--layers 16 32 64]

The layer stack alone (``benchmarks._programs.layer_stack_program``: the plan's layer loop,
forward and backward, no head), llama-tiny's block at a long micro-batch (batch 8, seq 512,
fp32), compiled from abstract shapes on one CPU device; nothing runs. For each remat policy
and L: the temp bytes of ``memory_analysis()`` (the stack's saved activations plus one
layer's working set; weights and their gradients are arguments and results, not temp), the
FLOPs counted from the optimized HLO with loop trips applied (REFERENCE.md), and the
planner's activation bytes for the same plan (``estimate``'s ``activations``).

With ``--validate``: the planner's memory and wire bytes against the compiled train step
(``planner.validate``, 8 simulated CPU devices) on plans no coefficient was fitted to
(GPipe and circular ones included: the segments are a stage's layers per loop trip).

With ``--scale``: the 39B-class layout of ``pipeline_scale.py`` (hidden 8192, 64 heads, 48
layers, seq 2048, GPipe over stage 2 x data 32 x tensor 8 = 512 simulated devices, m = 2,
fp32) compiled from abstract shapes under full, sqrt and sqrt+full (``planner.validate``):
memory, wire bytes and FLOPs per device, compiled and the planner's.

Printed fit: log-log slope of temp bytes in L (1 for per-layer policies, 1/2 for sqrt), and
Chen et al.'s k·x + (L/k)·r with x (a segment input) and r (one layer's residuals under the
inner policy) fitted by least squares, its worst relative residual.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too

import argparse  # noqa: E402

from shardlib import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(512)
import math  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks._programs import layer_stack_program  # noqa: E402
from shardlib.analysis import hlo, hlo_flops  # noqa: E402
from shardlib.core.mesh import single_device_mesh  # noqa: E402
from shardlib.parallel.remat import parse_remat  # noqa: E402
from shardlib.parallel.segments import segment_count  # noqa: E402
from shardlib.train.config import train_config  # noqa: E402
from shardlib.train.setup import make_setup  # noqa: E402

POLICIES = ("none", "full", "sqrt", "sqrt+full")
SHAPE = {"batch": 32, "seq": 128, "precision": "fp32"}


def compiled(policy: str, layers: int, *, forward_only: bool = False):
    cfg = train_config(**{"model.layers": layers, "remat": policy}, **SHAPE)
    setup = make_setup(cfg, single_device_mesh())
    jitted, args = layer_stack_program(setup, forward_only=forward_only)
    return jitted.lower(*args).compile()


def flops_of(exe) -> float:
    module = hlo.parse_module(exe.as_text())
    return hlo_flops.count_flops(module, hlo.call_multipliers(module)[0])


def measure(policy: str, layers: int) -> tuple[int, float]:
    """(temp bytes, FLOPs with loop trips) of the stack's gradient program."""
    exe = compiled(policy, layers)
    return exe.memory_analysis().temp_size_in_bytes, flops_of(exe)


def slope(layers, values) -> float:
    """Least-squares slope of log(values) in log(L)."""
    return float(np.polyfit(np.log(layers), np.log(values), 1)[0])


def chen_fit(policy: str, layers, temps) -> tuple[float, float, float, float]:
    """(c, x, r, worst relative residual) of temp = c + k·x + (L/k)·r over the measured L
    (c: what does not grow with L, one layer's working set)."""
    segments = parse_remat(policy).segments
    ks = [segment_count(segments, n) for n in layers]
    a = np.array([[1, k, n / k] for k, n in zip(ks, layers, strict=True)], dtype=float)
    coef, *_ = np.linalg.lstsq(a, np.array(temps, dtype=float), rcond=None)
    worst = float(np.max(np.abs(a @ coef - temps) / temps))
    return (*map(float, coef), worst)


HELD_OUT = (  # (model, global batch, seq, layers, plan kwargs)
    ("llama-tiny", 16, 128, 16, dict(data=2, fsdp=2, tensor=2, remat="sqrt")),
    ("llama-tiny", 16, 128, 16, dict(data=8, remat="segments:2")),
    ("llama-small", 16, 256, 8, dict(fsdp=8, remat="sqrt")),
    ("llama-small", 16, 256, 8, dict(data=4, tensor=2, remat="segments:4+selective")),
    ("llama-small", 16, 256, 9, dict(data=2, fsdp=4, remat="sqrt+full")),
    ("llama-tiny", 16, 128, 16, dict(data=2, fsdp=2, tensor=2, remat="sqrt+full")),
    ("llama-tiny", 16, 128, 16, dict(stage=2, data=2, tensor=2, microbatches=4, remat="sqrt")),
    ("llama-tiny", 16, 128, 16, dict(stage=2, data=2, tensor=2, microbatches=4, remat="sqrt+full")),
    (
        "llama-tiny",
        16,
        128,
        16,
        dict(
            stage=2, data=2, tensor=2, microbatches=4, schedule="circular", virtual=2, remat="sqrt"
        ),
    ),
    (
        "llama-tiny",
        16,
        128,
        16,
        dict(
            stage=2,
            data=2,
            tensor=2,
            microbatches=4,
            schedule="circular",
            virtual=2,
            remat="sqrt+full",
        ),
    ),
)


def validate_held_out() -> None:
    from shardlib.planner import Workload, candidate
    from shardlib.planner.validate import validate

    print("planner against the compiled step (8 simulated CPU devices, fp32)")
    for model, batch, seq, layers, kwargs in HELD_OUT:
        w = Workload.from_preset(model, batch, seq, "fp32", layers=layers)
        c = validate(w, candidate(**kwargs))
        print(f"{model} b{batch} s{seq} L{layers} {kwargs}: memory {c.predicted_memory / 1e6:.1f}"
              f" / {c.compiled_memory / 1e6:.1f} MB = {c.memory_ratio:.3f}, wire "
              f"{c.wire_ratio:.3f}")  # fmt: skip


def at_scale() -> None:
    from benchmarks.pipeline_scale import LAYOUTS, SEQ, VOCAB
    from shardlib.planner import Workload, candidate
    from shardlib.planner.validate import validate

    model, axes, per_replica = LAYOUTS["39b"]
    batch, m = per_replica * axes["data"], axes["stage"]
    w = Workload.from_preset("llama-70b", batch, SEQ, "fp32", **model, vocab=VOCAB)
    print(f"39B-class, {axes}, GPipe m={m}, seq {SEQ}, fp32, per device")
    for policy in ("full", "sqrt", "sqrt+full"):
        c = validate(w, candidate(**axes, microbatches=m, remat=policy))
        print(f"{policy:>10}: compiled {c.compiled_memory / 1e9:.2f} GB, planner "
              f"{c.predicted_memory / 1e9:.2f} GB ({c.memory_ratio:.3f}); wire "
              f"{c.wire_ratio:.3f}; FLOPs {c.compiled_flops / 1e15:.3f} PFLOP compiled, "
              f"{c.predicted_flops / 1e15:.3f} planner")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 32, 64])
    parser.add_argument("--validate", action="store_true", help="planner vs compiled only")
    parser.add_argument("--scale", action="store_true", help="the 39B layout only")
    args = parser.parse_args()
    if args.scale:
        at_scale()
        return 0
    if args.validate:
        validate_held_out()
        return 0
    layers = args.layers
    results = {}
    print(f"layer stack, llama-tiny block, {SHAPE}, one CPU device (temp bytes, MB)")
    print(f"{'policy':>10} " + " ".join(f"{'L=' + str(n):>10}" for n in layers)
          + f" {'slope':>7} {'FLOPs/none':>11}")  # fmt: skip
    for policy in POLICIES:
        rows = [measure(policy, n) for n in layers]
        results[policy] = rows
        temps = [t for t, _ in rows]
        ratio = rows[-1][1] / results["none"][-1][1]
        print(f"{policy:>10} " + " ".join(f"{t / 1e6:>10.2f}" for t in temps)
              + f" {slope(layers, temps):>7.3f} {ratio:>11.3f}")  # fmt: skip
    for policy in ("sqrt", "sqrt+full"):
        temps = [t for t, _ in results[policy]]
        c, x, r, worst = chen_fit(policy, layers, temps)
        ks = [segment_count(parse_remat(policy).segments, n) for n in layers]
        kept = [t - c for t in temps]
        print(f"{policy}: k = {ks}; fit temp = {c / 1e6:.2f} MB + k·{x / 1e6:.3f} MB + "
              f"(L/k)·{r / 1e6:.3f} MB, worst residual {worst:.1%}; kept (temp - c) at "
              f"L={layers[-1]} / L={layers[1]}: {kept[-1] / kept[1]:.3f} "
              f"(sqrt {math.sqrt(layers[-1] / layers[1]):.3f}, linear "
              f"{layers[-1] / layers[1]:.1f}), log-log slope "
              f"{slope(layers[1:], kept[1:]):.3f}")  # fmt: skip
    forward = flops_of(compiled("none", layers[-1], forward_only=True))
    base = results["none"][-1][1]
    for policy in POLICIES[1:]:
        extra = (results[policy][-1][1] - base) / forward
        print(f"{policy}: extra FLOPs over none at L={layers[-1]} = {extra:.3f} forward passes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
