"""What a launcher (Slurm's ``srun``, Open MPI's ``mpirun``) says about the run, as flags.

Started by a launcher, a process needs no flags: the coordinator, the process count and the
rank are in its environment. JAX's cluster detection reads them too, but only inside
``jax.distributed.initialize``, and then skips what an explicit start does first (the port
check, process 0's join desk, the coordination service in a process of its own). So the
launcher's environment is turned into the same three values here, and every run joins the
one guarded way:

- the coordinator is where JAX's detection puts it (Slurm: the step's first node; Open MPI:
  ``mpirun``'s host) on a port in JAX's range (61440-65535, outside Linux's ephemeral ports),
  but derived from the job *and the step*: JAX derives it from the job alone, so two
  ``srun`` steps of one allocation would meet on one coordinator and cross-join. The
  port is even, leaving the next one for process 0's join desk;
- the job's identity, checked at the desk, is ``slurm:JOB.STEP`` or ``openmpi:JOB``: a
  process of another step that still reaches this coordinator (ports wrap) is refused, and
  the run there is untouched;
- ``$JAX_COORDINATOR_PORT`` (JAX's own override) chooses the port instead.

A batch script of a job of several tasks, run without ``srun``, is one process with the
whole job's task count: it is told to use ``srun`` in one line (JAX would say only that
``coordinator_address should be defined``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from shardlib.core.errors import ShardingError

# (marker, task count) environment variables by which a launcher is recognised.
LAUNCHER_ENV = {
    "slurm": ("SLURM_JOB_ID", "SLURM_NTASKS"),
    "openmpi": ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"),
}
PORT_BASE = 65535 - 2**12 + 1
"""JAX's range for derived coordinator ports: 61440-65535, above Linux's ephemeral ports."""
PORT_PAIRS = 2**11
"""Even ports in that range: coordinator ``p``, join desk ``p + 1``."""
STEPS_PER_JOB = 64
"""Steps of one job that get distinct ports before they wrap (a wrap is refused, not run)."""


@dataclass(frozen=True)
class Launched:
    """The process group a launcher started this process in."""

    launcher: str
    """``"slurm"`` or ``"openmpi"``."""
    coordinator: str
    """``host:port`` of process 0's coordinator."""
    num_processes: int
    process_id: int
    job_id: str
    """The job's identity at process 0's join desk: ``slurm:JOB.STEP``, ``openmpi:JOB``."""


def detected_launcher() -> str | None:
    """``"slurm"`` / ``"openmpi"`` when this process was started by one with >1 task."""
    for name, (marker, size) in LAUNCHER_ENV.items():
        if marker in os.environ and int(os.environ.get(size, "1") or 1) > 1:
            return name
    return None


def coordinator_port(key: int) -> int:
    """An even port in JAX's range for ``key`` (the job and step), or ``$JAX_COORDINATOR_PORT``."""
    chosen = os.environ.get("JAX_COORDINATOR_PORT")
    if chosen:
        return int(chosen)
    return PORT_BASE + 2 * (key % PORT_PAIRS)


def _slurm() -> Launched:
    env = os.environ
    tasks = int(env["SLURM_NTASKS"])
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        raise ShardingError(
            f"distributed: this is job {env['SLURM_JOB_ID']}'s batch script, one process, but "
            f"the job has {tasks} tasks (SLURM_NTASKS={tasks}): shardlib runs one process per "
            "task. Fix: start it with srun (srun shardlib train ...), or ask for one task."
        )
    from jax._src.clusters.slurm_cluster import SlurmCluster  # parses the node list

    job, step = int(env["SLURM_JOB_ID"]), int(env["SLURM_STEP_ID"])
    port = coordinator_port(job * STEPS_PER_JOB + step)
    return Launched(
        "slurm",
        SlurmCluster.get_coordinator_address(None, str(port)),
        tasks,
        int(env["SLURM_PROCID"]),
        f"slurm:{job}.{step}",
    )


def _openmpi() -> Launched:
    env = os.environ
    uri = env.get("OMPI_MCA_orte_hnp_uri")
    if uri is None:
        raise ShardingError(
            "distributed: started by Open MPI without OMPI_MCA_orte_hnp_uri (Open MPI 5 or a "
            "PMIx launcher), so the coordinator's host is unknown. Fix: pass --coordinator "
            "HOST:PORT --num-processes $OMPI_COMM_WORLD_SIZE --process-id $OMPI_COMM_WORLD_RANK."
        )
    from jax._src.clusters.ompi_cluster import OmpiCluster  # parses the launcher's address

    job = int(uri.split(".", 1)[0]) // 2**12  # Open MPI's job ids are multiples of 2**12
    return Launched(
        "openmpi",
        OmpiCluster.get_coordinator_address(None, str(coordinator_port(job))),
        int(env["OMPI_COMM_WORLD_SIZE"]),
        int(env["OMPI_COMM_WORLD_RANK"]),
        f"openmpi:{job}",
    )


def launched() -> Launched | None:
    """The launcher's process group, None when no launcher started several tasks."""
    name = detected_launcher()
    if name is None:
        return None
    return _slurm() if name == "slurm" else _openmpi()


MPIRUN_GRACE_S = 30
"""Seconds from a preemption to ``mpirun``'s SIGKILL of the ranks that a run of some size
needs to finish its step and write a checkpoint."""


def launcher_grace_note() -> str | None:
    """Under ``mpirun``: how long the ranks live after a preemption, when that is short.

    A scheduler preempts an MPI job by sending TERM to its command. Sent to ``mpirun``
    itself, Open MPI 4.1 sends the ranks CONT at once (the run's preemption notice under
    mpirun: ``preempt.watched``), TERM ``odls_base_sigkill_timeout`` seconds later and KILL
    as long after that (default 1 s each), and exits 1. The ranks stop at the next step
    boundary with a checkpoint, which a small run does in a second and a large one does not,
    so the run says at start how to give it room: ``shardlib launch mpirun ...``
    (``relay``: the TERM reaches the ranks as USR1, mpirun keeps running and exits 0; it
    sets the timeout to ``MPIRUN_GRACE_S`` for a second TERM), or the setting itself
    (mpirun passes ``--mca`` settings to the ranks as ``OMPI_MCA_*``)."""
    if detected_launcher() != "openmpi":
        return None
    raw = os.environ.get("OMPI_MCA_odls_base_sigkill_timeout", "1")
    grace = 2 * (int(raw) if raw.strip().isdigit() else 1)
    if grace >= MPIRUN_GRACE_S:
        return None
    return (
        f"mpirun kills the ranks {grace} s after it is sent a TERM (twice "
        "odls_base_sigkill_timeout): a preempted run stops at the next step with a "
        "checkpoint only if the step and the save fit in that. Fix: start it as shardlib "
        "launch mpirun ... (a TERM to that reaches the ranks as USR1 and mpirun exits 0), "
        f"or pass mpirun --mca odls_base_sigkill_timeout {MPIRUN_GRACE_S}."
    )
