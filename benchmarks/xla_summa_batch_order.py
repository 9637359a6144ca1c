"""XLA gives a wrong weight gradient for one batch order of 2.5D SUMMA's layout.

Why this file: ``parallel/tensor25d.py`` splits the batch over ``tensor2 x tensor_depth``
under ``products = "summa"``, where the default form uses ``tensor_depth x tensor2``. The
order is not a preference: with the other one, XLA's SPMD partitioner compiles a gradient
that is wrong. This is that program in plain JAX (no shardlib), so the choice can be
rechecked on every JAX release and reported upstream.

Mesh (depth 2, row 2, col 2) on 8 simulated CPU devices. y = (x @ w1) @ w2, both weights
laid out P("row", "col") (Tesseract's [m/q rows, n/q columns]), activations P(batch, "col"),
loss sum(y**2). With the hidden activation constrained to P(("depth", "row"), "col") the
loss is right and dL/dw1 is about 80% off. The same rows per device in the other order
("row", "depth"), or no constraint on the hidden activation, give every gradient to 1e-7.

    python benchmarks/xla_summa_batch_order.py

Measured (8 CPU devices): jax 0.10.2 and jax 0.12 both print dL/dw1 off by 8.0e-01 for
("depth", "row") with the constraint, and 1e-7 everywhere else.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402  (the device count must be set first)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

B, H, F = 16, 8, 32  # tokens, width, hidden width


def relative_errors(mesh: Mesh, batch: tuple[str, str], constrain_hidden: bool):
    """(loss, [dL/dw1, dL/dw2]) relative errors of the sharded program against one device."""

    def put(a, spec):
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))

    def loss(weights, x_BH):
        w1_HF, w2_FH = weights
        h_BF = jnp.einsum("bd,df->bf", put(x_BH, P(batch, "col")), w1_HF)
        if constrain_hidden:
            h_BF = put(h_BF, P(batch, "col"))
        y_BH = put(jnp.einsum("bf,fd->bd", h_BF, w2_FH), P(batch, "col"))
        return jnp.sum(y_BH**2)

    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (B, H))
    w1 = jax.random.normal(keys[1], (H, F)) / 3
    w2 = jax.random.normal(keys[2], (F, H)) / 5
    want_loss, want_grads = jax.value_and_grad(lambda w, x: jnp.sum((x @ w[0] @ w[1]) ** 2))(
        (w1, w2), x
    )
    weights = tuple(jax.device_put(w, NamedSharding(mesh, P("row", "col"))) for w in (w1, w2))
    x = jax.device_put(x, NamedSharding(mesh, P(batch, "col")))
    got_loss, got_grads = jax.jit(jax.value_and_grad(loss))(weights, x)
    loss_err = abs(float(got_loss - want_loss)) / abs(float(want_loss))
    grad_errs = [
        float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
        for g, w in zip(got_grads, want_grads, strict=True)
    ]
    return loss_err, grad_errs


def main() -> None:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("depth", "row", "col"))
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
    for constrain_hidden in (False, True):
        for batch in (("depth", "row"), ("row", "depth")):
            loss_err, (g1, g2) = relative_errors(mesh, batch, constrain_hidden)
            print(
                f"hidden constrained={constrain_hidden!s:5} batch over {batch}: loss {loss_err:.1e}"
                f", dL/dw1 {g1:.1e}, dL/dw2 {g2:.1e}"
            )


if __name__ == "__main__":
    main()
