"""The generic trainer: a classifier of the user's own (``own_classifier_model``, defined in
this directory, not in ``models/``) trained through its own loss, from Python and from the
command line, on the 2 x 2 x 2 preset with ZeRO-3 and full remat.

One run is killed after step 2 (``stop_after``, what a preemption does) and resumed, once
from Python and once from the command line; both must reproduce the uninterrupted run's
losses bit for bit, and the uninterrupted run must match one device within 1e-5. The
refusals (what needs the decoder protocol or token data) run first and compile nothing.
"""

import json

import jax
import numpy as np
import pytest

import shardlib
from shardlib.core.errors import ShardingError
from shardlib.tools import cli
from shardlib.train.loop import run

MODULE = "own_classifier_model"
SETTINGS = {"steps": 4, "precision": "fp32", "zero": 3, "remat": "full"}
CLI_WORDS = [f"model={MODULE}:make_model", f"loss={MODULE}:loss_fn", "precision=fp32"]
CLI_WORDS += ["zero=3", "remat=full", "steps=4"]


@pytest.fixture(scope="module")
def own():
    import own_classifier_model

    return own_classifier_model


def _setup(own, data=None, mesh=None, plan="cpu-8-3d", **settings):
    cfg = shardlib.user_config(plan, **(SETTINGS | settings))
    return shardlib.make_model_setup(cfg, own.make_model, own.loss_fn, data or own.batches(), mesh)


@pytest.fixture(scope="module")
def runs(own, tmp_path_factory):
    """One setup (one compile): uninterrupted, then killed after step 2 (its checkpoint
    copied for the command line) and resumed, in the same directory (emptied in between)."""
    import shutil

    ckpt = tmp_path_factory.mktemp("own") / "ckpt"
    setup = _setup(own, own.stream(), checkpoint_dir=str(ckpt))
    whole = run(setup, show=False)
    shutil.rmtree(ckpt)
    first = run(setup, show=False, stop_after=2)
    killed = ckpt.with_name("killed")  # a copy left at step 2 for the command line
    shutil.copytree(ckpt, killed, ignore=shutil.ignore_patterns("*.lock"))
    second = run(setup, show=False)
    return setup, whole, first, second, killed


@pytest.mark.slow
def test_python_api_resumes_exactly_after_a_kill(runs):
    setup, whole, first, second, _ = runs
    assert first.stopped_by == "stop_after=2" and len(first.losses) == 2
    assert first.losses + second.losses == whole.losses  # bit for bit
    assert whole.losses[-1] < whole.losses[0]  # it learns
    record = whole.records[-1]
    assert 0 <= record["accuracy"] <= 1 and record["examples_per_s"] > 0
    assert 0 < record["mfu"] == record["hfu"]  # the compiled step's FLOPs
    # ZeRO-3: parameters and Adam's moments split over data and fsdp (4 ways) at least
    kernel = whole.state["params"]["blocks"][0]["up"]["kernel"]
    assert kernel.addressable_shards[0].data.size * 4 <= kernel.size
    assert "data" in str(kernel.sharding.spec) and "fsdp" in str(kernel.sharding.spec)


@pytest.mark.slow
def test_command_line_resumes_the_killed_run_exactly(runs, tmp_path, capsys):
    _, whole, first, _, ckpt = runs
    jsonl = tmp_path / "metrics.jsonl"
    words = [*CLI_WORDS, f"data={MODULE}:batches", f"checkpoint_dir={ckpt}", f"jsonl={jsonl}"]
    code = cli.main(["train", "--mesh", "cpu-8-3d", *words])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "resumed from" in err and "examples/s" in err
    resumed = [json.loads(line)["loss"] for line in jsonl.read_text().splitlines()]
    assert first.losses + resumed == whole.losses  # bit for bit
    # a decoder-only command refuses the checkpoint, with the reason
    assert cli.main(["generate", "--checkpoint", str(ckpt), "--prompt", "x"]) == 2
    assert "trained through its own loss" in capsys.readouterr().err


@pytest.mark.slow
def test_parity_from_the_command_line(capsys):
    words = [*CLI_WORDS, f"data={MODULE}:batches", "steps=2"]
    assert cli.main(["parity", "--mesh", "cpu-8-3d", *words]) == 0
    err = capsys.readouterr().err
    assert "PARITY OK" in err and "gradient error" not in err


