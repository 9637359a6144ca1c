"""The HLO reader on literal snippets: replica groups, collectives, loop trip counts, FLOPs.

Literal text pins the parsing rules down independently of what a jax version happens to emit;
the compiled-program checks of the same readers are in test_explain.py.
"""

import jax
import jax.numpy as jnp
import pytest

from shardlib.analysis import hlo, hlo_flops
from shardlib.analysis.report import ring_wire_bytes

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
    assert hlo_flops.count_flops(module, multipliers) == 12 * dot_flops + 12  # + the compare


def test_a_one_trip_loop_stays_a_loop_and_counts_once():
    """``pipeline_1f1b.one_trip``: XLA would inline a plain one-trip loop (its buffers then
    live in the caller, see the function); hidden, it stays a while, counted once."""
    from shardlib.parallel.pipeline.one_f_one_b import one_trip

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
    assert hlo_flops.count_flops(module, multipliers) >= 2 * (2 * 8 * 8 * 8)  # both matmuls, once


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
    assert hlo_flops.count_flops(module, multipliers) == 2 * (2 * 4 * 2 * 8)
    (cp,) = hlo.collectives(module, multipliers)
    assert cp.count == 2 and cp.buffer_bytes == 4 * 2 * 4


def test_ring_wire_bytes():
    assert ring_wire_bytes("all-reduce", 800, 8) == pytest.approx(2 * 7 / 8 * 800)
    assert ring_wire_bytes("all-gather", 800, 4) == pytest.approx(600)
    assert ring_wire_bytes("reduce-scatter", 800, 2) == pytest.approx(400)
    assert ring_wire_bytes("collective-permute", 800, 4) == 800
    assert ring_wire_bytes("all-reduce", 800, 1) == 0


def test_a_collective_without_user_code_is_credited_to_shardlibs_step_not_runpy():
    """Under ``python -m shardlib...`` the outermost frame is ``<frozen runpy>``, which is
    not a library path: it was once named as the "user" line of the optimizer's sums."""
    from pathlib import Path

    from shardlib.analysis import attribute

    step = Path(attribute.__file__).resolve().parents[1] / "train" / "step.py"
    text = f"""FileNames
1 "<frozen runpy>"
2 "{step}"
3 "/venv/lib/python3.11/site-packages/optax/tree_utils/_tree_math.py"

FunctionNames
1 "_run_code"
2 "train_step"
3 "tree_sum"

FileLocations
1 {{file_name_id=1 function_name_id=1 line=88 end_line=88 column=4 end_column=4}}
2 {{file_name_id=2 function_name_id=2 line=259 end_line=259 column=4 end_column=4}}
3 {{file_name_id=3 function_name_id=3 line=187 end_line=187 column=4 end_column=4}}

StackFrames
1 {{file_location_id=1 parent_frame_id=1}}
2 {{file_location_id=2 parent_frame_id=2}}
3 {{file_location_id=3 parent_frame_id=3}}
"""
    frames = attribute.stack_frames(text)  # 3 (optax) <- 2 (shardlib's step) <- 1 (runpy)
    assert frames[3] == "step.py:259 in train_step"
    assert frames[1] == "<frozen runpy>:88 in _run_code"  # nothing else to name: itself
