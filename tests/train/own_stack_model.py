"""A user's own image classifier whose blocks are one stack, for the pipeline tests.

The pieces of ``own_classifier_model`` (patch embedding, pre-norm residual blocks, here
MLPs only, to keep the compiles short, and a class head), but the blocks are built with
``nnx.vmap`` (every parameter leads with ``layers``) and applied with ``shardlib.run_stack``:
on one device a scan, under a ``stage`` mesh axis the pipeline's stages. ``Flat`` is the
same model with its blocks in an ``nnx.List``: what the pipeline refuses.
"""

import jax
import optax
from flax import nnx
from own_classifier_model import (  # noqa: F401 (the tests' data)
    CLASSES,
    EMBED,
    IMAGE,
    MLP,
    PATCH,
    PATCH_DIM,
    PATCHES,
    batches,
    named,
)

import shardlib

LAYERS = 4


class Block(nnx.Module):
    """A pre-norm GELU MLP on [batch, patches, embed] with a residual; every weight named."""

    def __init__(self, rngs: nnx.Rngs):
        ones, zeros = nnx.initializers.ones, nnx.initializers.zeros
        self.norm = nnx.LayerNorm(
            EMBED, scale_init=named(("embed",), ones), bias_init=named(("embed",), zeros),
            rngs=rngs,
        )  # fmt: skip
        self.up = nnx.Linear(  # kernel [embed, mlp]
            EMBED, MLP, kernel_init=named(("embed", "mlp")), bias_init=named(("mlp",), zeros),
            rngs=rngs,
        )  # fmt: skip
        self.down = nnx.Linear(  # kernel [mlp, embed]
            MLP, EMBED, kernel_init=named(("mlp", "embed")), bias_init=named(("embed",), zeros),
            rngs=rngs,
        )  # fmt: skip

    def __call__(self, x_BPD):
        h_BPF = jax.nn.gelu(self.up(self.norm(x_BPD)))
        h_BPF = shardlib.constrain(h_BPF, ("batch", "seq", "mlp"))
        return shardlib.constrain(x_BPD + self.down(h_BPF), ("batch", "seq", "embed"))


def patches(images_BHWC):  # [batch, H, W, 3] -> [batch, patches, patch_dim]
    b = images_BHWC.shape[0]
    grid = images_BHWC.reshape(b, IMAGE // PATCH, PATCH, IMAGE // PATCH, PATCH, 3)
    return grid.transpose(0, 1, 3, 2, 4, 5).reshape(b, PATCHES, PATCH_DIM)


class Stacked(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, layers: int = LAYERS):
        self.patch = nnx.Linear(PATCH_DIM, EMBED, kernel_init=named((None, "embed")), rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(rngs: nnx.Rngs) -> Block:
            return Block(rngs)

        self.blocks = stack(rngs)  # every weight [layers, ...]
        self.head = nnx.Linear(EMBED, CLASSES, kernel_init=named(("embed", None)), rngs=rngs)

    def __call__(self, images_BHWC):
        x_BPD = shardlib.constrain(self.patch(patches(images_BHWC)), ("batch", "seq", "embed"))
        x_BPD = shardlib.run_stack(self.blocks, x_BPD)  # the stack a pipeline cuts
        return self.head(x_BPD.mean(axis=1))  # [batch, classes]


class Flat(nnx.Module):
    """The same layers without a stack (an ``nnx.List``): no pipeline can cut it."""

    def __init__(self, rngs: nnx.Rngs, layers: int = 2):
        self.patch = nnx.Linear(PATCH_DIM, EMBED, kernel_init=named((None, "embed")), rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
        self.head = nnx.Linear(EMBED, CLASSES, kernel_init=named(("embed", None)), rngs=rngs)

    def __call__(self, images_BHWC):
        x_BPD = self.patch(patches(images_BHWC))
        for block in self.blocks:
            x_BPD = block(x_BPD)
        return self.head(x_BPD.mean(axis=1))


def make_model(rngs: nnx.Rngs, layers: int = LAYERS) -> Stacked:
    return Stacked(rngs, layers)


def make_flat(rngs: nnx.Rngs) -> Flat:
    return Flat(rngs)


def loss_fn(model, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["label"]).mean()}
