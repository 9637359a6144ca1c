"""Greedy generation through the KV cache (``models/llama/cache.py``) for the families beyond
Llama: GPT (learned positions, biases, LayerNorm, GELU), Mixtral (``models/moe``, a router
per layer) and GLaM (MoE and dense layers in one stacked pair).

Each continuation ``shardlib generate`` produces on a sharded mesh must be the argmax of the
model's full forward pass recomputed at every step without a cache (GLaM: the logits of
cached chunks must be the forward's). Random tiny models
with weights larger than their initial values (so that positions and biases change the
argmax, which the tests check: the continuation is not one repeated token).
Marker ``hf``: the tokens equal ``transformers``' greedy ``generate`` for a tiny random
GPT-2 and Mixtral.
"""

import jax
import numpy as np
import pytest
from flax import nnx
from hf_models import make_hf

from shardlib.core.mesh import MeshSpec
from shardlib.core.model import resolve_model
from shardlib.parallel.plan import ParallelPlan
from shardlib.parallel.state import abstract_params
from shardlib.tools.generate import Sampling, generate
from shardlib.train.init_from import load_model

TENSOR_DATA = MeshSpec((("data", 2), ("tensor", 2)))
CUBE = MeshSpec((("data", 2), ("fsdp", 2), ("tensor", 2)))  # cpu-8-3d
EXPERT = MeshSpec((("data", 2), ("expert", 2), ("tensor", 2)))
PROMPT, NEW = 5, 6


def on(spec: MeshSpec):
    size = int(np.prod([n for _, n in spec.axes]))
    return spec.build(jax.devices()[:size]), ParallelPlan(mesh=spec).rules


def random_model(name: str, spec: MeshSpec, std: float, seed: int = 0, **overrides):
    """(model, mesh, rules): ``name`` on ``spec``'s mesh with N(0, std) weights (norm scales
    1 + N(0, std)), drawn on the host and placed in the model's layout: no initialiser is
    compiled, and the weights are large enough that positions and biases change the argmax."""
    mesh, rules = on(spec)
    factory = resolve_model(name, overrides)
    graphdef, abstract = abstract_params(lambda: factory.make(nnx.Rngs(0)), mesh, rules)
    rng = np.random.default_rng(seed)

    def draw(path, x):
        value = std * rng.standard_normal(x.shape, np.float32)
        if jax.tree_util.keystr(path).endswith("['scale']"):
            value += 1
        return jax.device_put(value.astype(x.dtype), x.sharding)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, abstract)), mesh, rules


def argmax_continuation(model, prompt_BP: np.ndarray, new: int, mesh) -> np.ndarray:
    """The prompt and ``new`` tokens, each the argmax of a full forward pass (no cache) over
    every token so far; the rest of the row is padding, which causality keeps unseen."""
    full = jax.jit(lambda m, t: m(t))
    b, p = prompt_BP.shape
    tokens = np.zeros((b, p + new), np.int32)
    tokens[:, :p] = prompt_BP
    with jax.set_mesh(mesh):
        for i in range(p, p + new):
            logits = full(model, tokens)
            logits = logits[0] if isinstance(logits, tuple) else logits  # MoE: (logits, aux)
            tokens[:, i] = np.argmax(np.asarray(logits)[:, i - 1], axis=-1)
    return tokens


def check_greedy(model, prompt_BP, mesh, rules) -> np.ndarray:
    out = generate(model, prompt_BP, mesh=mesh, rules=rules, sampling=Sampling(max_new_tokens=NEW))
    want = argmax_continuation(model, prompt_BP, NEW, mesh)
    np.testing.assert_array_equal(out.tokens, want)
    assert len(np.unique(want[:, PROMPT:])) > 2, want  # not a model stuck on one token
    return out.tokens


def test_gpt_greedy_cache_equals_argmax_without_cache():
    """gpt-tiny on data 2 x tensor 2: the learned position rows at start.. and the q/k/v and
    output biases on the cache path."""
    model, mesh, rules = random_model("gpt-tiny", TENSOR_DATA, 0.1)
    prompt = np.random.default_rng(0).integers(0, 256, (2, PROMPT)).astype(np.int32)
    check_greedy(model, prompt, mesh, rules)


@pytest.mark.slow
def test_mixtral_greedy_cache_equals_argmax_without_cache():
    """mixtral-tiny (an MoE layer in every block, dropless) on data 2 x expert 2 x tensor 2:
    the router and the experts' all-to-all on the cache path, the prompt routed as one group
    at prefill and each new token alone after it."""
    model, mesh, rules = random_model("mixtral-tiny", EXPERT, 0.1)
    prompt = np.random.default_rng(1).integers(0, 256, (2, PROMPT)).astype(np.int32)
    check_greedy(model, prompt, mesh, rules)


@pytest.mark.slow
def test_glam_cached_logits_equal_the_forward():
    """glam-tiny (one stacked MoE/dense pair, dropless) on cpu-8-3d, the cache holding both
    layers of the pair: 8 tokens fed as two chunks of 4 (the second attending to the
    first's cached keys; one compiled step, ``start`` traced) give the full forward's logits
    within 1e-5 (fp32)."""
    model, mesh, rules = random_model("glam-tiny", CUBE, 0.5, no_drop=True, layers=2)
    tokens = np.random.default_rng(2).integers(0, model.cfg.vocab, (2, 8)).astype(np.int32)
    step = jax.jit(lambda m, t, cache, start: m.decode(t, cache, start))
    with jax.set_mesh(mesh):
        cache = model.init_cache(2, 8)
        first, cache = step(model, tokens[:, :4], cache, 0)
        second, _ = step(model, tokens[:, 4:], cache, 4)
        want, _ = jax.jit(lambda m, t: m(t))(model, tokens)
    got = np.concatenate([first, second], axis=1)
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-5


def hf_greedy(directory, prompt_BP) -> np.ndarray:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor(prompt_BP), max_new_tokens=NEW, do_sample=False,
                          pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out.numpy()


@pytest.mark.hf
def test_gpt2_greedy_tokens_are_transformers(tmp_path):
    """A tiny random ``GPT2LMHeadModel``, imported on cpu-8-3d: ``generate``'s tokens are
    transformers' greedy ``generate``'s."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # weights, biases and positions off their small initial values
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    mesh, rules = on(CUBE)
    prompt = np.random.default_rng(0).integers(0, 256, (2, PROMPT))
    got = check_greedy(load_model(tmp_path, mesh, rules), prompt, mesh, rules)
    np.testing.assert_array_equal(got, hf_greedy(tmp_path, prompt))


@pytest.mark.hf
def test_mixtral_greedy_tokens_are_transformers(tmp_path):
    """A tiny random ``MixtralForCausalLM`` (4 experts, top 2; ``hf_models.make_hf``)
    imported on data 2 x expert 2 x tensor 2: the same tokens as transformers' greedy
    ``generate``."""
    make_hf("mixtral", tmp_path, 256)
    mesh, rules = on(EXPERT)
    prompt = np.random.default_rng(0).integers(0, 256, (2, PROMPT))
    got = check_greedy(load_model(tmp_path, mesh, rules), prompt, mesh, rules)
    np.testing.assert_array_equal(got, hf_greedy(tmp_path, prompt))
