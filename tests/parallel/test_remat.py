"""Rematerialisation policies and host offload: same losses, less memory, the extra forward.

One device, an 8-layer llama-tiny; each policy's train step is compiled once and both run
and measured (memory_analysis temp bytes, FLOPs with loop trips counted).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardlib import ShardingError, mesh_spec, rules_for_mesh
from shardlib.analysis import hlo, hlo_flops
from shardlib.core.layout import use_layout
from shardlib.core.mesh import single_device_mesh
from shardlib.dataset.tokens import global_batch, load_tokens
from shardlib.parallel.remat import _saved_layouts, parse_remat
from shardlib.train.config import TrainConfig, override, train_config
from shardlib.train.setup import make_setup
from shardlib.train.step import make_loss_fn

BASE = train_config(steps=3, batch=8, seq=16, warmup=1, **{"model.layers": 8})
POLICIES = (
    "none",
    "full",
    "dots",
    "selective",
    "names:mlp_hidden,attn_context",
    "offload:mlp_hidden",
)


def _cfg(**overrides) -> TrainConfig:
    return override(BASE, overrides)


@pytest.fixture(scope="module")
def runs():
    """policy -> (losses and grad norms of 3 steps, temp bytes, FLOPs, optimized HLO)."""
    cache = {}
    initial = {}

    def get(**overrides):
        key = tuple(sorted(overrides.items()))
        if key not in cache:
            setup = make_setup(_cfg(**overrides), single_device_mesh())
            lowered = setup.train_step.lower(setup.abstract_state(), setup.abstract_batch())
            exe = lowered.compile()
            if not initial:  # every policy starts from the same parameters
                initial["state"] = jax.device_get(setup.init_state())
            state = jax.device_put(initial["state"], setup.state_shardings)
            tokens, out = load_tokens(None), []
            for step in range(setup.cfg.run.steps):
                cfg = setup.cfg
                batch = global_batch(
                    tokens,
                    step,
                    cfg.dataset.batch,
                    cfg.dataset.seq,
                    cfg.run.seed,
                    setup.batch_sharding,
                )
                state, metrics = exe(state, batch)
                out.append((float(metrics["loss"]), float(metrics["grad_norm"])))
            module = hlo.parse_module(exe.as_text())
            flops = hlo_flops.count_flops(module, hlo.call_multipliers(module)[0])
            temp = exe.memory_analysis().temp_size_in_bytes
            cache[key] = (np.array(out), temp, flops, exe.as_text())
        return cache[key]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES[1:])
def test_remat_policy_trains_exactly_like_none(policy, runs):
    got, ref = runs(remat=policy)[0], runs(remat="none")[0]
    assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-6, (policy, got, ref)


@pytest.mark.slow
def test_remat_memory_and_the_extra_forward(runs):
    """temp bytes: full < dots < none and full < selective < none (selective drops the
    attention scores that dots keeps); full remat costs about one more forward (~1.33x)."""
    none, dots, full = (runs(remat=p) for p in ("none", "dots", "full"))
    selective = runs(remat="selective")
    assert full[1] < dots[1] < none[1], (none[1], dots[1], full[1])
    assert full[1] < selective[1] < none[1], (none[1], selective[1], full[1])
    assert 1.2 <= full[2] / none[2] <= 1.4, full[2] / none[2]


@pytest.mark.slow
def test_offload_moves_named_residuals_to_host():
    """The gradient program stores the named residuals in host memory space (``<host>``).

    The CPU backend lowers memory-space moves to plain copies, so ``memory_analysis()``
    reports no host bytes here; on GPU/TPU the same program carries the placement.
    """
    setup = make_setup(_cfg(remat="offload:mlp_hidden"), single_device_mesh())
    loss_fn = make_loss_fn(setup)
    params = setup.abstract_state()["params"]
    jaxpr = str(jax.make_jaxpr(jax.grad(loss_fn))(params, setup.abstract_batch()))
    assert "f32<host>[8,16,256]" in jaxpr  # [batch, seq, mlp] per layer: mlp_hidden
    plain = make_setup(_cfg(remat="names:mlp_hidden"), single_device_mesh())
    assert "<host>" not in str(
        jax.make_jaxpr(jax.grad(make_loss_fn(plain)))(params, setup.abstract_batch())
    )


@pytest.mark.slow
def test_offloaded_parameters_live_on_host_and_train_the_same(runs):
    out, _, _, text = runs(offload_params=True)
    assert np.abs(out - runs(remat="none")[0]).max() / np.abs(out).max() <= 1e-6
    assert "S(5)" in text  # the stacked weights' memory space in the compiled program
    setup = make_setup(_cfg(offload_params=True), single_device_mesh())
    kinds = {s.memory_kind for s in jax.tree.leaves(setup.param_shardings["blocks"])}
    assert kinds == {"pinned_host"}


def test_bad_remat_settings_are_clear_errors():
    with pytest.raises(ShardingError, match="unknown mode"):
        parse_remat("some")
    with pytest.raises(ShardingError, match="names no intermediate 'mlp_out'"):
        make_setup(_cfg(remat="names:mlp_out"), single_device_mesh())


@pytest.mark.parametrize(
    ("axes", "sp", "part"),
    [
        ({"tensor": 8}, False, P("tensor")),  # replicated over tensor: split, flattened
        ({"data": 2, "fsdp": 2, "tensor": 2}, False, P(("data", "fsdp", "tensor"))),
        ({"fsdp": 8}, False, None),  # no tensor axis
        ({"tensor": 4}, True, None),  # sequence parallel splits the residual already
        ({"tensor": 2, "tensor2": 2}, False, None),  # 2D: so does the width split
    ],
)
def test_full_remat_splits_saved_inputs_only_where_tensor_replicates_them(axes, sp, part):
    """Megatron's distribute-saved-activations: the block input full remat keeps is split
    over ``tensor`` when the residual stream is whole there, and left alone otherwise."""
    mesh = mesh_spec(**axes).build(jax.devices()[: int(np.prod(list(axes.values())))])
    x = jnp.zeros((8, 16, 64))
    with use_layout(mesh, rules_for_mesh(mesh, sequence_parallel=sp)):
        layouts = _saved_layouts(x)
    assert (None if layouts is None else layouts[1].spec) == part


@pytest.mark.slow
def test_a_recomputed_block_gathers_its_fsdp_weights_once_more_not_twice():
    """GPT's fused q/k/v product stacks its weights in a checkpoint of its own, rebuilt in
    the backward pass (``ops.stacked_matmul``: under remat=none the layer loop would keep
    the copy per layer). Inside a recomputed block that rebuild gathered the FSDP-split
    weights a third time (gpt-tiny h 256, 4 layers, fsdp 8, remat=full: 46.2 MiB on the wire
    where the planner books 43.7 and remat=selective compiles 43.6); a recomputed block keeps the
    copy, which lives one layer there (``ops.recomputed``)."""
    from shardlib.planner import Workload, candidate
    from shardlib.planner.validate import validate

    w = Workload.from_preset("gpt-tiny", 16, 128, "fp32", layers=4, embed=256, heads=8, mlp=1024)
    check = validate(w, candidate(fsdp=8, remat="full"))
    assert check.compiled_wire == pytest.approx(check.predicted_wire, rel=0.01), check
