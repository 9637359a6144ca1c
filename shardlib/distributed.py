"""Multi-host runs through JAX's own runtime, and meshes that know where the hosts are.

One process per host (or per GPU group) calls ``jax.distributed.initialize`` before JAX
starts its backend; the processes then see one global list of devices and every jitted
step is a single SPMD program across all of them. On CPU the cross-process collectives go
through gloo, which is what lets this be tested here with several processes on loopback.

Fast axes (tensor, fsdp) should stay inside a host and only slow axes (data, the outer part
of fsdp) should cross hosts: ``hybrid_device_grid`` assigns the process count to the
outermost mesh axes, which is the order presets already follow (last axis = fastest).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from shardlib.errors import ShardingError

# (marker, task count) environment variables by which JAX's cluster detection recognises a
# launcher. A job launched by one of these needs no flags at all:
# ``jax.distributed.initialize()`` reads the coordinator, process count and id from there.
LAUNCHER_ENV = {
    "slurm": ("SLURM_JOB_ID", "SLURM_NTASKS"),
    "openmpi": ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"),
}


@dataclass(frozen=True)
class ProcessGroup:
    """How this process joins a multi-process run (all None: let JAX detect it)."""

    coordinator: str | None = None
    """``host:port`` of process 0's coordinator service."""
    num_processes: int | None = None
    """Processes in the run (one per host, usually)."""
    process_id: int | None = None
    """This process's rank, 0 .. num_processes - 1."""
    timeout_s: int = 300
    """How long to wait for every process to join, and to shut down together."""

    def __post_init__(self) -> None:
        given = [self.coordinator, self.num_processes, self.process_id]
        if any(v is not None for v in given) and any(v is None for v in given):
            raise ShardingError(
                "distributed: --coordinator, --num-processes and --process-id go together "
                f"(got coordinator={self.coordinator}, num_processes={self.num_processes}, "
                f"process_id={self.process_id}). Fix: pass all three, or none under a "
                "SLURM / Open MPI launcher."
            )
        if self.num_processes is not None and not 0 <= self.process_id < self.num_processes:
            raise ShardingError(
                f"distributed: process_id={self.process_id} is outside 0..{self.num_processes - 1}."
            )

    @property
    def explicit(self) -> bool:
        return self.coordinator is not None


def detected_launcher() -> str | None:
    """``"slurm"`` / ``"openmpi"`` when this process was started by one with >1 task."""
    for name, (marker, size) in LAUNCHER_ENV.items():
        if marker in os.environ and int(os.environ.get(size, "1") or 1) > 1:
            return name
    return None


def initialize(group: ProcessGroup, *, cpu: bool = False) -> int:
    """Join the run described by ``group`` (or by the launcher's environment).

    Returns the number of processes (1 when there is nothing to join). Must run before
    anything starts JAX's backend, and before ``simulate_cpu_devices``, which then counts
    the devices *of this process*.
    """
    import jax

    if not group.explicit and detected_launcher() is None:
        return 1
    if jax.distributed.is_initialized():
        return jax.process_count()
    if cpu:
        # Collectives between CPU processes; the in-process default cannot cross processes.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=group.coordinator,
            num_processes=group.num_processes,
            process_id=group.process_id,
            initialization_timeout=group.timeout_s,
            shutdown_timeout_seconds=group.timeout_s,
        )
    except RuntimeError as err:
        raise ShardingError(
            f"distributed: could not join the run ({err}). Fix: call it first, before any "
            "JAX operation, and check that every process got the same --coordinator."
        ) from None
    # jax.process_count() would start the backend; the device count is not set yet.
    from jax._src import distributed as _dist

    return int(_dist.global_state.num_processes)


def split_over_hosts(sizes: list[int], hosts: int) -> tuple[list[int], list[int]]:
    """(inner per-host sizes, across-host sizes): hosts fill the outermost axes first.

    ``[2, 2, 2]`` over 2 hosts -> inner ``[1, 2, 2]``, across ``[2, 1, 1]``: the data axis
    crosses hosts, fsdp and tensor stay inside one.
    """
    across, left = [], hosts
    for size in sizes:
        share = math.gcd(size, left)
        across.append(share)
        left //= share
    if left != 1:
        raise ShardingError(
            f"mesh: axis sizes {sizes} cannot be split over {hosts} hosts (each host must "
            "hold an equal block of the mesh). Fix: make the outer axes a multiple of the "
            "process count."
        )
    return [s // a for s, a in zip(sizes, across, strict=True)], across


def hybrid_device_grid(sizes: list[int], devices: list) -> np.ndarray:
    """Devices arranged as ``sizes`` with process boundaries on the outermost axes."""
    from jax.experimental import mesh_utils

    hosts = len({d.process_index for d in devices})
    inner, across = split_over_hosts(sizes, hosts)
    return mesh_utils.create_hybrid_device_mesh(inner, across, devices, process_is_granule=True)


def coordination_client():
    """The coordination service's key-value client, or None in a single-process run.

    JAX exposes no public handle to it; orbax reads the same private attribute.
    """
    import jax

    if jax.process_count() == 1:
        return None
    from jax._src import distributed as _dist

    return _dist.global_state.client
