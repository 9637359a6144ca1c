"""A user's conv net holding state besides its parameters, for the generic trainer's tests:
``nnx.BatchNorm`` (running statistics, ``nnx.BatchStat``) and ``nnx.Dropout`` with its own
RNG stream (forked from the factory's ``rngs``), plus variables of the user's own that the
forward pass writes (a counter; a per-feature peak named ``mlp``). Names logical dims only."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import shardlib

BATCH, IMAGE, CHANNELS, FEATURES, CLASSES = 16, 6, 3, 8, 4
NAMES = {"image": ("batch", None, None, None), "label": ("batch",)}


class Seen(nnx.Variable):
    """What the model keeps of the data it saw (not a parameter): a count of forward passes,
    and each feature's peak |activation|, laid out by its logical name."""


class ConvNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        named = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, None, None, "mlp"))
        # no bias before BatchNorm (the usual form): BatchNorm cancels it, so its gradient is
        # rounding noise that Adam scales up to lr-sized steps, different on every layout;
        # the loss would not see it, but the running mean would
        self.conv = nnx.Conv(
            CHANNELS, FEATURES, (3, 3), use_bias=False, kernel_init=named, rngs=rngs
        )
        self.bn = nnx.BatchNorm(FEATURES, momentum=0.8, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        head = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("mlp", None))
        self.head = nnx.Linear(FEATURES, CLASSES, kernel_init=head, rngs=rngs)
        self.calls = Seen(jnp.zeros((), jnp.int32))
        self.peak = Seen(jnp.zeros((FEATURES,), jnp.float32), out_sharding=("mlp",))

    def __call__(self, x_BHWC):
        self.calls[...] += 1
        h_BHWF = shardlib.constrain(self.conv(x_BHWC), ("batch", None, None, "mlp"))
        h_BHWF = self.drop(jax.nn.relu(self.bn(h_BHWF)))
        self.peak[...] = jnp.maximum(self.peak[...], h_BHWF.max(axis=(0, 1, 2)))
        return self.head(h_BHWF.mean(axis=(1, 2)))  # [batch, classes]


def make_model(rngs: nnx.Rngs) -> ConvNet:
    return ConvNet(rngs)


def loss_fn(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def _examples(seed: int):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, size=(BATCH,)).astype(np.int32)
    images = rng.normal(size=(BATCH, IMAGE, IMAGE, CHANNELS)).astype(np.float32)
    images[..., 0] += labels[:, None, None] * 0.5 + 2.0  # a shifted mean: BatchNorm matters
    return {"image": images, "label": labels}


def batches() -> shardlib.Batches:
    return shardlib.Batches([_examples(i) for i in range(4)], NAMES, "own_bn")
