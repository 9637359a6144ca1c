"""Multi-host runs through JAX's own runtime, and meshes that know where the hosts are.

One process per host (or per GPU group) calls ``jax.distributed.initialize`` before JAX
starts its backend; the processes then see one global list of devices and every jitted
step is a single SPMD program across all of them. On CPU the cross-process collectives go
through gloo, which is what lets this be tested here with several processes on loopback.

Fast axes (tensor, fsdp) should stay inside a host and only slow axes (data, the outer part
of fsdp) should cross hosts: ``core.mesh.hybrid_device_grid`` assigns the process count to the
outermost mesh axes, which is the order presets already follow (last axis = fastest).

Joining is guarded: process 0 refuses a coordinator port that something already listens on
(gRPC would share it with another job's coordinator, or crash), and the others ask process
0's join desk (``join_desk.py``, the coordinator's port + 1) *before* joining whether the
run there is of their job and still forming: a process of another job never reaches a
running job's coordinator, which would abort it. The timeouts are settings (CLI flags, or a
``[distributed]`` table in the mesh file); ``heartbeat_timeout_s`` bounds how long a lost
process goes unnoticed.
"""

from __future__ import annotations

import errno
import inspect
import os
import socket
import time
from contextlib import nullcontext
from dataclasses import dataclass

from shardlib.core.errors import ShardingError
from shardlib.distributed.admission import JoinDesk, ask_to_join
from shardlib.distributed.service_host import service_in_own_process

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
    init_timeout_s: int = 300
    """How long to wait for every process to join (JAX's ``initialization_timeout``)."""
    heartbeat_timeout_s: int = 60
    """A process silent this long is declared lost and the others stop (JAX's default: 100)."""
    shutdown_timeout_s: int = 60
    """How long a finished process waits for the others to finish too."""
    job_id: str | None = None
    """Names the job: a process refuses to join a coordinator of another job (default:
    ``$SHARDLIB_JOB_ID``, else ``$SLURM_JOB_ID``; None matches only None). Whatever the id,
    nobody joins a run whose processes have all joined."""

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
        for name in TIMEOUTS:
            if getattr(self, name) < 1:
                flag = "--" + name.removesuffix("_s").replace("_", "-")
                raise ShardingError(
                    f"distributed: {name}={getattr(self, name)} must be >= 1 s. Fix: {flag} 60."
                )

    @property
    def explicit(self) -> bool:
        return self.coordinator is not None


TIMEOUTS = ("init_timeout_s", "heartbeat_timeout_s", "shutdown_timeout_s")
_DESKS: list[JoinDesk] = []  # process 0's join desk lives as long as the process


