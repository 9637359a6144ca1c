"""Hugging Face Llama weights in and out, LoRA layouts and parity, generation, bad input.

Tiny random Llamas made with ``transformers`` (``hf_models``: Llama 2 and Llama 3 style),
saved with transformers' logits as fixtures (``fixtures/``), are imported on cpu-8-3d
(data x fsdp x tensor = 2 x 2 x 2) and must give those logits within 1e-5; exported, they
must be the fixtures' tensors bit for bit. Neither transformers nor torch is needed here:
``test_hf_live.py`` (``pytest -m hf``) compares with transformers itself. Fine-tuning,
evaluation and export are one chain in ``test_hf_finetune.py``.
"""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from hf_models import FIXTURE_VOCAB, STYLES, assert_like_fixture, fixture, rel_err

from shardlib.core.mesh import MeshSpec
from shardlib.core.model import hf_adapter
from shardlib.interop.hf import (
    HFError,
    Shards,
    adapter_for,
    half_to_meta,
    model_settings,
    read_config,
)
from shardlib.interop.hf_io import export_hf, flatten, load_params
from shardlib.parallel.plan import ParallelPlan
from shardlib.tools.generate import Sampling, generate, pick
from shardlib.train.init_from import load_model

CUBE = MeshSpec((("data", 2), ("fsdp", 2), ("tensor", 2)))
LLAMA = hf_adapter("llama-tiny")
_, TOKENS, _ = fixture("llama2")  # [2, 12], the same for every style


@pytest.fixture(scope="module")
def cube():
    plan = ParallelPlan(mesh=CUBE)
    return CUBE.build(jax.devices()[:8]), plan.rules


def settings_of(directory) -> dict:
    return model_settings(LLAMA, read_config(directory))


@pytest.mark.parametrize("style", list(STYLES))
def test_import_matches_transformers_on_cube(style, cube):
    directory, tokens, want = fixture(style)
    mesh, rules = cube
    model = load_model(directory, mesh, rules)
    assert model.cfg.tie_embeddings == (style == "llama3")
    assert model.cfg.kv_heads == (2 if style == "llama3" else 4)
    assert (model.cfg.rope_scaling is not None) == (style == "llama3")
    wq = model.blocks.attn.wq[...]
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert {s.data.shape for s in wq.addressable_shards} == {(2, 16, 2, 8)}  # a slice each
    logits = jax.jit(lambda m, t: m(t))(model, tokens)
    assert rel_err(logits, want) < 1e-5


def test_meta_rotary_order_is_permuted_back(cube, tmp_path):
    """q/k rows in Meta's interleaved rotary order import to the same weights."""
    from safetensors.numpy import load_file, save_file

    directory, _, _ = fixture("llama3")
    shutil.copytree(directory, tmp_path / "meta")
    (shard,) = (tmp_path / "meta").glob("*.safetensors")
    tensors = load_file(shard)
    for name in list(tensors):
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            tensors[name] = np.ascontiguousarray(half_to_meta(tensors[name], 8))
    save_file(tensors, shard, metadata={"format": "pt"})
    mesh, rules = cube
    plain = load_model(directory, mesh, rules)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            nnx.to_pure_dict(nnx.state(plain, nnx.Param)))  # fmt: skip
    settings = settings_of(directory)
    meta = load_params(tmp_path / "meta", abstract, settings, LLAMA, interleaved_rope=True)
    wrong = load_params(tmp_path / "meta", abstract, settings, LLAMA)
    want = flatten(nnx.to_pure_dict(nnx.state(plain, nnx.Param)))
    for path, x in flatten(meta).items():
        np.testing.assert_array_equal(np.asarray(x), np.asarray(want[path]), err_msg=path)
    assert not np.array_equal(flatten(wrong)["blocks/attn/wq"], want["blocks/attn/wq"])


def test_greedy_cache_equals_argmax_without_cache(cube):
    directory, _, _ = fixture("llama3")
    mesh, rules = cube
    model = load_model(directory, mesh, rules)
    prompt = TOKENS[:, :5]  # batch 2 over data x fsdp = 4: the cache keeps the batch whole
    out = generate(model, prompt, mesh=mesh, rules=rules, sampling=Sampling(max_new_tokens=6))
    assert out.tokens.shape == (2, 11)
    full = jax.jit(lambda m, t: m(t))  # causal: padding after position i leaves i's logits
    tokens = np.zeros((2, 11), np.int32)
    tokens[:, :5] = prompt
    for i in range(5, 11):
        tokens[:, i] = np.argmax(np.asarray(full(model, tokens))[:, i - 1], axis=-1)
    np.testing.assert_array_equal(out.tokens, tokens)


def test_sampling_keeps_to_the_top_k():
    logits = np.random.default_rng(1).normal(size=(512, 50)).astype(np.float32)
    keys = jax.random.key(0)
    np.testing.assert_array_equal(pick(logits, keys, 0.0, 0), logits.argmax(-1))
    np.testing.assert_array_equal(pick(logits, keys, 1.0, 1), logits.argmax(-1))
    top3 = np.argsort(logits, axis=-1)[:, -3:]
    drawn = np.asarray(pick(logits, keys, 1.0, 3))
    assert all(d in row for d, row in zip(drawn, top3, strict=True))
    assert len(set((drawn[:, None] == top3).argmax(1).tolist())) == 3  # not always the argmax


