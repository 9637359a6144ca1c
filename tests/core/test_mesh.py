"""Meshes: sizes, -1, Auto axis types, presets, and the errors for malformed meshes."""

import jax
import pytest
from jax.sharding import AxisType

from shardlib import ShardingError, load_mesh, mesh_spec, simulate_cpu_devices
from shardlib.core.mesh import MESHES_DIR, MeshSpec


def test_minus_one_takes_the_devices_that_are_left():
    assert mesh_spec(data=2, fsdp=-1).sizes(8) == {"data": 2, "fsdp": 4}


def test_built_mesh_has_auto_axes_in_preset_order():
    mesh = mesh_spec(data=2, fsdp=2, tensor=2).build()
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert mesh.devices.shape == (2, 2, 2)
    assert all(t == AxisType.Auto for t in mesh.axis_types)


def test_mesh_over_a_subset_of_devices():
    mesh = mesh_spec(tensor=4).build(jax.devices()[:4])
    assert mesh.devices.size == 4


@pytest.mark.parametrize(
    "axes, devices, message",
    [
        ({"data": 3}, 8, "needs 3 devices but 8 are available"),
        ({"data": -1, "fsdp": -1}, 8, "both -1"),
        ({"data": 3, "fsdp": -1}, 8, "does not\ndivide"),
        ({"data": 0}, 8, "has size 0"),
    ],
)
def test_malformed_meshes(axes, devices, message):
    with pytest.raises(ShardingError) as err:
        MeshSpec(tuple(axes.items())).sizes(devices)
    assert " ".join(message.split()) in " ".join(str(err.value).split())


def test_all_presets_load_and_say_when_to_use_them():
    paths = sorted(MESHES_DIR.glob("*.toml"))
    names = {p.stem for p in paths}
    assert {"cpu-8-dp", "cpu-8-fsdp", "cpu-8-tp", "cpu-8-3d"} <= names
    for path in paths:
        assert path.read_text().lower().startswith("# use this when"), path
        load_mesh(path)
    assert dict(load_mesh("cpu-8-3d").axes) == {"data": 2, "fsdp": 2, "tensor": 2}


def test_missing_preset_lists_the_known_ones(tmp_path):
    with pytest.raises(ShardingError, match="cpu-8-fsdp"):
        load_mesh("cpu-8-nonsense")
    bad = tmp_path / "bad.toml"
    bad.write_text("# use this when: never\n[axes]\ndata = 8\n")
    with pytest.raises(ShardingError, match=r"no \[mesh\] table"):
        load_mesh(bad)


def test_simulating_devices_too_late_says_so():
    jax.devices()  # the backend is up with 8 devices (tests/conftest.py)
    simulate_cpu_devices(8)  # asking for what we have is fine
    with pytest.raises(ShardingError, match="after JAX initialised"):
        simulate_cpu_devices(16)
