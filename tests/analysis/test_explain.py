"""Tests of the layout report on real compiled programs (the HLO parsers: test_hlo.py).

The compiled tests need 8 fake CPU devices (tests/conftest.py). Nothing is executed: every
program is lowered and compiled from ``jax.ShapeDtypeStruct`` inputs.
"""

import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console

from shardlib.analysis import LayoutReport, explain

AUTO = jax.sharding.AxisType.Auto


def _mesh(shape, names, devices=None):
    if devices is None:
        return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))
    return jax.sharding.Mesh(devices, names, axis_types=(AUTO,) * len(shape))


def _abstract(shape, mesh, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


# --- real compiled programs on 8 fake devices ------------------------------------------------


def _sumsq_grad(params, x):  # [d, d], [B, d]
    return jax.grad(lambda p: jnp.sum((x @ p["w"]) ** 2))(params)


def test_data_parallel_all_reduce():
    mesh = _mesh((8,), ("data",))
    params = {"w": _abstract((64, 64), mesh, P())}
    x = _abstract((32, 64), mesh, P("data", None))
    report = explain(_sumsq_grad, params, x)
    assert report.mesh_axes == {"data": 8}
    (op,) = [op for op in report.collectives if op.kind == "all-reduce"]
    assert op.axes == ("data",) and op.group_size == 8 and op.count == 1
    assert op.buffer_bytes == 64 * 64 * 4  # the full gradient
    assert op.wire_bytes == pytest.approx(2 * 7 / 8 * 64 * 64 * 4)
    assert report.collective_totals["all-reduce"]["wire_bytes"] == pytest.approx(op.wire_bytes)
    assert report.collective_totals_by_axis["data"]["count"] == 1
    assert report.params_count == 64 * 64 and report.params_bytes == 64 * 64 * 4
    assert [t.path for t in report.tensors] == ["params.w", "x"]
    assert report.tensors[1].shard_shape == (4, 64)
    assert report.tensors[1].bytes_per_device == 4 * 64 * 4


@pytest.mark.parametrize("permuted", [False, True])
def test_2d_mesh_collective_axes(permuted):
    # A permuted device order checks that replica-group ids are positions in mesh.devices,
    # not device ids: with ids, the "tensor" groups below would seem to span both axes.
    devices = np.array(jax.devices()[:8])
    devices = devices.reshape(4, 2).T if permuted else devices.reshape(2, 4)
    mesh = _mesh((2, 4), ("data", "tensor"), devices)

    def psums(x):  # x: [B/data, d/tensor] per device
        return jax.lax.psum(x, "data"), jax.lax.psum(x * 2, "tensor")

    fn = jax.jit(
        jax.shard_map(
            psums,
            mesh=mesh,
            in_specs=P("data", "tensor"),
            out_specs=(P(None, "tensor"), P("data", None)),
        )
    )
    report = explain(fn, _abstract((16, 32), mesh, P("data", "tensor")), mesh=mesh)
    axes = sorted((op.axes, op.group_size) for op in report.collectives)
    assert axes == [(("data",), 2), (("tensor",), 4)]
    assert report.mesh_axes == {"data": 2, "tensor": 4}


def test_collective_permute_axes():
    mesh = _mesh((2, 4), ("data", "tensor"))

    def shift(x):
        return jax.lax.ppermute(x, "tensor", [(i, (i + 1) % 4) for i in range(4)])

    fn = jax.jit(
        jax.shard_map(shift, mesh=mesh, in_specs=P("data", "tensor"), out_specs=P("data", "tensor"))
    )
    report = explain(fn, _abstract((16, 32), mesh, P("data", "tensor")))
    (op,) = report.collectives
    assert op.kind == "collective-permute" and op.axes == ("tensor",) and op.group_size == 4
    assert op.buffer_bytes == 8 * 8 * 4 and op.wire_bytes == op.buffer_bytes


def _scanned_mlp(params, x):  # w: [L, d, d] with the contracting dim sharded: x: [B, d]
    def layer(h, w):
        return jnp.tanh(h @ w), None

    return jax.lax.scan(layer, x, params["w"])[0]


def _scanned_report(layers, d=128):
    mesh = _mesh((2, 4), ("data", "tensor"))
    params = {"w": _abstract((layers, d, d), mesh, P(None, "tensor", None))}
    return explain(_scanned_mlp, params, _abstract((32, d), mesh, P("data", None)))


def test_scan_collectives_and_flops_scale_with_trip_count():
    one, ten = _scanned_report(1), _scanned_report(10)
    per_layer = one.collective_totals_by_axis["tensor"]
    ten_layers = ten.collective_totals_by_axis["tensor"]
    assert per_layer["count"] >= 1  # contracting-dim sharding: a partial sum per layer
    assert ten_layers["count"] == 10 * per_layer["count"]
    assert ten_layers["buffer_bytes"] == 10 * per_layer["buffer_bytes"]
    assert ten_layers["wire_bytes"] == pytest.approx(10 * per_layer["wire_bytes"])
    assert 9.5 < ten.flops_per_device / one.flops_per_device < 10.5
    # XLA's CPU cost analysis counts the while body once, whatever the trip count.
    assert ten.xla_cost_analysis_flops < 2 * one.xla_cost_analysis_flops


def test_loop_free_flops_match_xla():
    mesh = _mesh((8,), ("data",))
    x = _abstract((256, 512), mesh, P("data", None))
    w = _abstract((512, 256), mesh, P())
    report = explain(lambda x, w: jnp.maximum(x @ w, 0.0) + 1.0, x, w)
    assert report.flops_per_device == pytest.approx(report.xla_cost_analysis_flops, rel=0.1)
    assert report.flops_per_device >= 2 * 32 * 512 * 256


def test_memory_total_and_sharded_arguments():
    mesh = _mesh((8,), ("data",))

    def step(x):
        return x * 2.0

    replicated = explain(step, _abstract((1024, 256), mesh, P()))
    sharded = explain(step, _abstract((1024, 256), mesh, P("data", None)))
    assert replicated.memory.argument_bytes == 1024 * 256 * 4
    assert sharded.memory.argument_bytes == replicated.memory.argument_bytes // 8
    donated = explain(jax.jit(step, donate_argnums=0), _abstract((1024, 256), mesh, P()))
    m = donated.memory
    assert m.total_bytes == m.argument_bytes + m.output_bytes - m.alias_bytes + m.temp_bytes
    assert m.alias_bytes == 1024 * 256 * 4 and donated.tensors[0].donated


def test_param_filter_and_large_abstract_shapes():
    # ~1 B bf16 parameters: nothing is allocated, only compiled.
    mesh = _mesh((2, 4), ("data", "tensor"))
    layers, d = 16, 8192
    state = {
        "params": {"w": _abstract((layers, d, d), mesh, P(None, "data", "tensor"), jnp.bfloat16)},
        "step": _abstract((), mesh, P(), jnp.int32),
    }
    x = _abstract((64, d), mesh, P("data", None), jnp.bfloat16)

    def forward(state, x):
        return _scanned_mlp(state["params"], x)

    report = explain(forward, state, x)
    assert report.params_count == layers * d * d
    assert report.params_bytes == layers * d * d * 2
    w = next(t for t in report.tensors if t.path == "state.params.w")
    assert w.shard_shape == (layers, d // 2, d // 4) and w.bytes_per_device == w.bytes // 8
    only_x = explain(forward, state, x, param_filter=lambda path: path == "x")
    assert only_x.params_count == 64 * d


def test_json_and_render(tmp_path):
    report = _scanned_report(3)
    assert isinstance(report, LayoutReport)
    data = json.loads(json.dumps(report.to_json()))
    assert set(data["mesh"]["axes"]) == {"data", "tensor"}
    assert {"count", "bytes"} <= set(data["params"])
    memory = data["memory_per_device"]
    assert memory["total_bytes"] == (
        memory["argument_bytes"]
        + memory["output_bytes"]
        - memory["alias_bytes"]
        + memory["temp_bytes"]
    )
    assert data["flops_per_device"] > 0 and data["xla_cost_analysis_flops"] > 0
    for totals in data["collective_totals"].values():
        assert {"count", "buffer_bytes", "wire_bytes"} <= set(totals)
    assert data["collectives"] and data["tensors"][0]["path"] == "params.w"
    report.write_json(tmp_path / "report.json")
    assert json.loads((tmp_path / "report.json").read_text()) == data
    console = Console(file=io.StringIO(), width=200)
    report.render(console)
    text = console.file.getvalue()
    assert "all-reduce" in text and "params.w" in text and "KiB" in text


def test_explain_is_a_function_and_its_package_has_another_name():
    """``shardlib.explain`` (the verb) and ``shardlib.analysis`` (the package) never share a
    name, so importing a submodule cannot rebind one to the other."""
    import types

    import shardlib
    import shardlib.analysis.report  # noqa: F401 - the import itself is what is tested

    assert callable(shardlib.explain) and not isinstance(shardlib.explain, types.ModuleType)
    assert isinstance(shardlib.analysis, types.ModuleType)
