"""A user's own model, defined here (not in ``models/``), trained from the command line.

The model implements the decoder protocol (``embed``, stacked ``blocks``, ``head``) and
names logical dims only; ``model=<this module>:make_model`` reaches it through the CLI's
factory lookup, on the 2 x 2 x 2 preset, and must train exactly like one device.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from shardlib.core.layout import constrain
from shardlib.core.ops import attention
from shardlib.tools import cli

pytestmark = pytest.mark.slow  # compiles and trains: the full suite, not the inner loop

FACTORY = f"{__name__}:make_model"
WORDS = ["batch=8", "seq=16", "model.layers=2", "precision=fp32"]


def _param(rngs, shape, names, fan_in):
    init = nnx.with_partitioning(nnx.initializers.normal(fan_in**-0.5), names)
    return nnx.Param(init(rngs.params(), shape, jnp.float32))


class ToyBlock(nnx.Module):
    """Pre-norm causal attention (one fused q/k/v weight) and a GELU MLP, with biases."""

    def __init__(self, embed: int, heads: int, mlp: int, rngs: nnx.Rngs):
        d = embed // heads
        self.heads = heads
        self.scale = nnx.Param(
            nnx.with_partitioning(nnx.initializers.ones, ("embed",))(None, (embed,))
        )
        self.w_qkv = _param(
            rngs, (embed, 3, heads, d), ("embed", None, "heads", "head_dim"), embed
        )  # [embed, 3, heads, hd]
        self.w_o = _param(
            rngs, (heads, d, embed), ("heads", "head_dim", "embed"), embed
        )  # [heads, hd, embed]
        self.w_in = _param(rngs, (embed, mlp), ("embed", "mlp"), embed)  # [embed, mlp]
        self.b_in = nnx.Param(
            nnx.with_partitioning(nnx.initializers.zeros, ("mlp",))(None, (mlp,))
        )  # [mlp]
        self.w_out = _param(rngs, (mlp, embed), ("mlp", "embed"), mlp)  # [mlp, embed]

    def __call__(self, x_BLD, positions_L=None):
        dt = x_BLD.dtype
        h_BLD = constrain(x_BLD * self.scale[...].astype(dt), ("batch", "seq", "embed"))
        qkv = jnp.einsum("bld,djhk->bljhk", h_BLD, self.w_qkv[...].astype(dt))
        q, k, v = (constrain(qkv[:, :, i], ("batch", "seq", "heads", "head_dim")) for i in range(3))
        a_BLHK = attention(q, k, v, positions_L)
        x_BLD = x_BLD + jnp.einsum("blhk,hkd->bld", a_BLHK, self.w_o[...].astype(dt))
        m_BLF = jax.nn.gelu(x_BLD @ self.w_in[...].astype(dt) + self.b_in[...].astype(dt))
        m_BLF = constrain(m_BLF, ("batch", "seq", "mlp"))
        return constrain(x_BLD + m_BLF @ self.w_out[...].astype(dt), ("batch", "seq", "embed"))


class ToyDecoder(nnx.Module):
    def __init__(
        self, rngs: nnx.Rngs, *, vocab: int, embed: int, heads: int, mlp: int, layers: int
    ):
        self.table = _param(rngs, (vocab, embed), ("vocab", "embed"), 1)  # [vocab, embed]

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(rngs: nnx.Rngs) -> ToyBlock:
            return ToyBlock(embed, heads, mlp, rngs)

        self.blocks = stack(rngs)  # every weight [layers, ...]
        self.out = _param(rngs, (embed, vocab), ("embed", "vocab"), embed)  # [embed, vocab]

    def embed(self, tokens_BL, *, dtype=jnp.float32):
        x_BLD = jnp.take(self.table[...], tokens_BL, axis=0).astype(dtype)
        return constrain(x_BLD, ("batch", "seq", "embed"))

    def head(self, x_BLD, *, dtype=jnp.float32):
        logits_BLV = jnp.einsum("bld,dv->blv", x_BLD, self.out[...].astype(dtype))
        return constrain(logits_BLV.astype(jnp.float32), ("batch", "seq", "vocab"))


def make_model(rngs: nnx.Rngs, layers: int = 2, embed: int = 32, mlp: int = 64) -> ToyDecoder:
    """The factory the CLI calls: ``model.layers=...`` and friends arrive as keywords."""
    return ToyDecoder(rngs, vocab=256, embed=embed, heads=4, mlp=mlp, layers=layers)


def test_own_model_trains_from_the_cli_on_the_3d_preset():
    code = cli.main(["train", "--mesh", "cpu-8-3d", f"model={FACTORY}", "steps=3", *WORDS])
    assert code == 0


def test_own_model_matches_one_device_from_the_cli(capsys):
    words = ["parity", "--mesh", "cpu-8-3d", "--steps", "3", "--tol", "1e-5"]
    code = cli.main([*words, f"model={FACTORY}", *WORDS])
    assert code == 0, capsys.readouterr().err
    assert "PARITY OK" in capsys.readouterr().err
