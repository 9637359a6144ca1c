"""The planner's throughput model (``planner.cost.throughput``): formulas, overlap, and the plans
it ranks first. No compiles: shapes and estimates only."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pytest

from shardlib.core.mesh import MeshSpec
from shardlib.planner import PlanView, Workload, candidate, estimate, load_cluster
from shardlib.planner.calibrate.megatron import GPT_TRAFFIC, Megatron, megatron_program
from shardlib.planner.cost.kernels import LLAMA_TRAFFIC, TILE, Matmul
from shardlib.planner.cost.terms.base import Comm
from shardlib.planner.cost.throughput import BACKWARD_SHARE, collective_seconds, exposed_seconds
from shardlib.planner.search import Space, search

A100 = load_cluster("a100-8")
GPT_1_7B = dict(embed=2304, heads=24, kv_heads=24, head_dim=96, layers=24, mlp=6144, vocab=51200)


@pytest.fixture(scope="module")
def gpt_1_7b() -> Workload:
    """Narayanan et al.'s 1.7B shape (SwiGLU at GPT's MLP FLOPs), batch 512 x seq 2048."""
    return Workload.from_preset("llama-70b", 512, 2048, **GPT_1_7B)


def test_a_matmul_runs_at_the_roofline_with_a_half_wave_tail():
    big = Matmul("big", 8192, 8192, 8192)
    waves = (8192 / TILE) ** 2 / A100.sms
    compute = big.flops / (A100.peak_flops * A100.matmul_efficiency) * (waves + 0.5) / waves
    # each tile also waits on tile_transfers tile-sized HBM transfers at the SM's share
    tile_s = A100.tile_transfers * TILE * TILE * 2 * A100.sms / A100.hbm_bw
    assert big.seconds(A100, 2) == pytest.approx(compute + (waves + 0.5) * tile_s)
    # [4096, 64] x [64, 4096]: 32 FLOPs per byte, far below the A100's ops:byte ratio
    thin = Matmul("thin", 4096, 64, 4096)
    assert thin.seconds(A100, 2) == pytest.approx(thin.bytes(2) / A100.hbm_bw)
    # the same FLOPs in a smaller product per device run slower: the last wave idles
    small = Matmul("small", 256, 8192, 1024)
    per_flop = [mm.seconds(A100, 2) / mm.flops for mm in (big, small)]
    assert per_flop[1] > 1.1 * per_flop[0]


def test_a_short_inner_dimension_runs_further_below_the_ceiling_on_faster_tensor_cores():
    """The per-tile transfers cost the same whatever K: a d_model of 768 loses more of the
    ceiling than 8192, and the H100 (3.2x the A100's tensor rate, 1.6x its HBM) more than
    the A100."""
    h100 = load_cluster("h100-8")

    def fraction(cluster, k):
        mm = Matmul("mm", 65536, k, 3 * k)
        return mm.flops / mm.seconds(cluster, 2) / (cluster.peak_flops * cluster.matmul_efficiency)

    for cluster in (A100, h100):
        assert fraction(cluster, 768) < fraction(cluster, 8192) < 1.0
    assert fraction(h100, 2048) < fraction(A100, 2048)


def test_a_described_attention_kernel_pays_its_exponentials_and_mma_sync_on_hopper():
    """llm-foundry's Triton kernel (``planner.calibrate.llmfoundry``): products at its
    ceiling of the mma.sync rate (Hopper: 2/3 of the peak), one exponential per computed
    score (half of s x s under the causal mask) at the SFU rate. A 64-wide head pays the same
    exponentials for half the products: a lower FLOP rate than a 128-wide one."""
    from shardlib.planner.calibrate.llmfoundry import TRITON_ATTENTION
    from shardlib.planner.cost.kernels import Shape
    from shardlib.planner.cost.throughput import shape_rate

    h100 = load_cluster("h100-8")
    rates = {}
    for head_dim in (64, 128):
        w = Workload.from_preset("llama-70b", 8, 8192, embed=2048, heads=2048 // head_dim,
                                 kv_heads=2048 // head_dim, head_dim=head_dim, layers=2,
                                 mlp=5504, vocab=50368)  # fmt: skip
        for cluster in (A100, h100):
            shape = Shape(w, 1, 1, 1, 2, fused=True, attention=TRITON_ATTENTION)
            rate = shape_rate(shape, cluster)
            scores = Matmul("s", 8192, head_dim, 8192, w.heads)
            exps = 2 * 8192 * 8192 * w.heads / 2  # two layers, the causal half
            assert rate.seconds["softmax"] == pytest.approx(exps / cluster.sfu_rate)
            ceiling = TRITON_ATTENTION.ceiling * cluster.mma_sync_fraction
            per_layer = scores.flops / (cluster.peak_flops * cluster.matmul_efficiency * ceiling)
            assert rate.seconds["scores"] >= 2 * per_layer
            attention = sum(rate.seconds[k] for k in ("scores", "values", "softmax"))
            rates[head_dim, cluster.name] = 2 * 2 * scores.flops / attention / cluster.peak_flops
    for cluster in (A100, h100):
        assert rates[64, cluster.name] < rates[128, cluster.name]
        # the fraction of peak the kernel reaches: lower on Hopper (mma.sync, exponentials)
    assert rates[128, h100.name] < 0.75 * rates[128, A100.name]
    assert h100.mma_sync_fraction == pytest.approx(2 / 3, rel=0.01) and A100.mma_sync_fraction == 1


def test_fused_attention_writes_no_scores_and_saves_none():
    """attention_impl=cudnn (measured on an H200, docs/gpu.md): the planner costs it as
    one kernel. The score matrix leaves the activations (saved and recomputed) and the
    elementwise traffic; the two attention products move only q, k, v and the output."""
    h200 = load_cluster("h200-1")
    llama_1b = Workload.from_preset("llama-1b", 4, 2048)
    for remat in ("none", "full"):
        dense = estimate(llama_1b, candidate(remat=remat, attention="dense"), h200)
        fused = estimate(llama_1b, candidate(remat=remat, attention="cudnn"), h200)
        auto = estimate(llama_1b, candidate(remat=remat), h200)  # what the trainer picks
        assert auto.step_s == fused.step_s and auto.memory == fused.memory
        assert any("attention cudnn" in n for n in auto.notes)
        scores = 4 * 2048 * llama_1b.heads * 2048 * 2  # one layer's [b, h, s, s] in bf16
        assert dense.memory["activations"] - fused.memory["activations"] >= scores
        assert fused.compute_parts["elementwise"] < dense.compute_parts["elementwise"]
        assert fused.step_s < dense.step_s and fused.flops == dense.flops
    scores = Matmul("scores", 2048, 64, 2048, 32, moved=2 * 2048 * 64)
    assert scores.seconds(h200, 2) > scores.bytes(2) / h200.hbm_bw  # compute-bound now


def test_rate_grows_with_the_micro_batch_and_falls_with_tensor(gpt_1_7b):
    """What the search's bound relies on (one micro-batch is the fastest rate), and why
    tensor parallelism is not free even inside a host."""
    c = A100.with_hosts(4)
    eff = {
        (m, t): estimate(gpt_1_7b, candidate(data=32 // t, tensor=t, microbatches=m), c)
        for m in (1, 4)
        for t in (1, 8)
    }
    assert eff[1, 1].compute_efficiency >= eff[4, 1].compute_efficiency
    assert eff[1, 1].compute_efficiency > eff[1, 8].compute_efficiency
    assert 0.4 < eff[1, 8].compute_efficiency < eff[1, 1].compute_efficiency <= 0.81


def test_exposure_follows_the_strategy():
    """Tensor all-reduces always exposed; gradient reductions hidden up to the backward
    pass (and exposed with stages); the rest up to its window."""
    axes = (("data", 4), ("tensor", 8))
    grads = Comm("dp", "grads", "all-reduce", ("data",), 4, 4e9, 1, True)
    tp = Comm("tensor", "activations", "all-reduce", ("tensor",), 8, 1e8, 10, False)
    g, t = (collective_seconds(x, A100.with_hosts(4), axes) for x in (grads, tp))
    c4 = A100.with_hosts(4)
    compute = 10.0
    flat, staged = PlanView(candidate(data=4)), PlanView(candidate(data=2, stage=2))
    windows = {"backward": BACKWARD_SHARE * compute, "default": 0.8 * compute}
    assert exposed_seconds([grads, tp], c4, axes, windows, flat) == pytest.approx((t, g + t))
    assert exposed_seconds([grads, tp], c4, axes, windows, staged)[0] == pytest.approx(g + t)
    short = {"backward": 0.1 * g, "default": 0.1 * g}
    assert exposed_seconds([grads], c4, axes, short, flat)[0] == pytest.approx(0.9 * g)


def test_fsdp_hides_each_phase_behind_its_own_compute():
    """A layer's forward gather hides behind the forward only, its backward gather and its
    gradient reduction behind the backward only: 39B on 512 A100s (fsdp=512) gathers more
    in its forward (nine tensors a layer, each a 511-step ring) than 80% of the forward's
    compute, while all its traffic is about 80% of all compute; the forward's excess is
    exposed."""
    w = Workload.from_preset("gpt3-175b", 1536, 2048, embed=8192, layers=48, heads=64,
                             head_dim=128, vocab=51200)  # fmt: skip
    cluster = A100.with_hosts(64)
    est = estimate(w, candidate(fsdp=512, remat="selective"), cluster)
    compute = est.step_s - est.exposed_comm_s - est.update_s
    whole_step = max(0.0, est.comm_s - 0.8 * compute)  # one window for the whole step
    axes = candidate(fsdp=512).mesh.axes

    def phase(window):
        return sum(collective_seconds(c, cluster, axes) for c in est.comms if c.window == window)

    spill = max(0.0, phase("forward") - 0.8 * compute / 3)
    spill += max(0.0, phase("backward prefetch") - 0.8 * compute * 2 / 3)
    assert spill > 3 * whole_step
    assert est.exposed_comm_s == pytest.approx(spill, rel=0.02)


def test_tensor_across_hosts_is_slower_than_inside(gpt_1_7b):
    """The same mesh sizes, tensor innermost (NVLink) or outermost across hosts (IB)."""
    c = A100.with_hosts(4)
    inside = estimate(gpt_1_7b, candidate(data=4, tensor=8, remat="full"), c)
    plan = inside.plan
    crossed = dataclasses.replace(plan, mesh=MeshSpec((("tensor", 8), ("data", 4))))
    outside = estimate(gpt_1_7b, crossed, c)
    # one GPU per host in each tensor group: its NIC (24 GB/s) against NVLink (230 GB/s); the
    # data axis then stays inside hosts, where across them its rings had all eight NICs
    assert outside.exposed_comm_s > 4 * inside.exposed_comm_s
    assert outside.step_s > inside.step_s


def test_a_small_model_gets_no_ring_attention_and_tensor_stays_in_a_host(gpt_1_7b):
    """1.7B at seq 2048 on 32 A100s, tensor allowed across hosts: the pick has no context
    axis and tensor <= 8, and the top plans are ordered by time, not by memory."""
    result = search(gpt_1_7b, A100.with_hosts(4), Space(limits={"tensor": 32}), top=10)
    best = PlanView(result.best[0].plan)
    assert best["context"] == 1 and best["tensor"] <= 8
    steps = [e.step_s for e in result.best]
    assert steps == sorted(steps)
    ring = estimate(gpt_1_7b, candidate(fsdp=16, context=2, microbatches=2), A100.with_hosts(4))
    assert ring.step_s > result.best[0].step_s


def _benchmark(name: str):
    path = Path(__file__).parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_calibration_table_is_computed_from_the_model():
    """The benchmark's predicted TFLOP/s is the publication's FLOPs over the estimated step,
    and every calibration row lands within 15% of its published figure."""
    bench = _benchmark("planner_calibration")
    for run in bench.CALIBRATION:
        tflops, est = bench.predict(run)
        assert tflops == pytest.approx(run.flops() / (est.step_s * run.gpus) / 1e12)
        assert 0.85 <= tflops / run.published_tflops() <= 1.15, run
        assert math.isfinite(est.mfu) and 0.2 < est.mfu < 0.7


def test_megatron_program_moves_what_megatron_moves(gpt_1_7b):
    """Megatron's 1F1B sends b·s·h/t per GPU per hand-over, 2(m+p-1) of them (not
    shardlib's SPMD ring), 4 tensor all-reduces per layer (6 under full recompute), and its
    GPT block streams the attention scores fewer times (one fused softmax kernel, plus
    dropout) than XLA's dense attention as measured on a GPU."""
    c = A100.with_hosts(4)
    p, m, t = 4, 8, 8
    plan = candidate(stage=p, tensor=t, microbatches=m, remat="full", attention="dense")
    version = Megatron(sequence_parallel=False)
    ours = estimate(gpt_1_7b, plan, c)
    theirs = estimate(gpt_1_7b, plan, c, program=megatron_program(version))
    bsh = 512 // m * 2048 * 2304 * 2  # one micro-batch's activations, bf16
    sends = [x for x in theirs.comms if x.kind == "collective-permute"]
    assert sum(x.wire_bytes for x in sends) == pytest.approx(2 * (m + p - 1) * bsh / t)
    layers = [x for x in theirs.comms if x.strategy == "tensor" and x.what == "activations"]
    assert sum(x.count for x in layers) == 6 * 24 // p * m
    # across hosts (the stage axis): t times less than the whole b·s·h, and no ring
    assert theirs.wire_by_axes()["stage"] < ours.wire_by_axes()["stage"] / 10
    assert GPT_TRAFFIC.scores < LLAMA_TRAFFIC.scores and GPT_TRAFFIC.embed > LLAMA_TRAFFIC.embed
    assert theirs.compute_parts["elementwise"] < ours.compute_parts["elementwise"]
    assert theirs.update_s == ours.update_s > 0


def test_published_layouts_get_a_plan():
    """Two grid points of benchmarks/planner_scale.py (the time bound is the benchmark's)."""
    bench = _benchmark("planner_scale")
    for name, gpus, batch in bench.QUICK:
        row = bench.plan_point(name, gpus, batch, "a100-8")
        assert row["mfu"] is not None, row


def test_fp8_runs_the_projections_at_the_fp8_rate_where_they_compile_to_fp8_gemms():
    """precision=fp8 (measured on an H200, docs/gpu.md): under remat=full every projection
    product is an FP8 GEMM, twice the bf16 rate; otherwise only the forward third of them.
    Attention, the head and the elementwise work keep their bf16 seconds."""
    h200 = load_cluster("h200-1")
    seven = {"layers": 8}
    bf16 = Workload.from_preset("llama-7b", 4, 2048, "bf16", **seven)
    fp8 = Workload.from_preset("llama-7b", 4, 2048, "fp8", **seven)
    for remat, share in (("full", 1.0), ("none", 1 / 3), ("selective", 1 / 3)):
        plan = candidate(remat=remat)
        a, b = estimate(bf16, plan, h200), estimate(fp8, plan, h200)
        for name in ("qkv", "out", "mlp_in", "mlp_out"):
            assert b.compute_parts[name] / a.compute_parts[name] == pytest.approx(
                1 - share / 2, rel=0.02
            ), (remat, name)
        for name in ("scores", "values", "head", "elementwise"):
            assert b.compute_parts[name] == pytest.approx(a.compute_parts[name])
        assert b.step_s < a.step_s and b.memory_bytes == pytest.approx(a.memory_bytes, rel=0.01)
