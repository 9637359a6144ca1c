"""FP8 training: one projection's numerics against a reference written with jnp casts
(scales from the amax history, the history's roll, saturation), the per-layer state through
the layer loop, the refusals, and short runs: FP8 tracks bf16, resumes exactly, and gives
the same losses on data and fsdp meshes as on one device."""

import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.llama.model import stack_blocks
from shardlib.checkpoint.store import restore, tensor_names
from shardlib.core.errors import ShardingError
from shardlib.core.mesh import MeshSpec
from shardlib.core.ops import matmul, run_blocks, use_matmul
from shardlib.train import fp8
from shardlib.train.config import override, train_config
from shardlib.train.loop import run
from shardlib.train.setup import make_setup

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
E4M3_MAX, E5M2_MAX = 448.0, 57344.0  # the formats' largest finite values
SPEC = "bld,df->blf"


def f32(values) -> np.ndarray:
    return np.asarray(values, np.float32)


def meta(history_x, history_w, history_g, stored_scale: float = 1.0) -> dict:
    """One projection's state with these amax histories (the op recomputes the scale from
    the history; the stored scale is kept only while the history is all zeros)."""
    out = {}
    for role, h in zip(fp8.ROLES, (history_x, history_w, history_g), strict=True):
        out[f"{role}_scale"] = jnp.full((1,), stored_scale, jnp.float32)  # [1]
        out[f"{role}_amax_history"] = jnp.asarray(f32(h))  # [history]
    return out


def ref_qdq(x, fp8_dtype, fp8_max, scale):
    """Quantize-dequantize by hand: divide by the scale, clip, cast to FP8 and back."""
    q = jnp.clip(x / scale.astype(x.dtype), -fp8_max, fp8_max).astype(fp8_dtype)
    return q.astype(x.dtype) * scale.astype(x.dtype)


def through_op(x, w, m, g):
    """(y, dx, dw, next meta) of ``ops.matmul`` under the FP8 form, in a layer with ``m``."""

    def f(x, w, m):
        with use_matmul(fp8.qdq_matmul):
            return fp8.qdq_matmul(SPEC, x, w, "p", {"p": m})

    y, vjp = jax.vjp(f, x, w, m)
    return (y, *vjp(g))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_qdq_matmul_matches_a_reference_with_fp8_casts(dtype):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x_BLD = (3.0 * jax.random.normal(kx, (2, 5, 16))).astype(dtype)  # [b, l, d]
    w_DF = (0.2 * jax.random.normal(kw, (16, 24))).astype(dtype)  # [d, f]
    g_BLF = (1e-3 * jax.random.normal(kg, (2, 5, 24))).astype(dtype)  # [b, l, f]
    m = meta([9.0, 2.0, 0.0, 1.0], [0.5, 0.0, 0.25, 0.0], [0.0, 4e-3, 1e-3, 0.0])
    y, dx, dw, new = through_op(x_BLD, w_DF, m, g_BLF)
    # delayed scaling: scale = max(history) / fp8_max (margin 0), from the earlier steps
    sx, sw = f32(9.0) / f32(E4M3_MAX), f32(0.5) / f32(E4M3_MAX)
    sg = f32(4e-3) / f32(E5M2_MAX)
    xq, wq = ref_qdq(x_BLD, E4M3, E4M3_MAX, sx), ref_qdq(w_DF, E4M3, E4M3_MAX, sw)
    gq = ref_qdq(g_BLF, E5M2, E5M2_MAX, sg)
    assert not np.array_equal(xq, x_BLD) and not np.array_equal(gq, g_BLF)  # it rounded
    np.testing.assert_array_equal(y, jnp.einsum(SPEC, xq, wq))
    np.testing.assert_array_equal(dx, jnp.einsum("blf,df->bld", gq, wq))
    want_dw = jnp.einsum("blf,bld->df", gq, xq)
    if dtype == jnp.float32:
        np.testing.assert_array_equal(dw, want_dw)
    else:  # jax 0.12 transposes a bf16 einsum into a product whose sum rounds apart from a
        # direct einsum's in the last bf16 bit (jax 0.10: equal); e4m3's rounding, 2^-4 of
        # a value, is 8x what this admits, so a missing quantization still fails it
        bound = jnp.einsum("blf,bld->df", jnp.abs(gq), jnp.abs(xq)).astype(jnp.float32)
        diff = jnp.abs(dw.astype(jnp.float32) - want_dw.astype(jnp.float32))
        assert bool(jnp.all(diff <= 2.0**-7 * bound)), float(jnp.max(diff / bound))
    # the meta's "gradient" is its next value: the scales used, the histories rolled
    # (the newest amax at index 0; the oldest one, at index 1, drops out)
    for role, s in zip(fp8.ROLES, (sx, sw, sg), strict=True):
        np.testing.assert_allclose(new[f"{role}_scale"], [s], rtol=1e-6)
    ax, aw, ag = (f32(jnp.max(jnp.abs(t.astype(jnp.float32)))) for t in (x_BLD, w_DF, g_BLF))
    np.testing.assert_array_equal(new["input_amax_history"], f32([ax, 0.0, 1.0, 9.0]))
    np.testing.assert_array_equal(new["kernel_amax_history"], f32([aw, 0.25, 0.0, 0.5]))
    np.testing.assert_array_equal(new["output_grad_amax_history"], f32([ag, 1e-3, 0.0, 0.0]))


