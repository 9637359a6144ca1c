"""The model side of shardlib: registry, factories, inventory, the Decoder protocol and ops.

The library reaches models only through ``shardlib.core.model`` (entry points, never an import of
``models/``) and models reach the layout only through ``shardlib.core.ops``. Meshes here use the
8 fake CPU devices of tests/conftest.py.
"""

import math
import zlib
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models.llama.model import Llama, LlamaConfig
from models.moe.model import Moe
from shardlib import ShardingError, mesh_spec, rules_for_mesh
from shardlib.core.attention import LocalAttention
from shardlib.core.capabilities import ExpertRouting, Generator, Routed
from shardlib.core.inventory import inventory
from shardlib.core.layout import use_layout
from shardlib.core.model import (
    Decoder,
    ModelFactory,
    checkpoint_names,
    registry,
    resolve_model,
)
from shardlib.core.ops import active_ops, run_blocks, use_ops
from shardlib.core.values import convert_value
from shardlib.parallel.expert import ExpertParallel, explicit_exchange

# --- a model defined here, reached as ``test_model_api:make_toy`` ----------------------------


class Toy(nnx.Module):
    """Two weights and an optional bias: small enough to count by hand."""

    checkpoint_names = ("toy_hidden",)

    def __init__(self, width: int, bias: bool, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.normal(0.02), ("embed", "mlp"))
        self.w = nnx.Param(init(rngs.params(), (width, 2 * width), jnp.float32))  # [embed, mlp]
        self.b = nnx.Param(jnp.zeros((2 * width,))) if bias else None  # [mlp]


def make_toy(rngs: nnx.Rngs, width: int = 4, bias: bool = True) -> Toy:
    return Toy(width, bias, rngs)


def build(factory: ModelFactory):
    with nnx.use_eager_sharding(False):
        return factory.make(nnx.Rngs(0))


# --- resolving names --------------------------------------------------------------------------


def test_presets_come_from_the_entry_point():
    assert {"llama-tiny", "llama-70b", "moe-tiny", "mixtral-8x7b"} <= set(registry())


def test_preset_overrides_are_converted_to_the_field_types():
    factory = resolve_model("llama-tiny", {"layers": "3", "rope_theta": "5e5", "embed": 32})
    assert factory.name == "llama-tiny" and factory.model_type is Llama
    assert factory.config == LlamaConfig(layers=3, rope_theta=500_000.0, embed=32)
    model = build(factory)
    assert isinstance(model, Llama) and model.cfg.layers == 3


def test_a_module_function_is_a_factory_with_typed_keyword_overrides():
    factory = resolve_model("test_model_api:make_toy", {"width": "8", "bias": "false"})
    assert factory.config is None and factory.model_type is Toy
    model = build(factory)
    assert model.w.shape == (8, 16) and model.b is None
    assert checkpoint_names(factory) == ("toy_hidden",)
    assert inventory(factory).param_count == 8 * 16
    assert inventory(resolve_model("test_model_api:make_toy")).param_count == 4 * 8 + 8


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        ("llama-huge", {}, r"'llama-huge' is not a registered preset.*llama-tiny"),
        ("llama-tiny", {"depth": "2"}, r"no field 'depth'.*Fix: use one of .*layers"),
        ("llama-tiny", {"layers": "two"}, r"model.layers='two': expected int.*layers=4"),
        ("moe-tiny", {"moe_every": "3"}, r"moe_every=3.*Fix"),
        ("no_such_package_xyz:make", {}, r"cannot import 'no_such_package_xyz'.*PYTHONPATH"),
        ("test_model_api:make_tiy", {}, r"no function 'make_tiy'.*make_toy"),
        ("test_model_api:make_toy", {"depth": "1"}, r"no argument 'depth'.*bias, width"),
        ("test_model_api:make_toy", {"bias": "maybe"}, r"model.bias='maybe': expected bool"),
    ],
)
def test_bad_names_say_how_to_fix_them(name, overrides, message):
    with pytest.raises(ShardingError, match=message):
        resolve_model(name, overrides)


def test_convert_value():
    assert convert_value("x", "None", "int | None") is None
    assert convert_value("x", "7", int | None) == 7
    assert convert_value("x", "YES", bool) is True
    assert convert_value("x", 3, float) == 3.0 and isinstance(convert_value("x", 3, float), float)
    assert convert_value("x", "ring", Literal["ring", "none"]) == "ring"
    with pytest.raises(ShardingError, match="one of ring, none"):
        convert_value("x", "tree", Literal["ring", "none"])
    with pytest.raises(ShardingError, match="expected int"):
        convert_value("x", True, int)


