"""Multi-host plumbing that needs no second process: launcher detection, flags, host split."""

import pytest

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import split_over_hosts
from shardlib.distributed import launchers
from shardlib.distributed.launchers import detected_launcher
from shardlib.distributed.runtime import ProcessGroup


@pytest.mark.parametrize(
    ("sizes", "hosts", "inner", "across"),
    [
        ([2, 2, 2], 2, [1, 2, 2], [2, 1, 1]),  # data crosses hosts, fsdp x tensor inside
        ([8], 2, [4], [2]),
        ([2, 4], 4, [1, 2], [2, 2]),  # 4 hosts: data, then the outer half of fsdp
        ([4, 2], 1, [4, 2], [1, 1]),
    ],
)
def test_hosts_take_the_outermost_axes(sizes, hosts, inner, across):
    assert split_over_hosts(sizes, hosts) == (inner, across)


def test_a_mesh_that_cannot_be_split_over_the_hosts():
    with pytest.raises(ShardingError, match="cannot be split over 2 hosts"):
        split_over_hosts([3, 3], 2)


def test_launcher_detection(monkeypatch):
    for var in ("SLURM_JOB_ID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert detected_launcher() is None
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_NTASKS", "1")  # a one-task allocation is a single process
    assert detected_launcher() is None
    monkeypatch.setenv("SLURM_NTASKS", "16")
    assert detected_launcher() == "slurm"
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert detected_launcher() == "openmpi"


def test_flags_go_together():
    with pytest.raises(ShardingError, match="go together"):
        ProcessGroup(coordinator="127.0.0.1:1234")
    with pytest.raises(ShardingError, match="outside 0..1"):
        ProcessGroup(coordinator="127.0.0.1:1234", num_processes=2, process_id=2)
    assert not ProcessGroup().explicit


def test_slurm_steps_of_one_job_get_their_own_coordinator(monkeypatch):
    """The derivation, without a cluster: each step its own even port (the next one is its
    join desk) and identity; JAX's port override wins; a batch script is refused."""
    monkeypatch.delenv("JAX_COORDINATOR_PORT", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    env = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "node[07-09]"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SLURM_PROCID", "1")
    got = {}
    for step in ("0", "1"):
        monkeypatch.setenv("SLURM_STEP_ID", step)
        got[step] = launchers.launched()
    ports = {int(g.coordinator.rpartition(":")[2]) for g in got.values()}
    assert len(ports) == 2 and all(p % 2 == 0 and 61440 <= p < 65535 for p in ports), got
    assert {g.coordinator.rpartition(":")[0] for g in got.values()} == {"node07"}
    assert [g.job_id for g in got.values()] == ["slurm:4242.0", "slurm:4242.1"]
    assert got["1"].num_processes == 2 and got["1"].process_id == 1
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "12000")
    assert launchers.launched().coordinator == "node07:12000"
    monkeypatch.delenv("SLURM_STEP_ID")  # the batch script: one process of a 2-task job
    with pytest.raises(ShardingError, match=r"SLURM_NTASKS=2.*Fix: start it with srun"):
        launchers.launched()
    monkeypatch.setenv("SLURM_NTASKS", "1")  # one task: a run of one process
    assert launchers.launched() is None


def test_every_row_of_the_readme_fault_table_names_tests_that_exist():
    """The README's table of staged faults: each row names at least one test, and each test
    named is defined in the file named (``tests/distributed/`` unless a folder is given)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    text = (root / "README.md").read_text()
    start = text.index("| fault | bound | what is printed | exit | test |")
    end = text.find("\n\n", start)
    rows = text[start : end if end > 0 else None].splitlines()[2:]
    assert len(rows) >= 16, rows  # the 14 staged faults, rank 0 lost, preemption
    for row in rows:
        named = re.findall(r"`((?:tests/[\w/]+/)?\w+\.py)::(\w+)`", row.split(" | ")[-1])
        assert named, row
        for file, test in named:
            path = root / (file if file.startswith("tests/") else f"tests/distributed/{file}")
            assert f"def {test}(" in path.read_text(), (file, test)


def test_an_mpirun_job_gets_a_coordinator_on_mpiruns_host(monkeypatch):
    for var in ("SLURM_JOB_ID", "JAX_COORDINATOR_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911")
    got = launchers.launched()
    host, _, port = got.coordinator.rpartition(":")
    assert host == "10.96.0.1" and int(port) % 2 == 0 and 61440 <= int(port) < 65535
    assert (got.num_processes, got.process_id, got.job_id) == (2, 1, "openmpi:373920")
    monkeypatch.delenv("OMPI_MCA_orte_hnp_uri")  # Open MPI 5 / PMIx: the host is unknown
    with pytest.raises(ShardingError, match=r"Fix: pass --coordinator HOST:PORT"):
        launchers.launched()


def test_the_service_host_gets_jaxs_arguments_with_their_types():
    """Process 0's service host receives JAX's keyword arguments on its command line; the
    binding refuses an int where it takes a bool (jax 0.12's verify_secure_credentials:
    "incompatible function arguments", and no process could join)."""
    from shardlib.distributed.service_host import decode, encode

    given = {"heartbeat_timeout": 10, "recoverable": False, "verify_secure_credentials": False}
    got = decode(encode({**given, "mtls_cert_file": "/etc/run/cert.pem", "mtls_key_file": None}))
    assert got == {**given, "mtls_cert_file": "/etc/run/cert.pem"}
    assert got["recoverable"] is False and got["verify_secure_credentials"] is False


def test_the_service_host_starts_with_what_this_jax_passes():
    """The host process starts JAX's coordination service with the arguments this JAX's
    ``initialize`` passes (those the installed binding takes), answers, and ends on ``done``."""
    import socket

    from jax._src.lib import _jax

    from shardlib.distributed.service_host import HostedService

    takes = _jax.get_distributed_runtime_service.__doc__
    kwargs = {"heartbeat_timeout": 10, "shutdown_timeout": 5, "recoverable": False}
    if "verify_secure_credentials" in takes:  # jax >= 0.12 passes it
        kwargs["verify_secure_credentials"] = False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    host = HostedService.start(f"127.0.0.1:{port}", 1, 1.0, **kwargs)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the service answers on its port
    finally:
        host.shutdown()
    assert host._proc.returncode == 0