def test_values_beyond_the_range_saturate():
    """At scale 1, e4m3 clips to +-448 and e5m2 to +-57344 (no inf, no NaN)."""
    x = jnp.asarray([[[1000.0, -1000.0, 3.3, 0.0]]])  # [1, 1, 4]
    g = jnp.asarray([[[1e5, -1e5, 3.3, 70_000.0]]])  # [1, 1, 4]
    eye = jnp.eye(4)
    m = meta([E4M3_MAX], [1.0], [E5M2_MAX])  # amax = fp8_max: scale exactly 1 (w: 1/448)
    y, dx, _, _ = through_op(x, eye, m, g)
    # y = qdq(x) @ I and dx = qdq(g) @ I^T: the quantized operands themselves
    np.testing.assert_array_equal(y[0, 0], [448.0, -448.0, 3.25, 0.0])  # 3.3 -> e4m3's 3.25
    np.testing.assert_array_equal(dx[0, 0], [57344.0, -57344.0, 3.5, 57344.0])  # e5m2's 3.5


def test_amax_history_keeps_the_last_steps_newest_first():
    """Fed amaxes a_1..a_k, a history of length 3 holds the last three with a_k at index 0,
    and step k's scale is the largest of the three before it over 448."""
    amaxes = [1.0, 5.0, 2.0, 3.0, 0.5, 4.0]
    m, eye = meta([0.0] * 3, [0.0] * 3, [0.0] * 3), jnp.eye(2)
    for k, a in enumerate(amaxes):
        x = jnp.full((1, 1, 2), a)  # [1, 1, 2]: amax a
        _, _, _, new = through_op(x, eye, m, jnp.ones((1, 1, 2)))
        before = amaxes[max(0, k - 3) : k]
        want = max(before) / E4M3_MAX if before else 1.0  # an empty history keeps scale 1
        np.testing.assert_allclose(new["input_scale"], [want], rtol=1e-6)
        history = np.asarray(new["input_amax_history"])
        assert history[0] == a
        assert sorted(history) == sorted(f32(([0.0] * 3 + amaxes[: k + 1])[-3:]))
        m = new


class Proj(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 8)) * 0.5)  # [d, d]

    def __call__(self, x_BLD, positions_L=None):
        return matmul(SPEC, x_BLD, self.w[...], name="p")


def test_each_layer_reads_and_updates_its_own_state_through_the_layer_loop():
    stack = stack_blocks(Proj, 2, nnx.Rngs(params=1))
    graph, state = nnx.split(stack)
    x_BLD = jax.random.normal(jax.random.key(2), (2, 3, 8))  # [b, l, d]
    layer_meta = fp8.init_meta(("p",), 2, 4)
    layer_meta["p"]["input_amax_history"] = jnp.asarray([[4.0, 0, 0, 0], [9.0, 0, 0, 0]])

    def loss(x, lm):
        with use_matmul(fp8.qdq_matmul):
            y, _ = run_blocks(graph, state, x, layer_extras=lm)
        return jnp.sum(y), y

    (_, y), (dx, new) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x_BLD, layer_meta)
    # by hand: layer 0 with input scale 4/448, layer 1 with 9/448 (weights: scale 1)
    w = state["w"][...]
    y0 = ref_qdq(x_BLD, E4M3, E4M3_MAX, f32(4.0 / E4M3_MAX)) @ ref_qdq(w[0], E4M3, 448, f32(1))
    y1 = ref_qdq(y0, E4M3, E4M3_MAX, f32(9.0 / E4M3_MAX)) @ ref_qdq(w[1], E4M3, 448, f32(1))
    np.testing.assert_allclose(y, y1, rtol=1e-6)
    np.testing.assert_allclose(new["p"]["input_scale"][:, 0], f32([4.0, 9.0]) / 448, rtol=1e-6)
    np.testing.assert_allclose(
        new["p"]["input_amax_history"][:, 0], [jnp.max(jnp.abs(x_BLD)), jnp.max(jnp.abs(y0))]
    )
    np.testing.assert_array_equal(new["p"]["input_amax_history"][:, 3], [4.0, 9.0])
    np.testing.assert_allclose(
        new["p"]["kernel_amax_history"][:, 0], jnp.max(jnp.abs(w), axis=(1, 2))
    )
    assert new["p"]["output_grad_amax_history"][1, 0] == 1.0  # d sum / d y
    assert dx.shape == x_BLD.shape


