"""Chunked loss (``parallel.loss``): the head and cross-entropy in slices of the sequence
give the loss and gradients of the whole logits (fp32, 1e-5 relative), alone, through the
trainer's loss (packed weights, an MoE model's auxiliary loss) and on every layout that
runs the head (data, FSDP's vocab-parallel head, tensor, context, GPipe and 1F1B); a slice
that cannot divide is refused before compiling, naming the setting."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from layout_cases import assert_parity, assert_refused, first_devices_mesh

from shardlib.core.layout import use_layout
from shardlib.parallel.loss import chunked_cross_entropy, replica_axes
from shardlib.parallel.mesh_rules import rules_for_mesh
from shardlib.tools.parity import FP32_TOLERANCE, compare, random_state
from shardlib.train.config import parse_overrides, train_config
from shardlib.train.setup import make_setup
from shardlib.train.step import make_loss_fn


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


# --- the function against whole logits --------------------------------------------------


def _whole(w_DV, x_BLD, targets_BL, weights_BL):
    logits_BLV = jnp.einsum("bld,dv->blv", x_BLD, w_DV)  # [batch, seq, vocab]
    ce_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL)
    return ce_BL.mean() if weights_BL is None else (ce_BL * weights_BL).mean()


def _chunked(chunk):
    def loss(w_DV, x_BLD, targets_BL, weights_BL):
        head = lambda w, x_BCD: jnp.einsum("bcd,dv->bcv", x_BCD, w)  # noqa: E731
        return chunked_cross_entropy(head, w_DV, x_BLD, targets_BL, weights_BL, chunk=chunk)

    return loss


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_chunked_cross_entropy_matches_the_whole_logits(chunk, weighted):
    rng = np.random.default_rng(0)
    w_DV = jnp.asarray(rng.normal(0, 0.3, (8, 96)), jnp.float32)  # [embed, vocab]
    x_BLD = jnp.asarray(rng.normal(0, 1, (3, 16, 8)), jnp.float32)  # [batch, seq, embed]
    targets_BL = jnp.asarray(rng.integers(0, 96, (3, 16)))
    weights_BL = jnp.asarray(rng.integers(0, 2, (3, 16)) * 1.7, jnp.float32) if weighted else None
    grad = jax.value_and_grad
    want, (gw_want, gx_want) = jax.jit(grad(_whole, (0, 1)))(w_DV, x_BLD, targets_BL, weights_BL)
    got, (gw, gx) = jax.jit(grad(_chunked(chunk), (0, 1)))(w_DV, x_BLD, targets_BL, weights_BL)
    assert abs(float(got) - float(want)) <= FP32_TOLERANCE * abs(float(want))
    assert _rel(gw, gw_want) <= FP32_TOLERANCE and _rel(gx, gx_want) <= FP32_TOLERANCE


@pytest.mark.parametrize("weighted", [False, True])
def test_replica_groups_match_the_whole_logits(weighted):
    """Under data parallelism each replica group runs its slices with its own copy of the
    weights (``replica_axes``), the gradients summed after the loop: the same numbers."""
    mesh = first_devices_mesh(data=4, tensor=2)
    rules = rules_for_mesh(mesh)
    rng = np.random.default_rng(2)
    w_DV = jnp.asarray(rng.normal(0, 0.3, (8, 96)), jnp.float32)  # [embed, vocab]
    x_BLD = jnp.asarray(rng.normal(0, 1, (8, 16, 8)), jnp.float32)  # [batch, seq, embed]
    targets_BL = jnp.asarray(rng.integers(0, 96, (8, 16)))
    weights_BL = jnp.asarray(rng.integers(0, 2, (8, 16)) * 1.7, jnp.float32) if weighted else None

    def under_layout(fn):
        def run(*args):
            with use_layout(mesh, rules):
                assert replica_axes(8) == (("data",), 4)
                return jax.value_and_grad(fn, (0, 1))(*args)

        return jax.jit(run)

    want, (gw_want, gx_want) = under_layout(_whole)(w_DV, x_BLD, targets_BL, weights_BL)
    got, (gw, gx) = under_layout(_chunked(4))(w_DV, x_BLD, targets_BL, weights_BL)
    assert abs(float(got) - float(want)) <= FP32_TOLERANCE * abs(float(want))
    assert _rel(gw, gw_want) <= FP32_TOLERANCE and _rel(gx, gx_want) <= FP32_TOLERANCE


def test_replica_axes_leave_fsdp_and_zero3_shared():
    for axes in ({"fsdp": 4}, {"data": 2, "fsdp": 2}):
        mesh = first_devices_mesh(**axes)
        with use_layout(mesh, rules_for_mesh(mesh)):
            assert replica_axes(8) == ((), 1)


# --- the trainer's loss: packed weights, an MoE model's auxiliary loss ---------------------


def _packed_batch(batch: int, seq: int, vocab: int) -> dict:
    rng = np.random.default_rng(1)
    half = seq // 2
    positions = np.concatenate([np.arange(half), np.arange(seq - half)])
    weights = rng.integers(0, 2, (batch, seq)).astype(np.float32)
    return {
        "tokens": jnp.asarray(rng.integers(0, vocab, (batch, seq + 1)), jnp.int32),
        "weights": jnp.asarray(weights * weights.size / weights.sum()),
        "positions": jnp.asarray(np.broadcast_to(positions, (batch, seq)), jnp.int32),
        "segments": jnp.asarray(np.broadcast_to(np.arange(seq) >= half, (batch, seq)) + 1),
    }


@pytest.mark.parametrize("model", ["llama-tiny", "moe-tiny"])
@pytest.mark.parametrize("packed", [False, True])
def test_trainer_loss_matches_unchunked(model, packed):
    """``DecoderLoss`` with ``loss_chunk``: the weighted mean and the router's auxiliary
    loss (MoE) as without it, and their gradients, on one device."""
    cfg = train_config(model=model, batch=4, seq=32, **{"model.layers": 2})
    mesh = first_devices_mesh(data=1)
    whole, chunked = make_setup(cfg, mesh), make_setup(parse_overrides(["loss_chunk=8"], cfg), mesh)
    params = random_state(whole)["params"]
    vocab = whole.param_shapes["embedding"].shape[0]
    batch = _packed_batch(4, 32, vocab) if packed else _packed_batch(4, 32, vocab)["tokens"]

    def value_and_grad(setup):
        loss_fn = make_loss_fn(setup, with_metrics=True)
        return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch)

    (want, metrics_want), grads_want = value_and_grad(whole)
    (got, metrics), grads = value_and_grad(chunked)
    assert metrics.keys() == metrics_want.keys()
    if model == "moe-tiny":
        assert "aux_loss" in metrics and float(metrics["aux_loss"]) > 0
    for k in metrics:
        assert abs(float(metrics[k]) - float(metrics_want[k])) <= FP32_TOLERANCE * abs(
            float(metrics_want[k])
        ), k
    assert abs(float(got) - float(want)) <= FP32_TOLERANCE * abs(float(want))
    errs = jax.tree.map(_rel, grads, grads_want)
    assert max(jax.tree.leaves(errs)) <= FP32_TOLERANCE, errs


# --- training on layouts against one device without chunks --------------------------------

# vocab 2048 against 2 x 4 sequences x 16 tokens per FSDP group: FSDP's head is vocab-parallel
CFG = train_config(steps=2, batch=8, seq=16, warmup=1, **{"model.vocab": 2048, "model.layers": 2})
CHUNKED = {"loss_chunk": 4}

# one layout per way the head's logits are laid out: whole (one device), vocab-parallel over
# FSDP, split over tensor, replica groups (data beside tensor), a sequence split over context,
# and the 1F1B schedule's own loss parts (dp8, FSDP without vocab-parallel, GPipe and 1F1B on
# data were dropped to keep the suite in time: the same head layouts as these)
LAYOUTS = {
    "one-device": ({"data": 1}, {}),
    "fsdp8": ({"fsdp": 8}, {}),  # 1-D, vocab-parallel head
    "fsdp2xtp4": ({"fsdp": 2, "tensor": 4}, {}),  # 2-D
    "dp2xfsdp2xtp2": ({"data": 2, "fsdp": 2, "tensor": 2}, {}),  # replica groups, 3-D
    "context4xdp2-ring": ({"context": 4, "data": 2}, {"attention": "ring"}),
    "1f1b-p2xfsdp2xtp2": (
        {"stage": 2, "fsdp": 2, "tensor": 2},
        {"pipeline_microbatches": 4, "pipeline_schedule": "1f1b"},
    ),
}
FAST = {"one-device", "fsdp8", "fsdp2xtp4"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in LAYOUTS]
)
def test_chunked_training_matches_one_device_unchunked(name):
    axes, overrides = LAYOUTS[name]
    assert_parity(CFG, axes, {**overrides, **CHUNKED})


# lossy layouts (compressed momentum, quantized weights): chunked against unchunked on the
# same layout
LOSSY = {
    "onebit-dp4": ({"data": 4}, {"optimizer": "onebit_adam"}),
    "zeropp-dp4": ({"data": 4}, {"zero": 3, "quantized_weights": True}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LOSSY))
def test_chunked_training_matches_unchunked_on_lossy_layouts(name):
    axes, overrides = LOSSY[name]
    cfg = parse_overrides([f"{k}={v}" for k, v in overrides.items()], CFG)
    mesh = first_devices_mesh(**axes)
    chunked = make_setup(parse_overrides(["loss_chunk=4"], cfg), mesh)
    result = compare(chunked, make_setup(cfg, mesh), random_state(chunked))
    assert result.ok(), result


# --- the setting and its refusals ----------------------------------------------------------


def test_the_setting_reaches_the_plan():
    for text in ("loss_chunk=64", "parallel.loss.chunk=64", "loss=64"):
        assert parse_overrides([text]).parallel.loss.chunk == 64
    assert train_config().parallel.loss.chunk == 0  # off by default


@pytest.mark.parametrize(
    "axes, overrides, words",
    [
        ({"data": 1}, {"loss_chunk": 5}, ["parallel.loss.chunk=5", "16", "loss_chunk=0"]),
        ({"context": 4}, {"loss_chunk": 2}, ["parallel.loss.chunk=2", "context", "loss_chunk=4"]),
    ],
)
def test_a_slice_that_does_not_divide_is_refused(axes, overrides, words):
    assert_refused(CFG, axes, overrides, words)


def test_a_negative_chunk_is_refused():
    with pytest.raises(Exception, match="loss_chunk=0"):
        parse_overrides(["loss_chunk=-1"])


# --- compiled memory -----------------------------------------------------------------------

# logits dominate: embed 64, vocab 32768, 2 x 512 tokens -> 128 MiB of fp32 logits
MEMORY_CFG = train_config(batch=2, seq=512, **{"model.vocab": 32768, "model.layers": 1})


def compiled_temp_bytes(cfg) -> int:
    """Temp bytes of the train step compiled for one device from abstract shapes."""
    setup = make_setup(cfg, first_devices_mesh(data=1))
    exe = setup.train_step.lower(setup.abstract_state(), setup.abstract_batch()).compile()
    return exe.memory_analysis().temp_size_in_bytes


def test_chunks_free_the_logits_in_the_compiled_step():
    """The step's temp memory falls by more than one whole fp32 logits tensor (b·s·V·4):
    without slices XLA keeps the logits and their softmax/gradient (~1.7 logits-sized
    buffers here), with them one slice's [b, 64, V]."""
    b, s, v = 2, 512, 32768
    logits = b * s * v * 4
    whole = compiled_temp_bytes(MEMORY_CFG)
    chunked = compiled_temp_bytes(parse_overrides(["loss_chunk=64"], MEMORY_CFG))
    print(f"temp MiB: whole {whole / 2**20:.1f}, loss_chunk=64 {chunked / 2**20:.1f}, "
          f"fp32 logits {logits / 2**20:.1f}")  # fmt: skip
    assert whole - chunked >= logits, (whole, chunked, logits)
