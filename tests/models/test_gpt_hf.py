"""Hugging Face GPT-2 in and out (``models/gpt/hf.py``) without transformers or torch.

A tiny random GPT-2 is written with ``GPT2LMHeadModel``'s tensor names and shapes (Conv1D
weights [in, out], q/k/v fused in ``c_attn``) and ``config.json``; imported on a data x
fsdp x tensor = 2 x 2 x 2 mesh (so q, k and v are each read as slices of their block of
``c_attn``), its logits must equal those of GPT-2's forward written here in numpy (float64)
from the same tensors within 1e-5; exported again, every tensor must come back bit for bit
under its own name, with a ``config.json`` that reads back to the same settings.
"""

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from shardlib.core.mesh import MeshSpec
from shardlib.core.model import hf_adapter
from shardlib.interop.hf import HFError, model_settings, read_config
from shardlib.interop.hf_io import export_hf, flatten
from shardlib.parallel.plan import ParallelPlan
from shardlib.train.init_from import load_model

CUBE = MeshSpec((("data", 2), ("fsdp", 2), ("tensor", 2)))
GPT2 = hf_adapter("gpt2")
VOCAB, EMBED, HEADS, LAYERS, POSITIONS = 64, 32, 4, 2, 16
CONFIG = {
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    "vocab_size": VOCAB,
    "n_positions": POSITIONS,
    "n_embd": EMBED,
    "n_layer": LAYERS,
    "n_head": HEADS,
    "n_inner": None,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": True,
}