TINY = train_config(model="llama-tiny", steps=40, batch=8, seq=32, precision="fp8")


def one_device_mesh():
    return MeshSpec((("data", 1),)).build(jax.devices()[:1])


@pytest.mark.parametrize(
    "settings, axes, refused",
    [
        ({}, (("stage", 2),), "a pipeline"),
        ({"lora.rank": 2}, (("data", 1),), "LoRA"),
        ({"data_microbatches": 2}, (("data", 1),), "microbatches=2"),
        ({"model": "moe-tiny"}, (("data", 1),), "mixture-of-experts"),
        ({}, (("tensor", 2), ("tensor2", 2)), "2D/2.5D/3D tensor"),
        ({}, (("context", 2),), "context parallelism"),
        ({"offload_params": True}, (("data", 1),), "offloaded layer weights"),
    ],
)
def test_layouts_fp8_cannot_take_are_refused_before_compiling(settings, axes, refused):
    mesh = MeshSpec(axes).build(jax.devices()[: int(np.prod([s for _, s in axes]))])
    cfg = override(TINY, settings)
    with pytest.raises(ShardingError, match=rf"precision=fp8 does not run with .*{refused}.*Fix:"):
        make_setup(cfg, mesh)
    make_setup(override(cfg, {"precision": "bf16"}), mesh)  # the layout itself is fine


def test_state_holds_each_projection_per_layer_and_the_program_holds_fp8_casts():
    cfg = override(TINY, {"fp8_amax_history": 16, "model.layers": 3})
    setup = make_setup(cfg, one_device_mesh())
    shapes = setup.abstract_state()[fp8.KEY]
    assert set(shapes) == {"qkv", "o", "gate_up", "down"}
    assert shapes["qkv"]["input_amax_history"].shape == (3, 16)
    assert shapes["down"]["output_grad_scale"].shape == (3, 1)
    text = setup.train_step.lower(setup.abstract_state(), setup.abstract_batch()).as_text()
    assert text.count("f8E4M3FN") >= 8 and "f8E5M2" in text  # the qdq pattern XLA rewrites


def train(setup, state=None, **kw):
    return run(setup, state=state, show=False, **kw)


@pytest.mark.slow
def test_fp8_training_tracks_bf16():
    """40 steps of llama-tiny: every FP8 loss, and the held-out loss, within 3% of bf16's
    (measured on jax 0.10.2 CPU: 0.21% at most; final 2.7741 vs 2.7729, held-out 2.7650
    vs 2.7630), yet not bf16's (the FP8 path ran)."""
    mesh, evaluated = one_device_mesh(), {"eval_every": 40, "eval_batches": 1}
    reference = train(make_setup(override(TINY, {"precision": "bf16", **evaluated}), mesh))
    result = train(make_setup(override(TINY, evaluated), mesh))
    bf16 = reference.losses
    rel = np.abs(np.asarray(result.losses) - bf16) / np.asarray(bf16)
    assert rel.max() < 0.03, (result.losses, bf16)
    assert rel.max() > 1e-5  # FP8 rounding changed something
    assert bf16[-1] < 0.5 * bf16[0] and result.losses[-1] < 0.5 * result.losses[0]  # learned
    held_out = [r.records[-1]["eval_loss"] for r in (result, reference)]  # FP8 forward, too
    assert abs(held_out[0] - held_out[1]) < 0.03 * held_out[1] and held_out[0] != held_out[1]
    scales = jax.device_get(result.state[fp8.KEY]["down"]["output_grad_scale"])
    assert np.all(scales < 1e-4)  # the gradient's scale followed its amax (from 1 at init)


