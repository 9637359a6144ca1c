"""Multi-host plumbing that needs no second process: launcher detection, flags, host split."""

import pytest

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import split_over_hosts
from shardlib.distributed.runtime import ProcessGroup, detected_launcher


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
