"""The picture of a sharded array: tiles, devices and mesh-axis words (8 fake CPU devices).

Every expectation is derived by hand from the PartitionSpec, so a picture that drew the
wrong device in a tile, or named the wrong axis, fails here.
"""

import io

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console

import shardlib
from shardlib import ShardingError, mesh_spec, show_sharding


@pytest.fixture(scope="module")
def mesh_2x4():
    return mesh_spec(data=2, tensor=4).build()


@pytest.fixture(scope="module")
def mesh_8():
    return mesh_spec(fsdp=8).build()


def _tile_map(pic):
    return {t.bounds: t.devices for t in pic.tiles}


def test_1d_mesh_rank2_param(mesh_8):
    pic = show_sharding((64, 256), P(None, "fsdp"), mesh=mesh_8, names=("embed", "mlp"))
    assert len(pic.tiles) == 8 and pic.copies == 1
    # device i holds columns 32i:32(i+1) of every row
    assert _tile_map(pic) == {((0, 64), (32 * i, 32 * i + 32)): (i,) for i in range(8)}
    assert pic.dims[0].ways == 1 and pic.dims[1].axes == ("fsdp",) and pic.dims[1].ways == 8
    text = str(pic)
    assert "dim 1 (mlp) [256]: split 8 ways over fsdp, 32 per tile" in text
    assert "dim 0 (embed) [64]: whole" in text
    assert "each device holds [64, 32]: 1/8 of the array" in text


def test_2d_mesh_replicated_axis_named(mesh_2x4):
    pic = show_sharding((8, 12), P("data"), mesh=mesh_2x4, names=("batch", "embed"))
    assert pic.replicated_over == ("tensor",) and pic.copies == 4
    assert _tile_map(pic) == {((0, 4), (0, 12)): (0, 1, 2, 3), ((4, 8), (0, 12)): (4, 5, 6, 7)}
    assert "replicated over tensor: 4 copies of each tile" in str(pic)


def test_two_axes_on_one_dim_in_spec_order(mesh_2x4):
    """P(("tensor", "data")): tensor is the major axis, so device 4 (data=1, tensor=0) holds
    the second of eight row blocks."""
    pic = show_sharding((16, 4), P(("tensor", "data")), mesh=mesh_2x4)
    assert pic.dims[0].axes == ("tensor", "data")
    assert pic.tiles[1].devices == (4,) and pic.tiles[1].bounds[0] == (2, 4)
    assert "split 8 ways over tensor×data" in str(pic)


def test_rank3_abstract_activation(mesh_2x4):
    sharding = NamedSharding(mesh_2x4, P("data", None, "tensor"))
    x = jax.ShapeDtypeStruct((16, 32, 64), jnp.float32, sharding=sharding)
    pic = shardlib.sharding_picture(x, names=("batch", "seq", "embed"), title="x_BLD")
    assert pic.shape == (16, 32, 64) and pic.dtype == "float32"
    assert pic.shard_shape == (8, 32, 16)
    for dev in range(8):  # mesh coords (data, tensor) = divmod(dev, 4)
        d, t = divmod(dev, 4)
        bounds = pic.tiles[pic.tile_of(dev)].bounds
        assert bounds == ((8 * d, 8 * d + 8), (0, 32), (16 * t, 16 * t + 16))
    fig = pic.figure()
    assert len(fig.axes) == 3  # one panel per batch tile + the mesh
    assert fig.axes[0].get_title() == "dim 0 (batch) 0:8"
    assert "÷4 over tensor" in fig.axes[0].get_xlabel()
    assert pic._repr_png_().startswith(b"\x89PNG")


def test_unnamed_sharding_axes_are_inferred(mesh_2x4):
    """XLA-chosen shardings need not be NamedShardings: the axes come from the device grid."""
    named = NamedSharding(mesh_2x4, P(None, ("tensor", "data")))
    try:  # private, but the plainest way to get an unnamed sharding of a known layout
        from jax._src.sharding_impls import GSPMDSharding

        gspmd = GSPMDSharding(tuple(mesh_2x4.devices.flat), named._to_xla_hlo_sharding(2))
    except (ImportError, AttributeError, TypeError) as e:
        pytest.skip(f"no GSPMDSharding in this jax: {e}")
    pic = show_sharding((4, 16), gspmd, mesh=mesh_2x4)
    assert pic.dims[1].axes == ("tensor", "data") and pic.dims[0].ways == 1
    assert _tile_map(pic) == _tile_map(show_sharding((4, 16), named))
    no_mesh = show_sharding((4, 16), gspmd)
    assert no_mesh.dims[1].ways == 8 and no_mesh.dims[1].axes == () and not no_mesh.mesh_axes


def test_rich_text_and_rank1(mesh_8):
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh_8, P("fsdp")))
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(show_sharding(x, names=("vocab",)))
    out = console.file.getvalue()
    assert "dim 0 (vocab) [16]: split 8 ways over fsdp" in out
    assert all(f"dev {i}" in out for i in range(8))
    assert "mesh: fsdp (8)" in out


def test_bad_input_is_a_sharding_error(mesh_8):
    with pytest.raises(ShardingError, match="has no sharding"):
        show_sharding(jax.ShapeDtypeStruct((4,), jnp.float32))
    with pytest.raises(ShardingError, match="without a mesh"):
        show_sharding((4,), P("fsdp"))
    with pytest.raises(ShardingError, match="one logical name"):
        show_sharding((8, 8), P("fsdp"), mesh=mesh_8, names=("batch",))