# --- inventory: shapes and names, nothing allocated -------------------------------------------

SIZES = {  # name: (overrides, stacked groups)
    "llama-tiny": ({}, 2),
    "llama-70b": ({}, 80),
    "moe-tiny": ({"layers": "4", "moe_every": "2"}, 2),
    "mixtral-8x7b": ({}, 32),
}


@pytest.mark.parametrize("name", list(SIZES))
def test_inventory_counts_what_the_config_formula_counts(name):
    overrides, layers = SIZES[name]
    factory = resolve_model(name, overrides)
    inv = inventory(factory)
    assert inv.param_count == factory.config.param_count()
    assert inv.layers == layers
    assert sum(math.prod(p.shape) for p in inv.params) == inv.param_count
    blocks = [p for p in inv.params if p.path.startswith("blocks.")]
    assert blocks and all(p.names[0] == "layers" and p.shape[0] == layers for p in blocks)
    wq = next(p for p in inv.params if p.path.endswith("moe.attn.wq") or p.path == "blocks.attn.wq")
    assert wq.names == ("layers", "embed", "heads", "head_dim")


def test_checkpoint_names_come_from_the_model_class():
    names = checkpoint_names(resolve_model("llama-tiny"))
    assert "attn_q" in names and "mlp_hidden" in names
    assert checkpoint_names(resolve_model("moe-tiny")) == names  # Moe extends Llama


# --- the Decoder protocol ---------------------------------------------------------------------

TOKENS = jax.random.randint(jax.random.PRNGKey(1), (4, 32), 0, 256)


def moe_model(**overrides) -> Moe:
    return build(resolve_model("moe-tiny", {"layers": "4", "moe_every": "2", **overrides}))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "moe"])
def test_embed_blocks_head_give_the_logits_of_call(family):
    model = build(resolve_model("llama-tiny")) if family == "llama" else moe_model()
    assert isinstance(model, Decoder)
    positions_L = jnp.arange(32)[::-1]  # reordered tokens: blocks take true positions
    out = model(TOKENS, positions_L=positions_L)
    block_graph, blocks_state = nnx.split(model.blocks)
    x_BLD = model.embed(TOKENS, dtype=jnp.float32)
    x_BLD, totals = run_blocks(block_graph, blocks_state, x_BLD, positions_L)
    logits_BLV = model.head(x_BLD, dtype=jnp.float32)
    if family == "llama":
        assert totals is None
        np.testing.assert_array_equal(logits_BLV, out)
        return
    np.testing.assert_array_equal(logits_BLV, out[0])
    aux = model.aux(totals, TOKENS.size)
    assert set(aux) == set(out[1]) and float(aux["loss"]) == float(out[1]["loss"])


def _leaf(suffix: str, layer: int, shape: tuple) -> jax.Array:
    """A parameter fixed by its name inside a block and its absolute layer, not by the tree."""
    key = jax.random.fold_in(jax.random.PRNGKey(0), layer + 1)
    noise = jax.random.normal(jax.random.fold_in(key, zlib.crc32(suffix.encode())), shape)
    if suffix.endswith("scale"):
        return 1.0 + 0.1 * noise
    if suffix.endswith("router"):
        return 0.5 * noise
    return noise * shape[-2 if len(shape) > 1 else 0] ** -0.5


@pytest.mark.slow
def test_moe_numbers_are_those_of_the_two_stack_model():
    """Expected values from the previous models/moe/model.py (dense_blocks + moe_blocks stacks, at
    commit d5ff25b) with the same ``_leaf`` parameters mapped to its layer order."""
    model = moe_model(capacity_factor="1.0")
    every = model.cfg.moe_every
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    for path, var in flat:
        names = [str(p) for p in path]
        if names[0] != "blocks":
            var[...] = _leaf(".".join(names), -1, var.shape)
            continue
        dense = names[1] == "dense"  # blocks.dense.<i>.* then blocks.moe.*
        offset, suffix = (int(names[2]), names[3:]) if dense else (every - 1, names[2:])
        groups = range(var.shape[0])
        var[...] = jnp.stack(
            [_leaf(".".join(suffix), g * every + offset, var.shape[1:]) for g in groups]
        )
    nnx.update(model, nnx.from_flat_state(flat))
    logits, aux = model(TOKENS)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], TOKENS[:, 1:]).mean()
    np.testing.assert_allclose(float(ce), 6.077923774719238, rtol=1e-6)
    np.testing.assert_allclose(float(aux["loss"]), 0.05037527531385422, rtol=1e-6)
    assert float(aux["moe_dropped"]) == 111.0