@pytest.mark.slow
def test_optimizer_offload_keeps_the_losses(own, runs):
    """A model without the decoder's stacked blocks takes the whole-state update under
    ``offload_optimizer`` (the streamed one walks ``[layers, ...]`` rows): the same losses
    as in device memory, its moments kept in host memory; under fp16 a skipped step keeps
    the state it read in device memory (no host/device mix). One-device parity: the
    command line's ``parity`` test above."""
    whole = runs[1]
    setup = _setup(own, own.stream(), offload_optimizer=True)
    offloaded = run(setup, show=False)
    err = max(abs(a - b) / abs(b) for a, b in zip(offloaded.losses, whole.losses, strict=True))
    assert err <= 1e-6, (offloaded.losses, whole.losses)
    moments = jax.tree.leaves(offloaded.state["opt_state"])
    assert any(getattr(x.sharding, "memory_kind", None) == "pinned_host" for x in moments)
    fp16 = run(
        _setup(own, own.stream(), offload_optimizer=True, precision="fp16", steps=2), show=False
    )
    assert all(np.isfinite(fp16.losses))


# --- refused before anything is compiled ------------------------------------------------


def test_the_token_trainer_points_a_classifier_to_loss_and_data(capsys):
    code = cli.main(["train", f"model={MODULE}:make_model", "steps=1"])
    err = capsys.readouterr().err
    assert code == 2 and "is not a decoder" in err and "loss=pkg.mod:loss_fn" in err
    assert "nnx.vmap" not in err and "model.vocab" not in err


def test_loss_without_data_is_refused(capsys):
    assert cli.main(["train", *CLI_WORDS]) == 2
    assert "data=pkg.mod:NAME" in capsys.readouterr().err


@pytest.mark.parametrize(
    "settings, needle",
    [
        ({"plan": "cpu-8-pipeline"}, "cannot run on the stage axis"),
        ({"precision": "fp8"}, "precision=fp8"),
        ({"dataset__path": "tokens.bin"}, "dataset.path / mix"),
        ({"parallel__data__microbatches": 3}, "does not split into microbatches=3"),
    ],
)
def test_decoder_only_settings_are_refused_with_the_reason(own, settings, needle):
    with pytest.raises(ShardingError, match="Fix:") as err:
        _setup(own, **settings)
    assert needle in str(err.value)


def test_batches_are_checked_against_their_names(own):
    bad_rank = shardlib.Batches(own.batches().source, {"image": ("batch",), "label": ("batch",)})
    with pytest.raises(ShardingError, match=r"\['image'\] has shape \(8, 8, 8, 3\)"):
        _setup(own, bad_rank)
    odd = [{"image": np.zeros((6, 8, 8, 3), np.float32), "label": np.zeros(6, np.int32)}]
    with pytest.raises(ShardingError, match="batch"):
        _setup(own, shardlib.Batches(odd, own.NAMES))  # 6 rows over data x fsdp = 4
    with pytest.raises(ShardingError, match="names="):
        shardlib.Batches(odd, {"image": "batch"})


def test_remat_needs_layers(own):
    from flax import nnx

    class Bare(nnx.Module):  # one weight, no sub-module: nothing to recompute per layer
        def __init__(self, rngs):
            self.w = nnx.Param(nnx.with_partitioning(nnx.initializers.ones, ("embed",))(None, (4,)))

    with pytest.raises(ShardingError, match="no layers to recompute"):
        cfg = shardlib.user_config("cpu-8-3d", **SETTINGS)
        shardlib.make_model_setup(cfg, Bare, own.loss_fn, own.batches())


@pytest.mark.slow
def test_remat_without_a_list_wraps_each_sub_module_and_keeps_the_gradient(own):
    import jax.numpy as jnp
    from flax import nnx

    from shardlib.parallel.remat import parse_remat
    from shardlib.train.user_model import UserLoss, remat_layers

    block = shardlib.build_model(lambda: own.Block(nnx.Rngs(0)))  # sub-modules, no list
    graphdef, params = nnx.split(block, nnx.Param)
    params = nnx.to_pure_dict(params)
    x_BPD = jnp.linspace(-1, 1, 2 * 4 * own.EMBED).reshape(2, 4, own.EMBED)

    def grads(mode):
        loss = UserLoss(graphdef, lambda m, b: (m(b).sum(), {}), jnp.float32, parse_remat(mode))
        return jax.jit(jax.grad(lambda p: loss(p, x_BPD)[0]))(params)

    assert remat_layers(nnx.merge(graphdef, params), parse_remat("full")) == 6
    plain, remat = grads("none"), grads("full")
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # recompute's round-off


def test_a_factory_of_no_arguments_is_taken_too(own):
    from flax import nnx

    cfg = shardlib.user_config("cpu-8-3d", **SETTINGS)
    plain = shardlib.make_model_setup(cfg, own.make_model, own.loss_fn, own.batches())
    bare = shardlib.make_model_setup(
        cfg, lambda: own.make_model(nnx.Rngs(0)), own.loss_fn, own.batches()
    )
    assert bare.inventory.param_count == plain.inventory.param_count > 0
    assert bare.param_specs == plain.param_specs
