"""A user's own image classifier for the generic trainer's tests (not in ``models/``).

A small ViT-style model (patch embedding, pre-norm encoder blocks in an ``nnx.List``, a
class head) that names logical dims only; ``loss_fn`` and ``batches`` are what a user
hands to ``shardlib train model=... loss=... data=...`` or ``shardlib.train_model``.
"""

import jax
import numpy as np
import optax
from flax import nnx

import shardlib

BATCH, IMAGE, PATCH, CLASSES, EMBED, HEADS, MLP = 8, 8, 4, 10, 16, 4, 32
PATCHES, PATCH_DIM = (IMAGE // PATCH) ** 2, PATCH * PATCH * 3
NORMAL = nnx.initializers.normal(0.05)
NAMES = {"image": ("batch", None, None, None), "label": ("batch",)}


def named(names, init=NORMAL):
    return nnx.with_partitioning(init, names)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(EMBED, rngs=rngs)
        self.qkv = nnx.LinearGeneral(  # kernel [embed, 3, heads, head_dim]
            EMBED, (3, HEADS, EMBED // HEADS), use_bias=False,
            kernel_init=named(("embed", None, "heads", "head_dim")), rngs=rngs,
        )  # fmt: skip
        self.out = nnx.LinearGeneral(  # kernel [heads, head_dim, embed]
            (HEADS, EMBED // HEADS), EMBED, axis=(-2, -1),
            kernel_init=named(("heads", "head_dim", "embed")), rngs=rngs,
        )  # fmt: skip
        self.norm2 = nnx.LayerNorm(EMBED, rngs=rngs)
        self.up = nnx.Linear(EMBED, MLP, kernel_init=named(("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(MLP, EMBED, kernel_init=named(("mlp", "embed")), rngs=rngs)

    def __call__(self, x_BPD):
        qkv = self.qkv(self.norm1(x_BPD))
        q, k, v = (qkv[:, :, i] for i in range(3))
        x_BPD = x_BPD + self.out(nnx.dot_product_attention(q, k, v))
        h_BPF = shardlib.constrain(jax.nn.gelu(self.up(self.norm2(x_BPD))), ("batch", None, "mlp"))
        return shardlib.constrain(x_BPD + self.down(h_BPF), ("batch", None, "embed"))


class Classifier(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, depth: int = 2):
        self.patch = nnx.Linear(PATCH_DIM, EMBED, kernel_init=named((None, "embed")), rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(depth)])
        self.norm = nnx.LayerNorm(EMBED, rngs=rngs)
        self.head = nnx.Linear(EMBED, CLASSES, kernel_init=named(("embed", None)), rngs=rngs)

    def __call__(self, images_BHWC):
        b = images_BHWC.shape[0]
        grid = images_BHWC.reshape(b, IMAGE // PATCH, PATCH, IMAGE // PATCH, PATCH, 3)
        x = grid.transpose(0, 1, 3, 2, 4, 5).reshape(b, PATCHES, PATCH_DIM)
        x_BPD = shardlib.constrain(self.patch(x), ("batch", None, "embed"))
        for block in self.blocks:
            x_BPD = block(x_BPD)
        return self.head(self.norm(x_BPD).mean(axis=1))  # [batch, classes]


def make_model(rngs: nnx.Rngs, depth: int = 2) -> Classifier:
    return Classifier(rngs, depth)


def loss_fn(model, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    accuracy = (logits.argmax(-1) == batch["label"]).mean()
    return loss, {"accuracy": accuracy}


def _examples(count: int, seed: int = 0):
    """Images whose class sets the mean of one colour channel: learnable in a few steps."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, size=(count,)).astype(np.int32)
    images = rng.normal(size=(count, IMAGE, IMAGE, 3)).astype(np.float32)
    images[..., 0] += (labels[:, None, None] - CLASSES / 2) / 2
    return images, labels


def batches():
    """16 fixed batches of 8 (a list: step i reads batch i % 16)."""
    images, labels = _examples(16 * BATCH)
    items = [
        {"image": images[i : i + BATCH], "label": labels[i : i + BATCH]}
        for i in range(0, len(labels), BATCH)
    ]
    return shardlib.Batches(items, NAMES, name="own_classifier_model:batches")


def stream():
    """The same batches from a generator (an iterable source: a resume skips ahead)."""

    def gen():
        yield from batches().source

    return shardlib.Batches(gen, NAMES, name="own_classifier_model:stream")
