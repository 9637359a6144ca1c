"""Held-out evaluation of a user's model (``eval_every``, ``Batches.held_out``).

``own_bn_model`` has BatchNorm and Dropout, so eval mode matters: the evaluation must be the
user's loss (and metrics) on the held-out batches with the model in eval mode (no dropout,
BatchNorm's running statistics), which a one-device ``model.eval()`` of the trained state
reproduces within 1e-5. Without held-out batches ``eval_every`` is refused before compiling.
"""

import jax
import numpy as np
import pytest
from flax import nnx

import shardlib
from shardlib.core.errors import ShardingError
from shardlib.core.mesh import mesh_spec
from shardlib.parallel.plan import ParallelPlan
from shardlib.train.loop import Evaluation, run

TOL = 1e-5


@pytest.fixture(scope="module")
def own():
    import own_bn_model

    return own_bn_model


def _setup(own, held_out, **settings):
    spec = mesh_spec(data=2)
    cfg = shardlib.user_config(ParallelPlan(mesh=spec), precision="fp32", **settings)
    data = shardlib.Batches(own.batches().source, own.NAMES, "own_bn", held_out=held_out)
    mesh = spec.build(jax.devices()[:2])
    return shardlib.make_model_setup(cfg, own.make_model, _with_metrics(own), data, mesh)


def _with_metrics(own):
    def loss_fn(model, batch):
        loss = own.loss_fn(model, batch)
        return loss, {"twice": 2 * loss}

    return loss_fn


def test_eval_every_without_held_out_batches_is_refused(own):
    setup = _setup(own, None, steps=1, eval_every=1)
    with pytest.raises(ShardingError, match="held_out=eval_source"):
        run(setup, show=False)


@pytest.mark.slow
def test_held_out_loss_is_the_users_loss_in_eval_mode(own):
    """The run's ``Evaluation`` (what ``eval_every`` calls) on the initial state: one
    compiled eval step, no train step."""
    held = [own._examples(10 + i) for i in range(3)]  # 3 given, eval_batches=2 read
    setup = _setup(own, held, steps=1, eval_every=1, eval_batches=2)
    state = setup.init_state()
    got = Evaluation(setup, setup.open_data())(state)
    assert set(got) == {"eval_loss", "eval_twice"}  # no perplexity: the user's own loss
    assert got["eval_twice"] == pytest.approx(2 * got["eval_loss"], rel=TOL)
    one = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]), state)
    model = setup.trained_model(one)
    model.eval()  # no dropout, BatchNorm on its running statistics
    with nnx.use_eager_sharding(False):
        want = np.mean([float(own.loss_fn(model, b)) for b in held[:2]])
        assert abs(got["eval_loss"] - want) <= TOL * want
        model.train()  # in train mode the same batches give another loss
        assert abs(float(own.loss_fn(model, held[0])) - want) > 1e-3


class Dropped(nnx.Module):
    """``w · dropout(ones)``: the gradient of ``w`` is the dropout mask (times 2)."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.ones, ("embed",))
        self.w = nnx.Param(init(rngs.params(), (64,)))  # [embed]
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x_BD):
        return (self.drop(x_BD) * self.w[...]).sum(-1)


def test_each_micro_batch_draws_its_own_dropout_mask():
    """Two micro-batches of the same row: with one key they would draw one mask and the
    averaged gradient would be 0 or 2 everywhere; with their own keys it is 1 somewhere."""
    from shardlib.core.layout import use_layout
    from shardlib.train.step import grad_function
    from shardlib.train.user_state import MODEL_STATE

    def loss_fn(model, batch):
        return model(batch["x"]).mean()

    spec = mesh_spec(data=1)
    cfg = shardlib.user_config(ParallelPlan(mesh=spec), parallel__data__microbatches=2)
    rows = [{"x": np.ones((2, 64), np.float32)}]
    data = shardlib.Batches(rows, {"x": ("batch", "embed")}, "rows")
    setup = shardlib.make_model_setup(cfg, Dropped, loss_fn, data, spec.build(jax.devices()[:1]))
    state = setup.init_state()
    loss = setup.user_loss.given(state[MODEL_STATE])

    @jax.jit
    def grads(params, batch):
        with use_layout(setup.mesh, setup.rules):
            return grad_function(setup, loss, has_aux=True)(params, batch)[1]

    g = np.asarray(grads(state["params"], {"x": np.ones((2, 64), np.float32)})["w"])
    assert set(np.unique(g)) <= {0.0, 1.0, 2.0}
    assert 1.0 in g  # the two masks differ