# --- the optional protocols ------------------------------------------------------------------


def test_llama_generates_and_the_moe_model_routes():
    """A dense model has no routing; the MoE model routes and generates (its groups have a
    KV-cache path too: ``tests/models/test_generate.py``)."""
    llama, moe = build(resolve_model("llama-tiny")), moe_model()
    assert isinstance(llama, Generator) and not isinstance(llama, Routed)
    assert isinstance(moe, Routed) and isinstance(moe, Generator)
    assert llama.max_positions == llama.cfg.max_positions
    assert moe.routing() == ExpertRouting(
        experts=8, top_k=2, capacity_factor=2.0, dim="expert", every=2, group_size=0, no_drop=False
    )


def test_inventory_reads_the_routing_the_model_declares():
    assert inventory(resolve_model("llama-tiny")).routing is None
    factory = resolve_model("moe-tiny", {"top_k": "1", "no_drop": "true"})
    routing = inventory(factory).routing
    assert routing == factory.config.routing()
    assert (routing.top_k, routing.no_drop, routing.capacity(8)) == (1, True, 8)


@pytest.mark.parametrize(("k", "factor", "group", "want"), [(2, 2.0, 16, 8), (1, 1.25, 64, 10)])
def test_capacity_is_k_group_over_experts_times_the_factor(k, factor, group, want):
    """ceil(k x group / E x factor), at most the group: the slots the model routes into."""
    routing = ExpertRouting(experts=8, top_k=k, capacity_factor=factor, dim="expert")
    assert routing.capacity(group) == want == min(group, math.ceil(k * group / 8 * factor))
    assert ExpertRouting(experts=8, top_k=8, capacity_factor=4.0, dim="expert").capacity(4) == 4


# --- ops settings -----------------------------------------------------------------------------


def test_use_ops_nests_and_restores():
    assert active_ops().exchange is None and active_ops().attention == LocalAttention()
    with use_ops(exchange=explicit_exchange):
        with use_ops(attention=LocalAttention(impl="chunked"), exchange=explicit_exchange):
            assert active_ops().exchange is explicit_exchange
            assert active_ops().attention.impl == "chunked"
        assert active_ops().attention.impl == "dense"
    assert active_ops().exchange is None
    with pytest.raises(ShardingError, match="dispatch='a2a'.*einsum, shard_map"):
        ExpertParallel(dispatch="a2a")


@pytest.mark.slow
def test_shard_map_and_einsum_exchange_agree_on_an_expert_mesh():
    """8 devices, data=2 x expert=4: both forms give the one-device logits and router loss."""
    model = moe_model(layers="2")
    graphdef, state = nnx.split(model)
    tokens_BL = jnp.concatenate([TOKENS, TOKENS[:, ::-1]])  # 8 sequences: one per device
    ref_logits, ref_aux = model(tokens_BL)
    axes = {"data": 2, "expert": 4}
    mesh = mesh_spec(**axes).build(jax.devices()[:8])
    rules = rules_for_mesh(axes)

    for dispatch in ("einsum", "shard_map"):

        def forward(state, tokens_BL, dispatch=dispatch):
            forms = ExpertParallel(dispatch=dispatch).ops(axes)  # the section's exchange
            with use_layout(mesh, rules), use_ops(**forms):
                logits, aux = nnx.merge(graphdef, state)(tokens_BL)
            return logits, aux["loss"]

        compiled = jax.jit(forward).lower(state, tokens_BL).compile()
        assert "all-to-all" in compiled.as_text(), dispatch  # XLA derives it, or it is written
        logits, loss = compiled(state, tokens_BL)
        np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5, err_msg=dispatch)
        np.testing.assert_allclose(loss, ref_aux["loss"], rtol=1e-5, err_msg=dispatch)


def test_rms_norm_gradient_is_autodiff_of_the_norm():
    """models/llama/norm.py's hand-written gradient (it keeps only x) equals autodiff's."""
    from models.llama.norm import rms_norm

    def plain(x, scale):
        x32 = x.astype(jnp.float32)
        r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
        return (x32 * r).astype(x.dtype) * scale.astype(x.dtype)

    kx, ks, kg = jax.random.split(jax.random.key(0), 3)
    x, scale = jax.random.normal(kx, (2, 8, 16)), 1 + jax.random.normal(ks, (16,))
    g = jax.random.normal(kg, (2, 8, 16))
    got = jax.vjp(lambda a, b: rms_norm(a, b, 1e-5), x, scale)
    ref = jax.vjp(plain, x, scale)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(got[1](g), ref[1](g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
