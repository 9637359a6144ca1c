"""A user's own non-Llama model through the public API only (``import shardlib``).

A tiny ViT-style classifier (patch embedding, two pre-norm encoder blocks with biases and
LayerNorm, a 10-class head) names three logical dims of the vocabulary and two of its own
(``patches``, ``classes``, added with ``Rules.with_name``). It is built on one device as
the reference, sharded on DP, FSDP, TP and 2 x 2 x 2 meshes with a hand-written optax loop,
trained 5 steps, and must match the reference within fp32 round-off; ``explain`` reports it.
"""

import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from rich.console import Console

import shardlib

STEPS, BATCH, IMAGE, PATCH, CLASSES = 5, 8, 8, 4, 10
EMBED, HEADS, MLP = 32, 8, 64
PATCHES, PATCH_DIM = (IMAGE // PATCH) ** 2, PATCH * PATCH * 3
TOLERANCE = 1e-5


NORMAL = nnx.initializers.normal(0.05)


def named(names, init=NORMAL):
    """An initializer that also stores logical dim names on the parameter."""
    return nnx.with_partitioning(init, names)


class EncoderBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(EMBED, rngs=rngs)  # scale, bias [embed], replicated
        # No q/k/v bias: the key bias's gradient is zero in exact arithmetic (softmax ignores
        # a shift), so Adam would turn its round-off into full +-lr steps that differ by layout.
        self.qkv = nnx.LinearGeneral(  # kernel [embed, 3, heads, head_dim]
            EMBED,
            (3, HEADS, EMBED // HEADS),
            use_bias=False,
            kernel_init=named(("embed", None, "heads", "head_dim")),
            rngs=rngs,
        )
        self.out = nnx.LinearGeneral(  # kernel [heads, head_dim, embed]
            (HEADS, EMBED // HEADS),
            EMBED,
            axis=(-2, -1),
            kernel_init=named(("heads", "head_dim", "embed")),
            bias_init=named(("embed",), nnx.initializers.zeros),
            rngs=rngs,
        )
        self.norm2 = nnx.LayerNorm(EMBED, rngs=rngs)
        self.up = nnx.Linear(  # kernel [embed, mlp]
            EMBED,
            MLP,
            kernel_init=named(("embed", "mlp")),
            bias_init=named(("mlp",), nnx.initializers.zeros),
            rngs=rngs,
        )
        self.down = nnx.Linear(  # kernel [mlp, embed]
            MLP,
            EMBED,
            kernel_init=named(("mlp", "embed")),
            bias_init=named(("embed",), nnx.initializers.zeros),
            rngs=rngs,
        )

    def __call__(self, x_BPD):
        qkv_BP3HK = self.qkv(self.norm1(x_BPD))
        q, k, v = (qkv_BP3HK[:, :, i] for i in range(3))
        q = shardlib.constrain(q, ("batch", "patches", "heads", "head_dim"))
        x_BPD = x_BPD + self.out(nnx.dot_product_attention(q, k, v))
        h_BPF = shardlib.constrain(jax.nn.gelu(self.up(self.norm2(x_BPD))), ("batch", None, "mlp"))
        return shardlib.constrain(x_BPD + self.down(h_BPF), ("batch", "patches", "embed"))


class TinyViT(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.patch = nnx.Linear(  # kernel [patch pixels, embed]
            PATCH_DIM, EMBED, kernel_init=named((None, "embed")), rngs=rngs
        )
        self.position = nnx.Param(  # [patches, embed]
            named(("patches", "embed"))(rngs.params(), (PATCHES, EMBED))
        )
        self.blocks = nnx.List([EncoderBlock(rngs) for _ in range(2)])
        self.norm = nnx.LayerNorm(EMBED, rngs=rngs)
        self.head = nnx.Linear(  # kernel [embed, classes]
            EMBED,
            CLASSES,
            kernel_init=named(("embed", "classes")),
            bias_init=named(("classes",), nnx.initializers.zeros),
            rngs=rngs,
        )

    def __call__(self, images_BHWC):
        b = images_BHWC.shape[0]
        grid = images_BHWC.reshape(b, IMAGE // PATCH, PATCH, IMAGE // PATCH, PATCH, 3)
        patches_BPX = grid.transpose(0, 1, 3, 2, 4, 5).reshape(b, PATCHES, PATCH_DIM)
        x_BPD = self.patch(patches_BPX) + self.position[...]
        x_BPD = shardlib.constrain(x_BPD, ("batch", "patches", "embed"))
        for block in self.blocks:
            x_BPD = block(x_BPD)
        logits_BC = self.head(self.norm(x_BPD).mean(axis=1))
        return shardlib.constrain(logits_BC, ("batch", "classes"))


def make_model():
    return TinyViT(nnx.Rngs(0))


MESHES = {  # name -> (axis sizes, how the two new names are split)
    "DP": ({"data": 8}, None),
    "FSDP": ({"fsdp": 8}, None),
    "TP": ({"tensor": 8}, None),
    "2x2x2": ({"data": 2, "fsdp": 2, "tensor": 2}, "tensor"),  # 10 classes split 2 ways
}
IMAGE_NAMES = ("batch", None, None, None)
# Adam's first steps are +-lr per element whatever the gradient's size, so elements whose
# gradient is near round-off differ by layout in proportion to lr: 1e-3 keeps the final
# parameters within 1e-5 of one device (1e-2 gave 4e-5 while the losses agreed to 2e-7).
tx = optax.adam(1e-3)


def layout(name: str):
    axes, classes = MESHES[name]
    mesh = shardlib.mesh_spec(**axes).build(jax.devices()[: int(np.prod(list(axes.values())))])
    rules = (
        shardlib.rules_for_mesh(mesh)
        .with_name("patches")
        .with_name("classes", params=classes, activations=classes)
    )
    return mesh, rules


def data():
    """One batch per step: the same random images and labels, so the loss must fall."""
    rng = np.random.default_rng(0)
    images = rng.normal(size=(BATCH, IMAGE, IMAGE, 3)).astype(np.float32)
    labels = rng.integers(0, CLASSES, size=(BATCH,)).astype(np.int32)
    return [images] * STEPS, [labels] * STEPS


def loss_fn(params, graphdef, images, labels):
    logits = nnx.merge(graphdef, params)(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def step_fn(graphdef, mesh=None, rules=None):
    """One Adam step; on a mesh the model's ``constrain`` calls take effect (use_layout)."""

    def step(state, images, labels):
        if mesh is None:
            loss, grads = jax.value_and_grad(loss_fn)(state["params"], graphdef, images, labels)
        else:
            with shardlib.use_layout(mesh, rules):
                images = shardlib.constrain(images, IMAGE_NAMES)
                grad_fn = jax.value_and_grad(loss_fn)
                loss, grads = grad_fn(state["params"], graphdef, images, labels)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    return step


@pytest.fixture(scope="module")
def reference():
    """Five steps on one device: the model built plainly, annotations and all."""
    model = shardlib.build_model(make_model)  # no mesh: Flax 0.12's eager sharding is off
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    initial = jax.device_get(params)
    state = {"params": params, "opt": tx.init(params)}
    step = jax.jit(step_fn(graphdef))
    images, labels = data()
    losses = []
    for i in range(STEPS):
        state, loss = step(state, images[i], labels[i])
        losses.append(float(loss))
    return initial, losses, jax.device_get(state["params"])


def sharded_run(name: str, initial):
    mesh, rules = layout(name)
    graphdef, abstract = shardlib.abstract_params(make_model, mesh, rules)
    shardings = jax.tree.map(lambda x: x.sharding, abstract)
    params = jax.device_put(initial, shardings)
    opt = shardlib.init_optimizer(tx, params)
    state = {"params": params, "opt": opt}
    state_shardings = {"params": shardings, "opt": shardlib.optimizer_shardings(tx, params)}
    images, labels = data()
    image_sharding = shardlib.batch_sharding(mesh, rules, IMAGE_NAMES, shape=images[0].shape)
    label_sharding = shardlib.batch_sharding(mesh, rules, ("batch",), shape=labels[0].shape)
    step = jax.jit(
        step_fn(graphdef, mesh, rules),
        in_shardings=(state_shardings, image_sharding, label_sharding),
        out_shardings=(state_shardings, None),
    )
    losses = []
    for i in range(STEPS):
        state, loss = step(state, images[i], labels[i])
        losses.append(float(loss))
    return mesh, opt, losses, jax.device_get(state["params"])


def _rel_tree(got, ref) -> float:
    errs = jax.tree.map(
        lambda a, b: float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)), got, ref
    )
    return max(jax.tree.leaves(errs))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MESHES))
def test_own_classifier_matches_one_device(name, reference):
    initial, ref_losses, ref_params = reference
    mesh, opt, losses, params = sharded_run(name, initial)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    param_err = _rel_tree(params, ref_params)
    print(f"{name}: max rel loss err {loss_err:.1e}, max rel param err {param_err:.1e}")
    assert loss_err <= TOLERANCE and param_err <= TOLERANCE, (loss_err, param_err)
    assert ref_losses[-1] < ref_losses[0]  # it learns
    count = opt[0].count  # Adam's step count: replicated over the whole mesh, not device 0
    assert count.sharding.device_set == set(mesh.devices.flat)


def test_the_layout_of_the_own_names():
    mesh, rules = layout("2x2x2")
    _, abstract = shardlib.abstract_params(make_model, mesh, rules)
    assert abstract["head"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert abstract["position"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    assert abstract["blocks"][0]["qkv"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(
        "fsdp", None, "tensor"
    )


@pytest.fixture(scope="module")
def fsdp_report():
    """``explain`` of the FSDP step, from abstract shapes (nothing allocated)."""
    mesh, rules = layout("FSDP")
    graphdef, params = shardlib.abstract_params(make_model, mesh, rules)
    state = {"params": params, "opt": shardlib.abstract_optimizer_state(tx, params)}
    image_sharding = shardlib.batch_sharding(mesh, rules, IMAGE_NAMES)
    images = jax.ShapeDtypeStruct((BATCH, IMAGE, IMAGE, 3), jnp.float32, sharding=image_sharding)
    label_sharding = shardlib.batch_sharding(mesh, rules, ("batch",))
    labels = jax.ShapeDtypeStruct((BATCH,), jnp.int32, sharding=label_sharding)
    step = step_fn(graphdef, mesh, rules)
    return params, shardlib.explain(step, state, images, labels, params=params)


@pytest.mark.slow
def test_explain_counts_the_parameters_and_names_what_each_gather_moves(fsdp_report):
    params, report = fsdp_report
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    assert report.params_count == count  # by hand: the parameters, not Adam's moments too
    assert report.params_bytes == 4 * count
    assert not report.warnings
    gathers = [op for op in report.collectives if op.kind == "all-gather"]
    assert gathers and all(op.axes == ("fsdp",) for op in gathers)
    moved = {op.tensor for op in gathers}
    assert "state.params.head.kernel" in moved, moved  # FSDP gathers each weight it uses
    assert all(op.moves for op in report.collectives)  # an input, or a line of code
    assert any("test_own_classifier.py:" in op.source for op in report.collectives)
    kinds = {op.kind for op in report.gpu_collectives}
    assert kinds <= {"all-gather", "all-reduce", "reduce-scatter", "all-to-all"}
    # no layer loop: each weight gathered once, each gradient reduce-scattered once, though
    # XLA fused every gradient, the loss and the replicated LayerNorm values into one
    # all-reduce (counted whole as an all-reduce, this was 1.49x)
    gpu = sum(t["wire_bytes"] for t in report.gpu_collective_totals.values())
    assert gpu / (2 * 7 / 8 * report.params_bytes) == pytest.approx(1.0, abs=0.02)
    assert any(op.moves.startswith("fused gradient sync (") for op in report.collectives)


@pytest.mark.slow
@pytest.mark.parametrize("width", [80, 120])
def test_explain_tables_are_readable_at_80_and_120_columns(fsdp_report, width):
    console = Console(file=io.StringIO(), width=width, color_system=None)
    fsdp_report[1].render(console)
    out = console.file.getvalue()
    assert max(len(line) for line in out.splitlines()) <= width
    assert "…" not in out  # nothing cut: long text folds onto more lines
    assert "all-gather" in out and "all-reduce" in out
