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
0's join desk (``admission.py``, the coordinator's port + 1) *before* joining whether the
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
from shardlib.distributed.launchers import launched
from shardlib.distributed.service_host import service_in_own_process


@dataclass(frozen=True)
class ProcessGroup:
    """How this process joins a multi-process run (all None: a run of one process).

    The three values come from the flags, or from the launcher that started the process
    (``launchers.launched``): either way the run joins through the same guards."""

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
    ``$SHARDLIB_JOB_ID``, else the launcher's job and step, else ``$SLURM_JOB_ID``; None
    matches only None). Whatever the id, nobody joins a run whose processes have all joined."""
    launcher: str | None = None
    """``"slurm"`` / ``"openmpi"`` when the launcher's environment gave the three values."""

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
    where = (args.coordinator, args.num_processes, args.process_id)
    by = launched() if all(v is None for v in where) else None  # the flags win
    if by is not None:
        where, values["launcher"] = (by.coordinator, by.num_processes, by.process_id), by.launcher
    if values.get("job_id") is None:
        values["job_id"] = (
            os.environ.get("SHARDLIB_JOB_ID")
            or (by and by.job_id)
            or os.environ.get("SLURM_JOB_ID")
        )
    return ProcessGroup(*where, **values)


def port_fix(launcher: str | None, host: str = "HOST") -> str:
    """How to give a run another coordinator port: a flag, or JAX's variable under a launcher."""
    if launcher:
        command = {"slurm": "srun", "openmpi": "mpirun"}.get(launcher, launcher)
        return f"export JAX_COORDINATOR_PORT={_free_port() & ~1} (an even port) before {command}"
    return f"--coordinator {host}:{_free_port()}"


def check_port_free(coordinator: str, launcher: str | None = None) -> None:
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
            f"e.g. {port_fix(launcher, host or 'HOST')}."
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


def initialize(group: ProcessGroup, *, cpu: bool = False) -> int:
    """Join the run described by ``group`` (the flags', or the launcher's: ``process_group``).

    Returns the number of processes (1 when there is nothing to join). Must run before
    anything starts JAX's backend, and before ``simulate_cpu_devices``, which then counts
    the devices *of this process*.
    """
    import jax

    if not group.explicit:
        return 1
    if jax.distributed.is_initialized():
        return jax.process_count()
    if cpu:
        # Collectives between CPU processes; the in-process default cannot cross processes.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    desk = None
    from shardlib.distributed.peers import started_as

    started_as(group.process_id)
    if group.process_id == 0:
        check_port_free(group.coordinator, group.launcher)
        desk = JoinDesk(group.coordinator, group.job_id)
    else:
        fix = port_fix(group.launcher)
        ask_to_join(group.coordinator, group.job_id, group.process_id, group.init_timeout_s, fix)
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