def process_group(args, table: dict) -> ProcessGroup:
    """The CLI's flags over the mesh file's ``[distributed]`` table over the defaults."""
    unknown = sorted(set(table) - {*TIMEOUTS, "job_id"})
    if unknown:
        raise ShardingError(
            f"mesh [distributed]: unknown setting(s) {', '.join(unknown)}. Fix: use "
            f"{', '.join(TIMEOUTS)} or job_id."
        )
    values = {k: v for k, v in table.items()}
    for name in (*TIMEOUTS, "job_id"):
        flag = getattr(args, name, None)
        if flag is not None:
            values[name] = flag
    if values.get("job_id") is None:
        values["job_id"] = os.environ.get("SHARDLIB_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    return ProcessGroup(args.coordinator, args.num_processes, args.process_id, **values)


def check_port_free(coordinator: str) -> None:
    """Process 0: nothing may listen on the coordinator's port (gRPC shares ports)."""
    host, _, port = coordinator.rpartition(":")
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine
            try:
                probe.bind((address, int(port)))
                return
            except OSError as err:
                if err.errno != errno.EADDRINUSE:
                    continue
        raise ShardingError(
            f"distributed: coordinator port {port} is already in use on this host (another "
            f"job's coordinator, or another program). Fix: start the job with a free port, "
            f"e.g. --coordinator {host or 'HOST'}:{_free_port()}."
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# HTTP/2's client preface and an empty SETTINGS frame: a gRPC server answers with SETTINGS.
_H2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _answers_grpc(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0) as conn:
            conn.settimeout(1.0)
            conn.sendall(_H2_HELLO)
            frame = conn.recv(9)
            return len(frame) >= 4 and frame[3] == 4  # frame type 4: SETTINGS
    except OSError:
        return False


def wait_for_coordinator(group: ProcessGroup) -> None:
    """Processes > 0: wait until a gRPC server answers at the coordinator's address.

    JAX aborts the process with a C++ stack trace when what it reaches is not a coordinator
    (another program on the port); this turns that into one line within ``init_timeout_s``.
    """
    host, _, port = group.coordinator.rpartition(":")
    deadline = time.monotonic() + group.init_timeout_s
    while not _answers_grpc(host.strip("[]"), int(port)):
        if time.monotonic() > deadline:
            raise ShardingError(
                f"distributed: could not join the run at {group.coordinator} within "
                f"{group.init_timeout_s} s: no JAX coordinator answers there. Fix: start "
                "process 0 with the same --coordinator, on a port no other program uses."
            )
        time.sleep(0.25)


def detected_launcher() -> str | None:
    """``"slurm"`` / ``"openmpi"`` when this process was started by one with >1 task."""
    for name, (marker, size) in LAUNCHER_ENV.items():
        if marker in os.environ and int(os.environ.get(size, "1") or 1) > 1:
            return name
    return None


MPIRUN_GRACE_S = 30
"""Seconds from a preemption to ``mpirun``'s SIGKILL of the ranks that a run of some size
needs to finish its step and write a checkpoint."""


def launcher_grace_note() -> str | None:
    """Under ``mpirun``: how long the ranks live after a preemption, when that is short.

    A scheduler preempts an MPI job by sending TERM to ``mpirun``. Open MPI 4.1 then sends
    the ranks CONT at once (the run's preemption notice under mpirun: ``preempt.watched``),
    TERM ``odls_base_sigkill_timeout`` seconds later and KILL as long after that (default 1
    s each). The ranks stop at the next step boundary with a checkpoint, which a small run
    does in a second and a large one does not, so the run says at start which setting gives
    it room (mpirun passes ``--mca`` settings to the ranks as ``OMPI_MCA_*``)."""
    if detected_launcher() != "openmpi":
        return None
    raw = os.environ.get("OMPI_MCA_odls_base_sigkill_timeout", "1")
    grace = 2 * (int(raw) if raw.strip().isdigit() else 1)
    if grace >= MPIRUN_GRACE_S:
        return None
    return (
        f"mpirun kills the ranks {grace} s after it is sent a TERM (twice "
        "odls_base_sigkill_timeout): a preempted run stops at the next step with a "
        "checkpoint only if the step and the save fit in that. Fix: mpirun --mca "
        f"odls_base_sigkill_timeout {MPIRUN_GRACE_S} (or "
        f"OMPI_MCA_odls_base_sigkill_timeout={MPIRUN_GRACE_S} in the environment)."
    )


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
    desk = None
    if group.explicit:
        from shardlib.distributed.peers import started_as

        started_as(group.process_id)
    if group.explicit and group.process_id == 0:
        check_port_free(group.coordinator)
        desk = JoinDesk(group.coordinator, group.job_id)
    elif group.explicit:
        ask_to_join(group.coordinator, group.job_id, group.process_id, group.init_timeout_s)
        wait_for_coordinator(group)
    wanted = {
        "initialization_timeout": group.init_timeout_s,
        "heartbeat_timeout_seconds": group.heartbeat_timeout_s,
        "shutdown_timeout_seconds": group.shutdown_timeout_s,
    }
    known = inspect.signature(jax.distributed.initialize).parameters
    # process 0 hosts the coordination service in a process that outlives it, so that its
    # loss is named by the others' PeerWatch, not a C++ abort (``service_host``)
    hosted = desk is not None
    where = service_in_own_process(group.heartbeat_timeout_s + 5) if hosted else nullcontext()
    try:
        with where:
            jax.distributed.initialize(
                coordinator_address=group.coordinator,
                num_processes=group.num_processes,
                process_id=group.process_id,
                **{k: v for k, v in wanted.items() if k in known},  # what this JAX accepts
            )
    except RuntimeError as err:
        if desk is not None:
            desk.close()
        first = (str(err).strip().splitlines() or [""])[0][:300]
        raise ShardingError(
            f"distributed: could not join the run at {group.coordinator} within "
            f"{group.init_timeout_s} s ({first}). Fix: start every process with the same "
            "--coordinator, process 0 first, before any JAX operation."
        ) from None
    # jax.process_count() would start the backend; the device count is not set yet.
    from jax._src import distributed as _dist

    if desk is not None:
        desk.running = True  # every process has joined: the desk now turns newcomers away
        _DESKS.append(desk)
    return int(_dist.global_state.num_processes)


def coordination_client():
    """The coordination service's key-value client, or None in a single-process run.

    JAX exposes no public handle to it; orbax reads the same private attribute.
    """
    import jax

    if jax.process_count() == 1:
        return None
    from jax._src import distributed as _dist

    return _dist.global_state.client
