"""Compile a plan on simulated devices and compare the cost model with the executable.

The train step is lowered from abstract shapes (``TrainSetup.abstract_state()``), so even a
70B model on hundreds of simulated CPU devices costs seconds and no memory. The prediction
it is compared with uses ``backend="cpu"``: the CPU backend reduces FSDP gradients with an
all-reduce, not a reduce-scatter (REFERENCE.md). Compile in fp32: the CPU backend upcasts
bf16 matmuls, so its bf16 memory is not what a GPU would use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardlib.core.errors import ShardingError
from shardlib.core.workload import Workload
from shardlib.parallel.plan import ParallelPlan
from shardlib.planner.candidate import PlanView
from shardlib.planner.cost.total import estimate

if TYPE_CHECKING:  # analysis (and jax) load when a plan is compiled, not with the planner
    from shardlib.analysis.peak import Peak

MAX_SIMULATED = 2048
"""Most simulated CPU devices one process compiles for: above it the CPU backend refuses
("Multiprocess computations aren't implemented", jax 0.10.2; REFERENCE.md)."""


@dataclass(frozen=True)
class Check:
    """Predicted against compiled, per device and step."""

    plan: ParallelPlan
    predicted_memory: float
    compiled_memory: float
    predicted_wire: float
    compiled_wire: float
    predicted_flops: float
    compiled_flops: float
    predicted_wire_by_axes: dict
    compiled_wire_by_axes: dict
    predicted_host: float = 0.0
    """Bytes per device kept in host memory (optimizer offload)."""
    compiled_host: float = 0.0
    """Bytes of the step's arguments whose sharding says ``pinned_host``."""
    compiled_peak: Peak | None = None
    """What XLA's heap simulation holds at the step's peak, and where it falls
    (``analysis.peak``; ``validate(..., peak=True)``): the memory ratio read part by part."""

    @property
    def memory_ratio(self) -> float:
        return self.predicted_memory / self.compiled_memory

    @property
    def wire_ratio(self) -> float:
        if self.compiled_wire == 0:
            return 1.0 if self.predicted_wire == 0 else float("inf")
        return self.predicted_wire / self.compiled_wire

    def ok(self, memory_tol: float = 0.10, wire_tol: float = 0.05) -> bool:
        return abs(self.memory_ratio - 1) <= memory_tol and abs(self.wire_ratio - 1) <= wire_tol


def simulable(workload: Workload, plan: ParallelPlan) -> tuple[Workload, ParallelPlan, str]:
    """``plan`` (and its workload) on at most ``MAX_SIMULATED`` devices, and what changed.

    A larger plan keeps its per-axis shape but fewer data-parallel replicas, with the global
    batch cut by the same factor: each device's program is unchanged except the group
    sizes of the data-parallel collectives (REFERENCE.md). Raises ShardingError when the
    data axis cannot shrink far enough.
    """
    view = PlanView(plan)
    if view.size <= MAX_SIMULATED:
        return workload, plan, ""
    data, batch = view["data"], workload.global_batch
    for cut in range(2, data + 1):
        if data % cut == 0 and batch % cut == 0 and view.size // cut <= MAX_SIMULATED:
            sizes = {**view.sizes, "data": data // cut}
            small = plan.with_mesh_axes({a: s for a, s in sizes.items() if s > 1 or a != "data"})
            note = (
                f"validating data={data // cut} (of {data}) with global batch {batch // cut} "
                f"(of {batch}): the plan needs {view.size} simulated devices, the CPU backend "
                f"takes at most {MAX_SIMULATED}; each device's program is the same but for the "
                "data-parallel group sizes."
            )
            return dataclasses.replace(workload, global_batch=batch // cut), small, note
    raise ShardingError(
        f"--validate: plan {view.mesh_text()} needs {view.size} simulated devices and the CPU "
        f"backend compiles for at most {MAX_SIMULATED}; its data axis ({data}) cannot shrink "
        "that far. Fix: validate the same layout on fewer hosts (--hosts)."
    )


def train_config(workload: Workload, plan: ParallelPlan, precision: str = "fp32"):
    """The ``TrainConfig`` that runs ``plan``: the plan as its ``parallel`` and the [train]
    table ``plan_toml`` writes (typed values), at ``precision``."""
    from shardlib.planner.writer import train_table
    from shardlib.train.config import TrainConfig, override

    table = {**train_table(workload), "precision.compute": precision}
    return override(TrainConfig(parallel=plan), table)


def validate(workload: Workload, plan: ParallelPlan, *, peak: bool = False) -> Check:
    """Compile ``plan`` (fp32) on the simulated devices present and compare (``peak``:
    also read where the compiled step's memory peaks, ``Check.compiled_peak``)."""
    import jax

    from shardlib.analysis import explain, memory_kinds
    from shardlib.train.setup import make_setup

    size = PlanView(plan).size
    if jax.device_count() < size:
        raise ShardingError(
            f"plan {plan.describe()} needs {size} devices, {jax.device_count()} present. "
            f"Fix: shardlib.simulate_cpu_devices({size}) before JAX starts."
        )
    fp32 = dataclasses.replace(workload, precision="fp32")
    cfg = train_config(fp32, plan)
    mesh = plan.build_mesh(jax.devices()[:size])
    setup = make_setup(cfg, mesh)
    state = setup.abstract_state()
    batch = setup.abstract_batch()
    report = explain(setup.train_step, state, batch, mesh=mesh, params=state["params"], peak=peak)
    pred = estimate(fp32, plan, backend="cpu")
    host = report.host_argument_bytes  # counted with the device's on CPU: moved apart
    # and what the CPU backend elides: host temporaries out, device copies of host data in
    jaxpr = memory_kinds.live(setup.train_step.trace(state, batch).jaxpr.jaxpr)
    splits = memory_kinds.weight_splits(state["params"])  # host gradients: one device's
    kinds = memory_kinds.host_temp_bytes(jaxpr, splits), memory_kinds.staged_bytes(jaxpr, splits)
    return Check(
        plan=plan,
        predicted_memory=pred.memory_bytes,
        compiled_memory=report.memory.total_bytes - host - kinds[0] + kinds[1],
        predicted_host=pred.host_bytes,
        compiled_host=host,
        compiled_peak=report.peak,
        predicted_wire=pred.wire_bytes,
        compiled_wire=sum(t["wire_bytes"] for t in report.collective_totals.values()),
        predicted_flops=pred.flops,
        compiled_flops=report.flops_per_device,
        predicted_wire_by_axes=pred.wire_by_axes(),
        compiled_wire_by_axes={
            k: v["wire_bytes"] for k, v in report.collective_totals_by_axis.items()
        },
    )
