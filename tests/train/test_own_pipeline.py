"""A pipeline for a user's model whose blocks are a stack (``train.user_pipeline``).

``own_stack_model`` is a classifier of the user's own whose blocks are built with
``nnx.vmap`` and applied with ``shardlib.run_stack``. Under stage 2 x data 2 the GPipe and
1F1B schedules must give one device's loss and every gradient leaf (fp32, rel err <= 1e-5),
through the trainer's own gradient path (``grad_function`` of the setup's loss). What a
pipeline cannot run is refused at setup, before anything compiles, naming the fix.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import shardlib
from shardlib.core.errors import ShardingError
from shardlib.core.layout import use_layout
from shardlib.core.mesh import mesh_spec
from shardlib.parallel.plan import ParallelPlan
from shardlib.train.step import grad_function

TOL = 1e-5


@pytest.fixture(scope="module")
def own():
    import own_stack_model

    return own_stack_model


def _setup(own, schedule="gpipe", model=None, loss=None, **axes):
    spec = mesh_spec(**(axes or {"stage": 2, "data": 2}))
    mesh = spec.build(jax.devices()[: spec.fixed_size])
    cfg = shardlib.user_config(
        ParallelPlan(mesh=spec), precision="fp32", parallel__pipeline__schedule=schedule
    )
    return shardlib.make_model_setup(
        cfg, model or own.make_model, loss or own.loss_fn, own.batches(), mesh
    )


@pytest.fixture(scope="module")
def reference(own):
    """One device: the model's own forward (``run_stack`` is a plain scan there)."""
    with nnx.use_eager_sharding(False):
        model = own.make_model(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    batch = own.batches().source[0]

    def loss(p, b):
        return own.loss_fn(nnx.merge(graphdef, p), b)[0]

    value, grads = jax.jit(jax.value_and_grad(loss))(params, batch)
    return params, batch, value, grads


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stacked_model_pipelines_like_one_device(own, reference, schedule):
    params, batch, value, grads = reference
    setup = _setup(own, schedule)
    assert setup.workload.blocks == own.LAYERS
    grad_fn = grad_function(setup, setup.user_loss, has_aux=True)

    def step(p, b):
        with use_layout(setup.mesh, setup.rules):
            return grad_fn(p, b)

    (loss, _), got = jax.jit(step)(params, batch)
    assert abs(float(loss) - float(value)) <= TOL * abs(float(value))
    flat = jax.tree_util.tree_leaves_with_path(grads)
    assert len(flat) == len(jax.tree.leaves(got))
    for (path, want), have in zip(flat, jax.tree.leaves(got), strict=True):
        err = float(jnp.linalg.norm(have - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30))
        assert err <= TOL, (jax.tree_util.keystr(path), err)
    # the stacked weights live on their stage: each device holds half the layers
    kernel = setup.param_shardings["blocks"]["up"]["kernel"]
    assert kernel.spec[0] == "stage"


def test_a_model_without_a_stack_is_refused_on_a_stage_axis(own):
    with pytest.raises(ShardingError) as err:
        _setup(own, model=own.make_flat)
    text = str(err.value)
    assert "cannot run on the stage axis (2 stages)" in text
    assert "blocks.0." in text and "not a leading 'layers' dim" in text
    assert "nnx.vmap" in text and "run_stack" in text and "without a stage axis" in text


def test_a_loss_that_does_not_run_its_stack_once_is_refused(own):
    def twice(model, batch):
        x = model.patch(own.patches(batch["image"]))
        x = shardlib.run_stack(model.blocks, shardlib.run_stack(model.blocks, x))
        return x.mean()

    with pytest.raises(ShardingError, match="run_stack 2 times.*Fix: apply self.blocks"):
        _setup(own, loss=twice)

    def flat_carry(model, batch):  # [batch, embed] between the blocks: not a pipeline buffer
        x = model.patch(own.patches(batch["image"])).mean(1)
        return shardlib.run_stack(model.blocks, x).mean()

    with pytest.raises(ShardingError, match=r"shape \(8, 16\).*Fix: carry x as \[batch"):
        _setup(own, loss=flat_carry)


def test_schedules_for_token_rows_and_model_state_are_refused(own):
    with pytest.raises(ShardingError, match="schedule=chimera runs token rows only"):
        _setup(own, "chimera")

    def with_dropout(rngs):
        model = own.make_model(rngs)
        model.drop = nnx.Dropout(0.1, rngs=rngs)
        return model

    with pytest.raises(ShardingError, match="holds state besides its parameters"):
        _setup(own, model=with_dropout)


def test_run_stack_is_a_scan_on_one_device(own):
    """Outside a trainer ``run_stack`` applies the blocks in order, as a loop would."""
    with nnx.use_eager_sharding(False):
        graph, state = nnx.split(own.make_model(nnx.Rngs(0)).blocks)

    @jax.jit
    def both(state, x):
        looped = x
        for i in range(own.LAYERS):
            looped = nnx.merge(graph, jax.tree.map(lambda w, i=i: w[i], state))(looped)
        return shardlib.run_stack(nnx.merge(graph, state), x), looped

    x = jax.random.normal(jax.random.key(0), (2, 4, own.EMBED))
    stacked, looped = both(state, x)
    np.testing.assert_allclose(stacked, looped, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(stacked - x).max()) > 1e-2  # the blocks did something
