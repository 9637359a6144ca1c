"""``attention_impl=auto``: the rule (``parallel.context.choice``), exercised for GPUs on a CPU
through a stubbed device, and what the trainer, ``explain`` and the planner do with it."""

from __future__ import annotations

import dataclasses

import pytest

from shardlib import ShardingError
from shardlib.core.attention import LocalAttention
from shardlib.core.workload import Workload
from shardlib.parallel.context import choice
from shardlib.parallel.context.choice import Device, Splits, choose, scores_bytes
from shardlib.planner.candidate import candidate
from shardlib.planner.cost.total import estimate
from shardlib.planner.inputs.cluster import load_cluster
from shardlib.train.config import override, train_config
from shardlib.train.setup import make_setup

H100 = Device("gpu", 80 * 2**30, hopper=True)
A100 = Device("gpu", 80 * 2**30, hopper=False)


def _w(precision="bf16", batch=4, seq=2048, **overrides) -> Workload:
    return Workload.from_preset("llama-1b", batch, seq, precision, **overrides)


def test_a_gpu_gets_cudnn_where_its_constraints_hold():
    picked = choose("auto", _w(), "none", Splits(), H100)
    assert picked.impl == "cudnn" and "head dim 64" in picked.reason
    # Ulysses hands each device whole, naturally ordered sequences: cuDNN still runs
    assert choose("auto", _w(), "all_to_all", Splits(seq=2), H100).impl == "cudnn"


@pytest.mark.parametrize(
    "workload, kind, device, words",
    [
        (_w(), "none", Device("cpu"), ["on cpu"]),
        (_w(), "none", Device("tpu", 95e9), ["on tpu"]),
        (_w("fp32"), "none", H100, ["bf16/fp16", "fp32"]),
        (_w(head_dim=132), "none", H100, ["multiples of 8", "132"]),
        (_w(head_dim=192), "none", A100, ["up to 128", "192"]),
        (_w(seq=2047), "none", H100, ["even", "2047"]),
        (_w(), "ring", H100, ["ring", "log-sum-exp"]),
        (_w(), "all_gather", H100, ["all_gather", "log-sum-exp"]),
    ],
)
def test_where_cudnn_cannot_run_the_reason_says_why(workload, kind, device, words):
    picked = choose("auto", workload, kind, Splits(), device)
    assert picked.impl == "dense"
    assert all(w in picked.reason for w in words), picked.reason


def test_hopper_takes_head_dims_up_to_256():
    assert choose("auto", _w(head_dim=192), "none", Splits(), H100).impl == "cudnn"


def test_chunked_where_dense_scores_would_not_fit():
    """fp32 on a GPU (no cuDNN), seq 16384, 4 sequences: 4·32·16384²·4 = 128 GiB of scores
    per layer, over an eighth of 80 GiB: chunked. Split 32 ways (batch 4, heads 8) they
    are 4 GiB, under 10 GiB: dense."""
    w = _w("fp32", batch=4, seq=16384)
    assert scores_bytes(w, Splits()) == 4.0 * 4 * 32 * 16384 * 16384
    picked = choose("auto", w, "none", Splits(), H100)
    assert picked.impl == "chunked" and "128.0 GiB per layer" in picked.reason
    assert choose("auto", w, "none", Splits(batch=4, heads=8), H100).impl == "dense"
    assert choose("auto", w, "ring", Splits(seq=2), H100).impl == "chunked"
    # no memory limit reported (the CPU backend): dense, whatever the size
    assert choose("auto", w, "none", Splits(), Device("cpu")).impl == "dense"


def test_an_explicit_kernel_is_kept_as_set():
    for impl in ("dense", "chunked", "cudnn"):
        picked = choose(impl, _w(), "none", Splits(), Device("cpu"))
        assert picked.impl == impl and "as set" in picked.reason


def test_auto_never_runs_undecided():
    with pytest.raises(ShardingError, match="for_workload"):
        LocalAttention("auto").kernel(True, 128)


def _setup(monkeypatch, device: Device | None, **settings):
    if device is not None:
        monkeypatch.setattr(choice, "device_of", lambda dev: device)
    cfg = override(train_config(model="llama-tiny", batch=8, seq=64, steps=1), settings)
    return make_setup(cfg)


def test_the_trainer_decides_once_with_the_backend_it_sees(monkeypatch):
    """On this CPU the default is dense; with the backend query stubbed to a GPU the same
    config runs cuDNN (bf16) or dense (fp32), and the setup carries the reason."""
    cpu = _setup(monkeypatch, None)
    assert cpu.plan.context.attention_impl == "dense" and "on cpu" in cpu.attention.reason
    gpu = _setup(monkeypatch, H100, precision="bf16")
    assert gpu.plan.context.attention_impl == "cudnn"
    assert gpu.attention.describe().startswith("attention cudnn: cuDNN fused kernel")
    fp32 = _setup(monkeypatch, H100, precision="fp32")
    assert fp32.plan.context.attention_impl == "dense" and "fp32" in fp32.attention.reason


def test_train_and_explain_print_the_choice(capsys):
    from shardlib.tools.cli import main

    args = ["--mesh", "cpu-8-dp", "model=llama-tiny", "batch=8", "seq=32", "steps=1"]
    assert main(["explain", *args]) == 0
    printed = " ".join(capsys.readouterr().err.split())
    assert "attention dense: cuDNN's fused kernel runs on GPUs; this run is on cpu" in printed


def test_the_planner_costs_auto_as_the_trainer_picks_on_the_cluster():
    """GPU presets book cuDNN (no score matrix), the TPU preset dense, and the estimate
    keeps the plan as given (a written plan says auto) with the pick in its notes."""
    w = _w(batch=64)
    for name, impl in (("h100-8", "cudnn"), ("tpu-v5p-128", "dense")):
        cluster = load_cluster(name)
        n = cluster.num_devices
        auto = estimate(w, candidate(data=n), cluster)
        pinned = estimate(w, candidate(data=n, attention=impl), cluster)
        assert auto.memory == pinned.memory and auto.step_s == pinned.step_s, name
        assert auto.plan.context.attention_impl == "auto"
        assert any(f"attention {impl}" in n for n in auto.notes), auto.notes
    cpu = estimate(w, candidate(data=8), backend="cpu")
    assert cpu.memory == estimate(w, candidate(data=8, attention="dense"), backend="cpu").memory


def test_packed_rows_refuse_only_the_chunked_kernel():
    LocalAttention("dense").check_packed()
    LocalAttention("cudnn").check_packed()
    with pytest.raises(ShardingError, match="chunked.*Fix: attention_impl=dense"):
        dataclasses.replace(LocalAttention(), impl="chunked").check_packed()


def test_estimate_names_the_kernel_it_costed_and_takes_it_as_a_setting(capsys):
    from shardlib.tools.cli import main

    args = ["estimate", "--model", "llama-1b", "--cluster", "h200-1", "--global-batch", "4"]
    args += ["--seq", "2048", "--set"]
    assert main([*args, "remat=none"]) == 0
    auto = " ".join(capsys.readouterr().out.split())
    assert "note: costed with attention cudnn: cuDNN fused kernel" in auto
    assert main([*args, "remat=none,attention=dense,loss_chunk=256"]) == 0
    pinned = " ".join(capsys.readouterr().out.split())
    assert "costed with attention" not in pinned and "MFU" in pinned
    assert main([*args, "attention=flash"]) == 2
    assert "attention is one of auto, dense, chunked, cudnn" in capsys.readouterr().err