def test_bad_inputs_fail_before_any_work(cube, tmp_path):
    from shardlib.core.errors import ShardingError
    from shardlib.parallel.state import abstract_params

    directory, _, _ = fixture("llama2")
    mesh, rules = cube
    model = load_model(directory, mesh, rules)
    settings = settings_of(directory)
    # shapes that do not match the model config: the tensor, both shapes named
    from shardlib.core.model import resolve_model

    wider = resolve_model("llama-tiny", settings | {"mlp": 64})
    _, abstract = abstract_params(lambda: wider.make(nnx.Rngs(0)), mesh, rules)
    with pytest.raises(HFError, match=r"model.layers.0.mlp.down_proj.weight has shape \[32, 48\]"
                       r", the model expects \[32, 64\]"):  # fmt: skip
        load_params(directory, abstract, settings | {"mlp": 64}, LLAMA)
    # a setting no shape shows
    with pytest.raises(HFError, match="rope_theta=10000.0 but the model has rope_theta=5"):
        load_params(directory, abstract, settings | {"rope_theta": 5.0}, LLAMA)
    # a truncated shard: named before anything is read
    shutil.copytree(directory, tmp_path / "cut")
    (shard,) = (tmp_path / "cut").glob("*.safetensors")
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(HFError, match=f"safetensors shard {shard} is corrupt"):
        Shards.open(tmp_path / "cut")
    # a prompt longer than the context
    long = np.zeros((1, 61), np.int32)
    with pytest.raises(Exception, match="65 positions, more than the model's context of 64"):
        generate(model, long, mesh=mesh, rules=rules, sampling=Sampling(max_new_tokens=4))
    # config.json of another architecture, or one the Llama cannot represent
    bad = json.loads((directory / "config.json").read_text()) | {"model_type": "falcon"}
    with pytest.raises(HFError, match="model_type='falcon'; no registered model reads it"):
        adapter_for(bad)
    with pytest.raises(HFError, match="model_type='falcon'; only llama"):
        model_settings(LLAMA, bad)
    with pytest.raises(HFError, match="mlp_bias=true; shardlib's Llama has no biases"):
        model_settings(LLAMA, read_config(directory) | {"mlp_bias": True})
    # a model without Hugging Face names: refused, naming the fix
    with pytest.raises(ShardingError, match=r"no-such has no Hugging Face adapter.*Fix: regis"):
        hf_adapter("no-such")
    # a model its family's config.json cannot describe (dense blocks between MoE ones, which
    # Mixtral has not): refused before anything is written
    moe = resolve_model("moe-tiny", {}).config
    with pytest.raises(HFError, match="moe_every=2 puts dense blocks between the MoE ones"):
        export_hf({}, dataclasses.asdict(moe), hf_adapter("moe-tiny"), tmp_path / "moe")
    assert not (tmp_path / "moe").exists()


def test_presets_have_published_sizes():
    import models

    published = {  # parameters, from the model cards
        "llama2-7b": 6.74e9, "llama2-13b": 13.0e9, "llama2-70b": 69.0e9,
        "llama3-8b": 8.03e9, "llama3-70b": 70.6e9, "llama3-405b": 405.9e9,
    }  # fmt: skip
    for name, count in published.items():
        assert abs(models.config(name).param_count() / count - 1) < 0.01, name


LORA = {"lora.rank": 4, "lora.targets": "q,k,v,o,gate,up,down", "model.layers": 1}


def test_lora_factors_are_sharded_like_their_base_weights(cube):
    from jax.sharding import PartitionSpec as P

    from shardlib.train.config import train_config
    from shardlib.train.setup import make_setup

    mesh, _ = cube
    specs = make_setup(train_config(batch=8, seq=16, **LORA), mesh).param_specs
    attn, mlp = specs["blocks"]["attn"], specs["blocks"]["mlp"]
    assert attn["wq"] == P(None, "fsdp", "tensor")  # [layers, embed, heads, head_dim]
    assert attn["lora_q_a"] == P(None, "fsdp")  # [layers, embed, rank]
    # a factor without an embed dim takes FSDP on its next divisible dim (rules.SHARED_ORDER)
    both = ("fsdp", "tensor")
    assert attn["lora_q_b"] == P(None, None, both)  # [layers, rank, heads, head_dim]
    assert attn["lora_o_a"] == P(None, both)  # [layers, heads, head_dim, rank]
    assert attn["lora_o_b"] == P(None, None, "fsdp")  # [layers, rank, embed]
    assert mlp["lora_down_a"] == P(None, both) and mlp["lora_down_b"] == P(None, None, "fsdp")


