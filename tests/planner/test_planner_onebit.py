"""The planner's 1-bit momentum term (``planner/cost/terms/onebit.py``) against the compiled
steps of ``optimizer=onebit_adam`` and ``onebit_lamb`` on data=8 (compile only).

After the warm-up every byte that crosses ``data`` is the compressed all-reduce: the
all-to-all and all-gather of packed signs (uint8) and fp32 scales, plus the step's few scalar
means (loss, gradient norm). 1-bit Adam compiles with ``freeze_step=0`` (only the compressed
path); 1-bit LAMB needs a warm-up step, so its program also holds the warm-up's fp32
all-reduce (a ``cond`` branch), left out of the comparison.

Measured (jax 0.10.2, CPU, llama-tiny narrowed to 32 wide, 1 layer; Ψ = 25,696, P = 25,728,
N = 8), bytes per device and step:

| optimizer | predicted compressed | compiled: u8 all-to-all + all-gather, f32 scales | ratio |
| --- | --- | --- | --- |
| onebit_adam | 5684 | 2814 + 2814 + 28 + 28 = 5684 | 1.000 |
| onebit_lamb | 5684 | 5684 (+ the warm-up branch's fp32 all-reduce, 179886) | 1.000 |

(the LAMB row: ``pytest tests/planner/test_planner_onebit.py`` with the parameter list
extended to ``onebit_lamb``; the test runs the Adam row.)

1-bit Adam's only other collective is 14 B of scalar means. Against Tang et al.'s
2(N-1)/N · Ψ/8: 1.011 (the padding and the 2N scales); the fp32 all-reduce the plan books
without 1-bit momentum is 31.6x the bytes.
"""

from functools import cache

import jax
import pytest

import shardlib
from benchmarks.comm_compression import collective_bytes
from shardlib.core.mesh import MeshSpec
from shardlib.core.workload import Workload
from shardlib.parallel.data import DataParallel
from shardlib.parallel.plan import ParallelPlan
from shardlib.planner.cost.total import estimate
from shardlib.train.config import train_config
from shardlib.train.setup import make_setup

SMALL = {"layers": 1, "embed": 32, "heads": 4, "kv_heads": 2, "head_dim": 8, "mlp": 64}
N = 8


@cache
def _compiled(optimizer: str):
    mesh = shardlib.mesh_spec(data=N).build(jax.devices()[:N])
    model = {f"model.{k}": v for k, v in SMALL.items()}
    freeze = 0 if optimizer == "onebit_adam" else 1  # LAMB's frozen ratios need a warm-up
    cfg = train_config(optimizer=optimizer, freeze_step=freeze, batch=16, seq=16, steps=3, **model)
    setup = make_setup(cfg, mesh)
    compiled = setup.train_step.lower(setup.abstract_state(), setup.abstract_batch()).compile()
    return setup, collective_bytes(compiled.as_text(), mesh)


@pytest.mark.slow  # a compile of the shard_map step (about 6 s on 2 shared cores)
@pytest.mark.parametrize("optimizer", ["onebit_adam"])
def test_compressed_bytes_match_the_compiled_step(optimizer):
    """1-bit LAMB's compressed collectives are 1-bit Adam's (measured, table above; and
    ``tests/train/test_onebit_lamb.py`` holds them to the same formula), so one compile
    stands for both (adding ``onebit_lamb`` to the parameters runs it too: 11 s)."""
    setup, found = _compiled(optimizer)
    workload = Workload.from_preset("llama-tiny", 16, 16, "fp32", **SMALL)
    assert workload.param_count == sum(x.size for x in jax.tree.leaves(setup.param_shapes))
    est = estimate(workload, setup.plan, backend="cpu")
    predicted = sum(c.wire_bytes for c in est.comms if c.strategy == "onebit")
    assert not [c for c in est.comms if c.strategy == "dp"]  # no fp32 gradient reduction
    compressed = sum(v["wire_bytes"] for (k, _), v in found.items() if k != "all-reduce")
    assert abs(predicted / compressed - 1) <= 0.05, (predicted, compressed, found)
    if optimizer == "onebit_adam":  # no warm-up branch: only the loss and norms' means
        scalars = sum(v["wire_bytes"] for (k, _), v in found.items() if k == "all-reduce")
        assert scalars < 0.01 * compressed
    ring = 2 * (N - 1) / N
    assert abs(predicted / (ring * workload.param_count / 8) - 1) <= 0.05  # Tang et al.


def test_one_bit_momentum_is_a_32nd_of_the_fp32_all_reduce():
    """The same plan without 1-bit momentum books dp's fp32 all-reduce: 32x the bytes,
    within the padding and the scales."""
    workload = Workload.from_preset("llama-tiny", 16, 16, "fp32", **SMALL)
    mesh = MeshSpec((("data", N),))
    plan = ParallelPlan(mesh=mesh, data=DataParallel(onebit_momentum=True))
    onebit = estimate(workload, plan, backend="cpu")
    fp32 = estimate(workload, ParallelPlan(mesh=mesh), backend="cpu")
    assert fp32.wire_bytes / onebit.wire_bytes == pytest.approx(32, rel=0.02)
    errors = onebit.memory["optimizer"] - fp32.memory["optimizer"]
    assert errors == pytest.approx(workload.param_count * 4 * (1 + 1 / N), rel=0.01)
