"""LoRA on GPT (``models/gpt/model.py`` with ``models/llama/lora.py``'s factors): adapters on
q, k, v (the blocks of GPT-2's fused ``c_attn``), o, fc and proj, sharded like their base
weights.

One trainer step on data 2 from a random state (every adapter factor non-zero)
moves the adapters and nothing else. The merged weights W + (alpha / rank) A @ B (what the
GPT-2 export writes) with the adapters zeroed give the adapted model's logits within 1e-5
(fp32), and the KV-cache path reads the adapted weights too (prefill logits = the forward's).
"""

import jax
import numpy as np
import pytest
from flax import nnx
from layout_cases import first_devices_mesh

from shardlib.core.model import hf_adapter
from shardlib.interop.hf_io import flatten, unflatten
from shardlib.tools.parity import random_state
from shardlib.train.config import train_config
from shardlib.train.setup import make_setup

TARGETS = ("q", "k", "v", "o", "fc", "proj")
LORA = {"lora.rank": "4", "lora.alpha": "8.0", "lora.targets": ",".join(TARGETS)}
CFG = train_config(model="gpt-tiny", steps=1, batch=4, seq=16, lr=1e-2, warmup=1, **LORA)


@pytest.fixture(scope="module")
def trained():
    """(setup, the random starting parameters, the parameters after one train step), flat
    host arrays; the trainer's own step, on random tokens."""
    setup = make_setup(CFG, first_devices_mesh(data=2, tensor=2))
    state = random_state(setup, seed=3)
    batch = setup.abstract_batch()
    tokens = np.random.default_rng(0).integers(0, 256, batch.shape).astype(batch.dtype)
    with jax.set_mesh(setup.mesh):
        after, _ = setup.train_step(
            jax.device_put(setup.stored(state), setup.state_shardings),
            jax.device_put(tokens, batch.sharding),
        )
    natural = jax.device_get(setup.natural(after["params"]))
    return setup, flatten(state["params"]), flatten(natural)


@pytest.mark.slow
def test_one_step_moves_the_adapters_only(trained):
    setup, before, after = trained
    adapters = sorted(p for p in before if "/lora_" in p)
    assert len(adapters) == 2 * len(TARGETS)  # an A and a B per target
    assert setup.inventory.param_count == setup.model.config.param_count()
    for path, x in before.items():
        moved = float(np.max(np.abs(np.asarray(after[path]) - x)))
        if path in adapters:
            assert moved > 1e-4, path
        else:
            assert moved == 0.0, path  # frozen: base weights, biases, norms, embeddings


@pytest.mark.slow
def test_merged_weights_give_the_adapted_logits(trained):
    setup, _, params = trained
    model_settings = {"lora_rank": 4, "lora_alpha": 8.0}
    merged = hf_adapter("gpt-tiny").merged(params, model_settings)
    assert not any("/lora_" in p for p in merged)
    scale = 8.0 / 4
    a, b = params["blocks/mlp/lora_fc_a"], params["blocks/mlp/lora_fc_b"]
    want = params["blocks/mlp/w_fc"] + scale * np.einsum("lir,lro->lio", a, b)
    np.testing.assert_allclose(merged["blocks/mlp/w_fc"], want, rtol=1e-6, atol=1e-7)

    # the merged weights with zero B factors: the same program (one compile), no update
    zero_b = {p: np.zeros_like(x) for p, x in params.items() if "/lora_" in p and p[-2:] == "_b"}
    forward = jax.jit(lambda p, t: nnx.merge(setup.graphdef, p)(t))
    tokens = np.random.default_rng(0).integers(0, 256, (2, 8)).astype(np.int32)
    want = forward(unflatten(params), tokens)
    assert rel_err(forward(unflatten(params | merged | zero_b), tokens), want) < 1e-5
    assert rel_err(forward(unflatten(params | zero_b), tokens), want) > 1e-3  # B matters

    def prefill(p, t):
        model = nnx.merge(setup.graphdef, p)
        return model.decode(t, model.init_cache(*t.shape), 0)[0]

    assert rel_err(jax.jit(prefill)(unflatten(params), tokens), want) < 1e-5  # cache weights()


def rel_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(b)))
