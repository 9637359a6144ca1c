"""Tests of the layout report: HLO parsing on literal snippets, then real compiled programs.

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

from shardlib.explain import LayoutReport, explain, hlo
from shardlib.explain.report import ring_wire_bytes

AUTO = jax.sharding.AxisType.Auto


def _mesh(shape, names, devices=None):
    if devices is None:
        return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))
    return jax.sharding.Mesh(devices, names, axis_types=(AUTO,) * len(shape))


def _abstract(shape, mesh, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


# --- parsers on literal HLO ------------------------------------------------------------------


@pytest.mark.parametrize(
    "attrs, groups",
    [
        ("replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups={}, to_apply=%add", [list(range(8))]),
        ("replica_groups=[2,4]<=[8], use_global_device_ids=true", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%a", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=[2,4]<=[4,2]T(1,0)", [[0, 2, 4, 6], [1, 3, 5, 7]]),
        (
            "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={1}",
            [[0, 1, 2, 3], [4, 5, 6, 7]],
        ),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=@mesh<a=2,b=4> {a,b}, x=1", [list(range(8))]),
        ("replica_groups=@mesh<x=8> {x:(1)2}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=@mesh<x=8> {x:(2)4}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups=@mesh<x=4>(devices=[4]3,2,1,0) {}", [[3], [2], [1], [0]]),
        # jax 0.10 prints a device order as a bare transposed iota (seen on a 2x2x2 mesh)
        (
            "replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,4]T(1,0)) {'axis_0'}",
            [[0, 2], [4, 6], [1, 3], [5, 7]],
        ),
    ],
)
def test_replica_group_forms(attrs, groups):
    parsed = hlo.parse_replica_groups(attrs, num_devices=8)
    assert sorted(sorted(g) for g in parsed) == sorted(sorted(g) for g in groups)


def test_shapes_and_pairs():
    assert hlo.type_bytes("f32[8,1024]{1,0}") == 8 * 1024 * 4
    assert hlo.type_bytes("(bf16[2,3]{1,0}, /*index=1*/pred[], s8[4]{0})") == 12 + 1 + 4
    assert hlo.type_bytes("f8e4m3fn[16]{0}") == 16
    assert hlo.type_bytes("s4[16]{0}") == 8
    attrs = "channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}, metadata={}"
    assert hlo.parse_source_target_pairs(attrs) == [(0, 1), (1, 2), (2, 3), (3, 0)]


_COLLECTIVES_HLO = """\
HloModule m, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%async_gather (q: f32[128]) -> f32[1024] {
  %q = f32[128]{0} parameter(0)
  ROOT %wrapped_ag = f32[1024]{0} all-gather(%q), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}

ENTRY %main (p0: f32[1024], p1: f32[128], p2: f32[8,8]) -> f32[1024] {
  %as = ((f32[128]{0}), f32[1024]{0}, s32[]) async-start(%p1), calls=%async_gather
  %ad = f32[1024]{0} async-done(%as), calls=%async_gather
  %p0 = f32[1024]{0} parameter(0)
  %p1 = f32[128]{0} parameter(1)
  %p2 = f32[8,8]{1,0} parameter(2)
  %ars = f32[1024]{0} all-reduce-start(%p0), channel_id=1, replica_groups={}, to_apply=%add
  %ard = f32[1024]{0} all-reduce-done(%ars)
  %ags = (f32[128]{0}, f32[1024]{0}) all-gather-start(%p1), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  %agd = f32[1024]{0} all-gather-done(%ags)
  %tar = (f32[8,8]{1,0}, f32[1024]{0}) all-reduce(%p2, %ard), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %rs = f32[256]{0} reduce-scatter(%agd), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add
  %cp = f32[128]{0} collective-permute(%p1), channel_id=5, source_target_pairs={{0,1},{1,0}}
  ROOT %a2a = f32[1024]{0} all-to-all(%agd), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}
"""  # noqa: E501


def test_collectives_sizes_and_async_pairs_counted_once():
    module = hlo.parse_module(_COLLECTIVES_HLO)
    multipliers, warnings = hlo.call_multipliers(module)
    ops = {op.name: op for op in hlo.collectives(module, multipliers)}
    assert warnings == ()
    assert set(ops) == {"ars", "ags", "tar", "rs", "cp", "a2a", "wrapped_ag"}  # no -done ops
    assert ops["wrapped_ag"].buffer_bytes == 4096  # async-start/done wrap it: counted once
    assert ops["ars"].kind == "all-reduce" and ops["ars"].buffer_bytes == 4096
    assert len(ops["ars"].groups[0]) == 8  # {} = everyone
    assert ops["ags"].kind == "all-gather" and ops["ags"].buffer_bytes == 4096  # the result
    assert ops["tar"].buffer_bytes == 8 * 8 * 4 + 4096  # tuple operands summed
    assert ops["tar"].groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert ops["rs"].kind == "reduce-scatter" and ops["rs"].buffer_bytes == 4096  # the input
    assert ops["cp"].pairs == ((0, 1), (1, 0)) and ops["cp"].buffer_bytes == 512
    assert ops["a2a"].buffer_bytes == 4096
    assert all(op.count == 1 for op in ops.values())


_NESTED_WHILE_HLO = """\
HloModule loops, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%inner_body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %h = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %c = f32[] constant(1)
  %w = f32[16,16]{1,0} broadcast(%c), dimensions={}
  %fused = f32[8,16]{1,0} fusion(%h, %w), kind=kCustom, calls=%fused_dot
  %ar = f32[8,16]{1,0} all-reduce(%fused), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %ar)
}