def gpt2_state_dict(seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors with ``GPT2LMHeadModel.save_pretrained``'s names and shapes."""
    rng = np.random.default_rng(seed)
    e, f = EMBED, 4 * EMBED

    def normal(*shape, mean=0.0):
        return (mean + 0.2 * rng.standard_normal(shape)).astype(np.float32)

    top = "transformer."
    out = {top + "wte.weight": normal(VOCAB, e), top + "wpe.weight": normal(POSITIONS, e),
           top + "ln_f.weight": normal(e, mean=1.0), top + "ln_f.bias": normal(e)}  # fmt: skip
    for i in range(LAYERS):
        layer = f"{top}h.{i}."
        out |= {
            layer + "ln_1.weight": normal(e, mean=1.0), layer + "ln_1.bias": normal(e),
            layer + "attn.c_attn.weight": normal(e, 3 * e),
            layer + "attn.c_attn.bias": normal(3 * e),
            layer + "attn.c_proj.weight": normal(e, e), layer + "attn.c_proj.bias": normal(e),
            layer + "ln_2.weight": normal(e, mean=1.0), layer + "ln_2.bias": normal(e),
            layer + "mlp.c_fc.weight": normal(e, f), layer + "mlp.c_fc.bias": normal(f),
            layer + "mlp.c_proj.weight": normal(f, e), layer + "mlp.c_proj.bias": normal(e),
        }  # fmt: skip
    return out


def gpt2_logits(sd: dict[str, np.ndarray], tokens_BL: np.ndarray) -> np.ndarray:
    """GPT-2's forward (``GPT2LMHeadModel``, eval mode) in float64 numpy: the reference."""
    w = {k: v.astype(np.float64) for k, v in sd.items()}

    def layer_norm(x, name):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-5) * w[name + ".weight"] + w[name + ".bias"]

    def gelu_new(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))

    b, seq = tokens_BL.shape
    d = EMBED // HEADS
    x = w["transformer.wte.weight"][tokens_BL] + w["transformer.wpe.weight"][:seq]
    causal = np.tril(np.ones((seq, seq), bool))
    for i in range(LAYERS):
        p = f"transformer.h.{i}."
        h = layer_norm(x, p + "ln_1") @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = (t.reshape(b, seq, HEADS, d) for t in np.split(h, 3, axis=-1))
        s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
        s = np.where(causal, s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        ctx = np.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, seq, EMBED)
        x = x + ctx @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        h = gelu_new(layer_norm(x, p + "ln_2") @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"])
        x = x + h @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    return layer_norm(x, "transformer.ln_f") @ w["transformer.wte.weight"].T


def write_gpt2(directory, sd: dict, config: dict = CONFIG):
    directory.mkdir(parents=True, exist_ok=True)
    save_file(sd, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(state dict, directory, the model imported on the 2 x 2 x 2 mesh)."""
    sd = gpt2_state_dict()
    directory = write_gpt2(tmp_path_factory.mktemp("gpt2") / "in", sd)
    mesh = CUBE.build(jax.devices()[:8])
    return sd, directory, load_model(directory, mesh, ParallelPlan(mesh=CUBE).rules)


def test_import_gives_gpt2_logits_on_cube(imported):
    sd, _, model = imported
    assert model.cfg.heads == HEADS and model.cfg.max_positions == POSITIONS
    wk = model.blocks.attn.wk[...]  # [layers, embed, kv_heads, head_dim]: c_attn's block 1
    assert wk.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    want_k = sd["transformer.h.1.attn.c_attn.weight"][:, EMBED : 2 * EMBED]
    np.testing.assert_array_equal(np.asarray(wk)[1].reshape(EMBED, EMBED), want_k)
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 12))
    logits = np.asarray(jax.jit(lambda m, t: m(t))(model, tokens), np.float64)
    want = gpt2_logits(sd, tokens)
    rel = np.abs(logits - want).max() / np.abs(want).max()
    assert rel < 1e-5, rel


def test_export_gives_back_every_tensor(imported, tmp_path):
    sd, directory, model = imported
    from flax import nnx

    flat = flatten(jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    fields = json.loads(json.dumps(model.cfg.__dict__))
    export_hf(flat, fields, GPT2, tmp_path / "out")
    (shard,) = (tmp_path / "out").glob("*.safetensors")
    back = load_file(shard)
    assert sorted(back) == sorted(sd)  # no lm_head: tied
    for name, x in sd.items():
        np.testing.assert_array_equal(back[name], x, err_msg=name)
    settings = model_settings(GPT2, read_config(tmp_path / "out"))
    assert settings == model_settings(GPT2, read_config(directory))


@pytest.mark.parametrize(
    "change,words",
    [
        ({"activation_function": "relu"}, ["activation_function='relu'", "gelu_new"]),
        ({"tie_word_embeddings": False}, ["tie_word_embeddings=false"]),
        ({"scale_attn_by_inverse_layer_idx": True}, ["scale_attn_by_inverse_layer_idx"]),
    ],
)
def test_what_the_model_does_not_run_is_refused(change, words):
    with pytest.raises(ValueError) as err:
        GPT2.settings(CONFIG | change)
    for word in words:
        assert word in str(err.value), err.value


def test_a_wrong_fused_shape_names_the_tensor(tmp_path):
    sd = gpt2_state_dict()
    sd["transformer.h.0.attn.c_attn.weight"] = sd["transformer.h.0.attn.c_attn.weight"][:, :64]
    directory = write_gpt2(tmp_path / "bad", sd)
    mesh = CUBE.build(jax.devices()[:8])
    with pytest.raises(HFError, match=r"transformer.h.0.attn.c_attn.weight has shape \[32, 64\]"):
        load_model(directory, mesh, ParallelPlan(mesh=CUBE).rules)


def test_load_params_alone_picks_gpt2_from_config_json(imported):
    """``shardlib train --load-params DIR`` with no model named: the directory's
    ``model_type`` picks the family (the default model is a Llama)."""
    from shardlib.train.config import train_config
    from shardlib.train.init_from import with_source_model

    _, directory, _ = imported
    cfg = with_source_model(train_config(**{"checkpoint.init_from": str(directory)}))
    assert cfg.model == "gpt2"
    settings = dict(cfg.model_overrides)
    assert (settings["embed"], settings["layers"], settings["vocab"]) == (EMBED, LAYERS, VOCAB)


def test_a_base_model_checkpoint_without_the_prefix_imports(imported, tmp_path):
    """The hub's ``gpt2`` files are ``GPT2Model``'s: no ``transformer.`` prefix, plus the
    causal-mask buffers ``h.{i}.attn.bias`` (not read). Same weights, same model."""
    sd, _, model = imported
    base = {k.removeprefix("transformer."): v for k, v in sd.items()}
    base |= {f"h.{i}.attn.bias": np.tril(np.ones((1, 1, POSITIONS, POSITIONS), np.float32))
             for i in range(LAYERS)}  # fmt: skip
    directory = write_gpt2(tmp_path / "base", base)
    mesh = CUBE.build(jax.devices()[:8])
    again = load_model(directory, mesh, ParallelPlan(mesh=CUBE).rules)
    for name in ("embedding", "position_embedding"):
        np.testing.assert_array_equal(getattr(again, name)[...], getattr(model, name)[...])
    np.testing.assert_array_equal(again.blocks.attn.wv[...], model.blocks.attn.wv[...])
