"""FSDP's vocab-parallel embedding and head train exactly like one device (issue 16).

Under FSDP the embedding table and output projection split on vocab where that moves fewer
bytes (``strategies.fsdp.vocab_parallel_pays``); the lookup is then the explicit
reduce-scatter form of ``shardlib.core.lookup`` and the head's input is gathered over ``fsdp``
only. On data 2 x fsdp 2 x tensor 2 every part of it runs: the token gather and the
reduce-scatter over fsdp, the sum over tensor, and the gradient's sum over data.
"""

from jax.sharding import PartitionSpec as P

from shardlib import mesh_spec
from shardlib.tools.parity import FP32_TOLERANCE, check_parity
from shardlib.train.config import train_config
from shardlib.train.setup import make_setup

# vocab 2048 against 2 x 4 sequences x 16 tokens per FSDP group: vocab-parallel pays
CFG = train_config(steps=2, batch=8, seq=16, **{"model.vocab": 2048, "model.layers": 1})


def test_vocab_parallel_head_matches_one_device():
    mesh = mesh_spec(data=2, fsdp=2, tensor=2).build()
    specs = make_setup(CFG, mesh).param_specs
    assert specs["embedding"] == P(("fsdp", "tensor"))  # [vocab, embed]: rows split 4 ways
    assert specs["lm_head"] == P(None, ("fsdp", "tensor"))  # [embed, vocab]
    result = check_parity(CFG, mesh)
    assert result.max_rel_loss_err <= FP32_TOLERANCE, result
    assert result.max_rel_grad_err <= FP32_TOLERANCE, result