%fused_dot (a: f32[8,16], b: f32[16,16]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,16]{1,0} parameter(1)
  ROOT %d = f32[8,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%inner_cond (p.1: (s32[], f32[8,16])) -> pred[] {
  %p.1 = (s32[], f32[8,16]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

%outer_body (q: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %q = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %w2 = (s32[], f32[8,16]{1,0}) while(%q), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"4"}}
}

%outer_cond (q.1: (s32[], f32[8,16])) -> pred[] {
  %q.1 = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

%unknown_body (r: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  ROOT %r = (s32[], f32[8,16]{1,0}) parameter(0)
}

ENTRY %main (e: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %e = (s32[], f32[8,16]{1,0}) parameter(0)
  %w1 = (s32[], f32[8,16]{1,0}) while(%e), condition=%outer_cond, body=%outer_body, backend_config={"known_induction_variable":{"tuple_index":"0"},"known_trip_count":{"n":"3"}}
  ROOT %w3 = (s32[], f32[8,16]{1,0}) while(%w1), condition=%outer_cond, body=%unknown_body
}
"""  # noqa: E501


def test_nested_while_trip_counts_multiply():
    module = hlo.parse_module(_NESTED_WHILE_HLO)
    multipliers, warnings = hlo.call_multipliers(module)
    assert multipliers["outer_body"] == 3
    assert multipliers["inner_body"] == multipliers["inner_cond"] == 12
    assert multipliers["fused_dot"] == 12  # fusions inherit their caller's count
    assert multipliers["add"] == 0  # reducers are accounted for by the collective
    assert multipliers["outer_cond"] == 3 + 1  # two loops use it: counts add up
    assert len(warnings) == 1 and "w3" in warnings[0]  # no known_trip_count
    (ar,) = hlo.collectives(module, multipliers)
    assert ar.count == 12 and ar.buffer_bytes == 8 * 16 * 4
    dot_flops = 2 * 8 * 16 * 16
    assert hlo.count_flops(module, multipliers) == 12 * dot_flops + 12  # + the compare


def test_a_one_trip_loop_stays_a_loop_and_counts_once():
    """``pipeline_1f1b.one_trip``: XLA would inline a plain one-trip loop (its buffers then
    live in the caller, see the function); hidden, it stays a while, counted once."""
    from shardlib.strategies.pipeline_1f1b import one_trip

    def f(x_NN):  # [8, 8]
        plain = jax.lax.fori_loop(0, 1, lambda t, c: c @ c, x_NN)
        return one_trip(lambda t, c: c @ c, plain, 0)

    compiled = jax.jit(f).lower(jax.ShapeDtypeStruct((8, 8), jnp.float32)).compile()
    module = hlo.parse_module(compiled.as_text())
    whiles = [
        i for c in module.computations.values() for i in c.instructions if i.opcode == "while"
    ]
    assert len(whiles) == 1 and hlo.trip_count(whiles[0]) == 1  # the plain loop was inlined
    multipliers, warnings = hlo.call_multipliers(module)
    assert warnings == ()
    assert hlo.count_flops(module, multipliers) >= 2 * (2 * 8 * 8 * 8)  # both matmuls, once


_CALL_AND_CONDITIONAL_HLO = """\
HloModule calls, num_partitions=8

%callee (a: f32[4,8], b: f32[8,2]) -> f32[4,2] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,2]{1,0} parameter(1)
  ROOT %d = f32[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%branch (c: f32[4,2]) -> f32[4,2] {
  %c = f32[4,2]{1,0} parameter(0)
  ROOT %cp = f32[4,2]{1,0} collective-permute(%c), source_target_pairs={{0,1},{1,0}}
}

ENTRY %main (x: f32[4,8], y: f32[8,2], p: pred[]) -> f32[4,2] {
  %x = f32[4,8]{1,0} parameter(0)
  %y = f32[8,2]{1,0} parameter(1)
  %p = pred[] parameter(2)
  %r = f32[4,2]{1,0} call(%x, %y), to_apply=%callee
  %r2 = f32[4,2]{1,0} call(%x, %y), to_apply=%callee
  ROOT %k = f32[4,2]{1,0} conditional(%p, %r, %r2), branch_computations={%branch, %branch}
}
"""


def test_call_and_conditional_edges():
    module = hlo.parse_module(_CALL_AND_CONDITIONAL_HLO)
    multipliers, _ = hlo.call_multipliers(module)
    assert multipliers == {"callee": 2, "branch": 2, "main": 1}  # callers add up
    assert hlo.count_flops(module, multipliers) == 2 * (2 * 4 * 2 * 8)
    (cp,) = hlo.collectives(module, multipliers)
    assert cp.count == 2 and cp.buffer_bytes == 4 * 2 * 4


def test_ring_wire_bytes():
    assert ring_wire_bytes("all-reduce", 800, 8) == pytest.approx(2 * 7 / 8 * 800)
    assert ring_wire_bytes("all-gather", 800, 4) == pytest.approx(600)
    assert ring_wire_bytes("reduce-scatter", 800, 2) == pytest.approx(400)
    assert ring_wire_bytes("collective-permute", 800, 4) == 800
    assert ring_wire_bytes("all-reduce", 800, 1) == 0


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


def test_package_attribute_is_the_function_after_importing_the_submodule():
    import shardlib
    import shardlib.explain  # noqa: F401 - the import itself is what is tested

    assert callable(shardlib.explain)