@pytest.mark.slow
def test_lora_parity_on_cube(cube):
    """Loss and gradients of a LoRA step on 2x2x2 equal one device's (fp32, 1e-5)."""
    from shardlib.tools.parity import check_parity
    from shardlib.train.config import train_config

    mesh, _ = cube
    result = check_parity(train_config(batch=8, seq=16, steps=2, **LORA), mesh)
    assert result.ok(1e-5), result


def test_export_in_several_shards_reads_back(cube, tmp_path):
    from shardlib.interop.hf_io import export_hf

    directory, _, _ = fixture("llama2")
    mesh, rules = cube
    model = load_model(directory, mesh, rules)
    params = flatten(jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    settings = settings_of(directory)
    files = export_hf(params, settings, LLAMA, tmp_path / "out", shard_bytes=20_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted({f for f in index["weight_map"].values()})
    assert len(shards) > 2 and [f.name for f in files[: len(shards)]] == shards
    assert len(index["weight_map"]) == 3 + 9 * 2  # embed, norm, head + 9 per layer
    again = load_model(tmp_path / "out", mesh, rules)
    back = flatten(nnx.to_pure_dict(nnx.state(again, nnx.Param)))
    assert all(np.array_equal(np.asarray(back[p]), params[p]) for p in params)
    with pytest.raises(HFError, match="is not empty"):  # nothing written is overwritten
        export_hf(params, settings, LLAMA, tmp_path / "out")


@pytest.mark.parametrize("style", list(STYLES))
def test_export_is_the_fixture(style, cube, tmp_path):
    """Import then export gives back transformers' own tensors bit for bit, and a config.json
    that agrees with its: what transformers loads from the export is the fixture, whose
    logits it computed (``test_hf_live`` loads an export in transformers itself)."""
    from shardlib.interop.hf_io import export_hf

    directory, _, _ = fixture(style)
    model = load_model(directory, *cube)
    params = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    export_hf(flatten(params), settings_of(directory), LLAMA, tmp_path / "out")
    assert_like_fixture(tmp_path / "out", style, same_values=True)


def test_tokenizer_file_and_cache_layout(tmp_path, cube):
    from jax.sharding import PartitionSpec as P
    from tokenizers import Tokenizer, models, pre_tokenizers

    from shardlib.core.errors import ShardingError
    from shardlib.tools.generate import ByteTokenizer, cache_sharding, tokenizer_for

    words = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = tokenizer_for(None, tmp_path, vocab=3)  # found in the model's directory
    assert loaded.encode("hello world") == [1, 2] and loaded.decode([2, 1]) == "world hello"
    with pytest.raises(ShardingError, match="the tokenizer has 3 tokens but the model's"):
        tokenizer_for(str(tmp_path / "tokenizer.json"), None, vocab=2)
    assert isinstance(tokenizer_for(None, None, vocab=256), ByteTokenizer)
    mesh, rules = cube  # the cache: batch over data x fsdp, kv heads over tensor
    assert cache_sharding(mesh, rules, 4).spec == P(None, ("data", "fsdp"), None, "tensor")
    assert cache_sharding(mesh, rules, 2).spec == P(None, None, None, "tensor")  # 2 % 4


def test_bf16_shards_import_as_their_fp32_values(cube, tmp_path):
    """Published checkpoints are bf16: numpy has no bf16, so those slices go through jax."""
    import jax.numpy as jnp
    from safetensors.flax import save_file
    from safetensors.numpy import load_file

    directory, _, _ = fixture("llama2")
    shutil.copytree(directory, tmp_path / "bf16")
    (shard,) = (tmp_path / "bf16").glob("*.safetensors")
    tensors = {k: jnp.asarray(v, jnp.bfloat16) for k, v in load_file(shard).items()}
    save_file(tensors, shard, metadata={"format": "pt"})
    assert Shards.open(tmp_path / "bf16").dtypes["model.norm.weight"] == "BF16"
    mesh, rules = cube
    model = load_model(tmp_path / "bf16", mesh, rules)
    wq = np.asarray(model.blocks.attn.wq[...])[0]  # [embed, heads, head_dim]
    want = np.asarray(tensors["model.layers.0.self_attn.q_proj.weight"], np.float32)  # [h*d, e]
    np.testing.assert_array_equal(wq, want.reshape(4, 8, 32).transpose(2, 0, 1))


def test_load_params_takes_the_model_from_config_json(tmp_path):
    """``--load-params HF_DIR`` alone describes the model; an explicit model.NAME wins."""
    from shardlib.train.config import train_config
    from shardlib.train.init_from import with_source_model

    directory, _, _ = fixture("llama3")
    cfg = with_source_model(train_config(init_from=str(directory), **{"model.layers": 1}))
    model = dict(cfg.model_overrides)
    assert model == settings_of(directory) | {"layers": 1}
    assert model["rope_theta"] == 500_000.0 and model["tie_embeddings"]
    assert model["vocab"] == FIXTURE_VOCAB
    plain = train_config(init_from=str(tmp_path))  # not a Hugging Face directory: unchanged
    assert with_source_model(plain) == plain
