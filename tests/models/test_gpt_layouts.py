"""GPT trains like one device under every strategy it can use (fp32, relative error <= 1e-5
on the losses, the gradient norms and the first step's gradients, leaf by leaf): data
parallelism, FSDP, tensor parallelism, GPipe and 1F1B pipelines (1F1B runs the tied head,
which reads the embedding table, inside its loop on the last stage and adds its gradient
to the embedding's) and context parallelism (whose zig-zag token order the position
embedding follows).

One leaf is compared apart: the key bias's gradient is zero in exact arithmetic (q . b_k
adds the same to every score of a query, and softmax ignores a shift), so what both runs
hold there is rounding (1e-11 against gradients of order 1) and a relative error of it
means nothing; it is checked to be that small instead. The reference is one device,
computed once per config (``tests/layout_cases.py``).
"""

import dataclasses

import numpy as np
import pytest
from layout_cases import first_devices_mesh, one_device_reference

from shardlib.tools.parity import FP32_TOLERANCE, compare_traces, trace
from shardlib.train.config import override, train_config
from shardlib.train.setup import make_setup

CFG = train_config(model="gpt-tiny", steps=3, batch=16, seq=32, **{"model.layers": "4"})

CASES = {  # name: (mesh axes, config overrides); data parallelism: fsdp8 splits the batch too
    "fsdp8": ({"fsdp": 8}, {}),
    "tp8": ({"tensor": 8}, {}),  # gpt-tiny: 8 heads, mlp 256, vocab 256
    # Megatron-SP: the LayerNorms, biases and learned positions on sequence-split activations
    "fsdp2-tp4-sp": ({"fsdp": 2, "tensor": 4}, {"sequence_parallel": True}),
    "1f1b-p2-fsdp2-tp2": (
        {"stage": 2, "fsdp": 2, "tensor": 2},
        {"pipeline_schedule": "1f1b", "pipeline_microbatches": 4},
    ),
    "gpipe-p2-fsdp2-tp2": (  # embedding and head outside the stage loop
        {"stage": 2, "fsdp": 2, "tensor": 2},
        {"pipeline_schedule": "gpipe", "pipeline_microbatches": 4},
    ),
    # zig-zag ring attention reorders each sequence: the learned positions follow the tokens
    "ring-cp4-fsdp2": ({"context": 4, "fsdp": 2}, {"attention": "ring"}),
}


def _without_key_bias(t):
    attn = {k: v for k, v in t.grads["blocks"]["attn"].items() if k != "bk"}
    grads = {**t.grads, "blocks": {**t.grads["blocks"], "attn": attn}}
    return dataclasses.replace(t, grads=grads), t.grads["blocks"]["attn"]["bk"]


@pytest.mark.slow  # the fast subset's pipeline smoke test is test_pipeline.py's (FAST)
@pytest.mark.parametrize("name", list(CASES))
def test_gpt_parity_fp32(name):
    axes, overrides = CASES[name]
    ref, state = one_device_reference(CFG)
    got = trace(make_setup(override(CFG, overrides), first_devices_mesh(**axes)), state)
    (got, got_bk), (ref, ref_bk) = _without_key_bias(got), _without_key_bias(ref)
    result = compare_traces(got, ref)
    print(f"{name}: loss {result.max_rel_loss_err:.1e} grad norm "
          f"{result.max_rel_grad_norm_err:.1e} grads {result.max_rel_grad_err:.1e}")  # fmt: skip
    assert result.ok(), result
    scale = FP32_TOLERANCE * min(ref.grad_norms)  # the key bias: rounding only, in both
    assert max(np.linalg.norm(got_bk), np.linalg.norm(ref_bk)) <= scale