@pytest.mark.slow
def test_resume_continues_the_fp8_state_exactly(tmp_path):
    directory = tmp_path / "run"
    cfg = override(TINY, {"steps": 14, "checkpoint_dir": str(directory), "checkpoint_every": 5})
    setup = make_setup(cfg, one_device_mesh())
    uninterrupted = train(setup)
    shutil.rmtree(directory)
    stopped = train(setup, stop_after=7)
    resumed = train(setup)
    assert resumed.records[0]["step"] == 8
    assert stopped.losses + resumed.losses == uninterrupted.losses  # exact float equality
    assert jax.tree.all(
        jax.tree.map(np.array_equal, *jax.device_get((resumed.state, uninterrupted.state)))
    )
    saved = restore(directory, setup, step=7).state
    assert "fp8/qkv/input_amax_history" in tensor_names(saved)
    # without the saved scales the same steps differ: the checkpoint's FP8 state matters
    fresh = {**saved, fp8.KEY: jax.device_put(setup.init_fp8(), setup.fp8_shardings)}
    shutil.rmtree(directory)
    again = train(setup, state=fresh)
    assert again.losses != uninterrupted.losses[7:]


LAYOUT_CFG = override(TINY, {"steps": 8})


def _meta_then_losses(setup, start) -> tuple[dict, list]:
    """The FP8 state after step 1 and the 8 losses, from the host state ``start``."""
    first = train(setup, jax.device_put(start, setup.state_shardings), stop_after=1)
    meta = jax.device_get(first.state[fp8.KEY])  # before the next run donates it
    rest = train(setup, first.state)  # steps 2..8, as if uninterrupted
    return meta, first.losses + rest.losses


@functools.cache
def _one_device_layout_run() -> tuple[dict, dict, list]:
    """The one-device reference the layouts are compared with, run once for all of them."""
    one = make_setup(LAYOUT_CFG, one_device_mesh())
    start = jax.device_get(one.init_state())
    return (start, *_meta_then_losses(one, start))


@pytest.mark.slow
@pytest.mark.parametrize(
    "axes, settings",
    [  # the scales' layouts: split over fsdp, over data under ZeRO-3, beside tensor (plain
        # data and data x fsdp dropped to keep the suite in time: the same scale layouts)
        ((("fsdp", 4),), {}),
        ((("data", 4),), {"zero": 3}),
        ((("data", 2), ("tensor", 2)), {}),
    ],
)
def test_layouts_match_one_device(axes, settings):
    """Each amax is the whole tensor's (under GSPMD an all-reduce of max over the axes that
    split it), so after step 1 the forward operands' histories equal one device's: exactly
    where no product's sum is split; under tensor parallelism, whose split sums round the
    residual differently, within one bf16 ulp (2%). The gradients' amaxes move with bf16's
    reduction order through e5m2 roundings (a 25% step): within 10% (measured 5.2% at
    most). Over 8 steps the losses stay within 3e-3 (measured <= 9e-4; bf16 alone 2e-4 on
    data=4: an e4m3 rounding step is 6%, so the layouts' bf16 differences flip a few)."""
    exact = "tensor" not in dict(axes)
    start, ref_meta, ref_losses = _one_device_layout_run()
    split = make_setup(override(LAYOUT_CFG, settings), MeshSpec(axes).build(jax.devices()[:4]))
    got_meta, got_losses = _meta_then_losses(split, start)
    np.testing.assert_allclose(got_losses, ref_losses, rtol=3e-3)
    for name, leaves in ref_meta.items():
        for leaf, ref in leaves.items():
            got = got_meta[name][leaf]
            if leaf.startswith("kernel") or (exact and leaf.startswith("input")):
                np.testing.assert_array_equal(got, ref, err_msg=f"{name}/{leaf}")
            elif leaf.startswith("input"):
                np.testing.assert_allclose(got, ref, rtol=2e-2, err_msg=f"{name}/{leaf}")  # 1 ulp
            else:
                np.testing.assert_allclose(got, ref, rtol=0.1, err_msg=f"{name}/{leaf}")


def test_a_gpu_run_is_told_that_fp8_needs_full_recompute_for_its_backward_gemms():
    from shardlib.train.config import override, train_config

    prec = override(train_config(), {"precision": "fp8"}).precision
    assert "remat=full makes the backward ones FP8" in fp8.advice(prec, "none", "gpu")
    assert fp8.advice(prec, "full", "gpu") == "" and fp8.advice(prec, "none", "cpu") == ""
    assert fp8.advice(train_config().precision, "none", "gpu") == ""
