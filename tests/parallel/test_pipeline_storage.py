"""Interleaved pipelines keep the stacked layers in stage order (``pipeline/storage.py``).

The order is checked row by row against Megatron's placement, the compiled step is checked
to move no weights over ``stage`` (its stage traffic is the hand-overs alone), and the order
never leaks out: a checkpoint written under v = 2 resumes under another plan, exports the
model's own layer order, and 1F1B's evaluation loop reads the rows in order.
"""

import math

import jax
import numpy as np
import pytest

from shardlib import mesh_spec
from shardlib.analysis import explain
from shardlib.checkpoint.store import read_meta, restore
from shardlib.core.mesh import single_device_mesh
from shardlib.dataset.tokens import global_batch, load_tokens
from shardlib.interop.export import read_params
from shardlib.parallel.pipeline.storage import LayerOrder, map_blocks
from shardlib.parallel.pipeline.views import to_stages
from shardlib.tools.parity import FP32_TOLERANCE, random_state
from shardlib.train.config import override, train_config
from shardlib.train.loop import run
from shardlib.train.setup import make_setup
from shardlib.train.step import build_eval_step


def test_stored_row_j_holds_the_layer_megatron_places_there():
    """p = 2, v = 3, k = 2: stored row s·(v·k) + r·k + i holds layer (r·p + s)·k + i."""
    p, v, k = 2, 3, 2
    order = LayerOrder(p, v)
    rows = order.store_rows(np.arange(p * v * k))
    for s in range(p):
        for r in range(v):
            for i in range(k):
                assert rows[s * v * k + r * k + i] == (r * p + s) * k + i
    assert np.array_equal(order.natural_rows(rows), np.arange(p * v * k))
    # the pipeline's [p, v, k] view: a reshape of stored rows, a regrouping of natural ones
    natural = np.arange(p * v * k * 3, dtype=np.float32).reshape(p * v * k, 3)
    assert np.array_equal(
        to_stages(order.store_rows(natural), None, p, v, stored=True),
        to_stages(natural, None, p, v),
    )


def test_natural_order_where_no_interleaving():
    for order in (LayerOrder(), LayerOrder(4, 1), LayerOrder(1, 2)):
        assert order.natural
        x = np.arange(8)
        assert order.store_rows(x) is x
    assert LayerOrder.from_meta({}) == LayerOrder()  # checkpoints from before the order
    assert LayerOrder.from_meta({"layer_order": {"stages": 2, "virtual": 2}}) == LayerOrder(2, 2)


def test_only_stacked_leaves_under_blocks_move():
    order = LayerOrder(2, 2)
    tree = {
        "params": {"blocks": {"w": np.arange(8)}, "embedding": np.arange(8)},
        "opt_state": ({"mu": {"blocks": {"w": np.arange(8)}}}, {"count": np.int32(3)}),
    }
    moved = map_blocks(order.store_rows, tree, 8)
    assert list(moved["params"]["blocks"]["w"]) == [0, 1, 4, 5, 2, 3, 6, 7]
    assert list(moved["opt_state"][0]["mu"]["blocks"]["w"]) == [0, 1, 4, 5, 2, 3, 6, 7]
    assert list(moved["params"]["embedding"]) == list(range(8))


# 4 layers: p = 2 stages x v = 2 virtual stages of one layer each; 8 steps
PIPE = {"stage": 2, "tensor": 2, "data": 2}
CFG = train_config(
    steps=8,
    batch=8,
    seq=16,
    warmup=1,
    **{"model.layers": 4},
    pipeline_schedule="1f1b",
    virtual_stages=2,
    pipeline_microbatches=2,
)


def _setup(cfg, axes):
    if axes is None:
        return make_setup(cfg, single_device_mesh())
    mesh = mesh_spec(**axes).build(jax.devices()[: math.prod(axes.values())])
    return make_setup(cfg, mesh)


@pytest.mark.slow
def test_interleaved_step_moves_no_weights_over_stage():
    """The compiled v = 2 step's stage-axis collectives are the hand-overs (and scalars):
    no all-to-all, and no permute of a weight-sized buffer."""
    setup = _setup(CFG, PIPE)
    assert setup.layer_order == LayerOrder(2, 2)
    report = explain(
        setup.train_step, setup.abstract_state(), setup.abstract_batch(), mesh=setup.mesh
    )
    stage = [c for c in report.collectives if c.axes == ("stage",)]
    assert not [c for c in stage if c.kind == "all-to-all"], stage
    handover = CFG.dataset.batch // 2 // 2 * 16 * setup.model_cfg.embed * 4 // 2  # b·s·h·w/t
    assert max(c.buffer_bytes for c in stage) <= handover, stage


@pytest.mark.slow
def test_interleaved_checkpoint_resumes_under_another_plan_and_exports_layer_order(tmp_path):
    """Saved under 1F1B v = 2 (stage order), restored on one device (natural order): the
    next losses match the uninterrupted pipelined run's, and the export is in layer order."""
    cfg = override(CFG, {"checkpoint_dir": str(tmp_path / "run"), "checkpoint_every": 4})
    pipe = _setup(cfg, PIPE)
    state = random_state(pipe)
    start = jax.device_put(pipe.stored(state), pipe.state_shardings)
    whole = run(pipe, state=start, show=False)
    assert read_meta(tmp_path / "run", 4)[1]["layer_order"] == {"stages": 2, "virtual": 2}
    one = _setup(override(CFG, {"checkpoint_dir": None}), None)
    restored = restore(tmp_path / "run", one, step=4)
    assert one.layer_order.natural
    continued = run(one, state=restored.state, show=False, stop_after=8).losses
    reference = np.array(whole.losses[4:])
    assert np.max(np.abs(np.array(continued) - reference) / reference) <= FP32_TOLERANCE
    # the export (and init_from, generate: the same reader) sees the model's layer order
    _, saved, _ = read_params(tmp_path / "run", 8)
    final = jax.device_get(pipe.natural(whole.state["params"]))
    for name, x in saved.items():
        path = name.split("/")
        want = final
        for part in path:
            want = want[part]
        assert np.array_equal(x, want), name
    # and back into stage order: a v = 2 run resuming its own checkpoint restores as saved
    again = restore(tmp_path / "run", pipe, step=8)
    for a, b in zip(jax.tree.leaves(again.state), jax.tree.leaves(whole.state), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_1f1b_evaluation_reads_stage_ordered_rows_in_layer_order():
    pipe, one = _setup(CFG, PIPE), _setup(CFG, None)
    state = random_state(one)
    tokens = load_tokens(None)
    got = build_eval_step(pipe)(
        jax.device_put(pipe.stored(state)["params"], pipe.param_shardings),
        global_batch(tokens, 0, 8, 16, 0, pipe.batch_sharding),
    )
    want = build_eval_step(one)(
        state["params"], global_batch(tokens, 0, 8, 16, 0, one.batch_sharding)
    )
    assert abs(float(got[0]) - float(want[0])) <= FP32_TOLERANCE * abs(float(want[0]))
