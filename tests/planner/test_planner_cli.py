"""The planner's commands: ``shardlib estimate`` costs a given layout, ``shardlib plan --fix``
searches the rest, ``--json`` is one document on stdout, and bad input is one line on
stderr with exit code 2 (no traceback)."""

import json

import pytest

from shardlib import ShardingError
from shardlib.planner import PlanView, Workload, candidate, estimate, load_cluster
from shardlib.planner.search import Space, search
from shardlib.planner.validate import MAX_SIMULATED, simulable
from shardlib.tools.cli import main

MODEL = ["--model", "llama-7b", "--global-batch", "64", "--seq", "1024"]


def _json(capsys) -> dict:
    out = capsys.readouterr().out
    return json.loads(out)


def test_estimate_prints_what_cost_estimate_predicts(capsys):
    args = ["estimate", "--cluster", "a100-8", "--hosts", "2", *MODEL, "--json"]
    args += ["--set", "tensor=4,stage=2", "--set", "schedule=1f1b,microbatches=4"]
    assert main(args) == 0
    got = _json(capsys)
    cluster = load_cluster("a100-8").with_hosts(2)
    w = Workload.from_preset("llama-7b", 64, 1024)
    plan = candidate(data=2, stage=2, tensor=4, schedule="1f1b", microbatches=4)
    want = estimate(w, plan, cluster)
    assert got["mesh"] == {"data": 2, "stage": 2, "tensor": 4}
    assert got["memory_bytes"] == pytest.approx(want.memory)
    assert got["memory_total_bytes"] == pytest.approx(want.memory_bytes)
    for key in ("step_s", "compute_s", "bubble_s", "exposed_comm_s", "tokens_per_s", "mfu"):
        assert got[key] == pytest.approx(getattr(want, key)), key
    wire = {axes: row["wire_bytes"] for axes, row in got["axes"].items()}
    assert wire == pytest.approx(want.wire_by_axes())


def test_estimate_reads_the_plan_that_plan_wrote(tmp_path, capsys):
    out = tmp_path / "plan.toml"
    args = ["--cluster", "a100-8", *MODEL, "--json"]
    assert main(["plan", *args, "--out", str(out), "--top", "1"]) == 0
    best = _json(capsys)["plans"][0]
    assert main(["estimate", "--cluster", "a100-8", "--mesh", str(out), "--json"]) == 0
    again = _json(capsys)  # model, batch and seq come from the file's [train] table
    assert (again["model"], again["global_batch"], again["seq"]) == ("llama-7b", 64, 1024)
    assert again["mesh"] == best["mesh"] and again["step_s"] == pytest.approx(best["step_s"])


def test_fix_virtual_returns_only_plans_with_that_many_virtual_stages(
    tmp_path, capsys, monkeypatch
):
    """--fix virtual=2 (1F1B or circular) never hands back a v = 1 plan beside them; and
    without --out nothing is written into the current directory."""
    monkeypatch.chdir(tmp_path)
    args = ["plan", "--cluster", "a100-8", "--hosts", "2", *MODEL, "--json", "--top", "8"]
    assert main([*args, "--fix", "stage=2,virtual=2"]) == 0
    plans = _json(capsys)["plans"]
    assert plans
    for plan in plans:
        pipe = plan["parallel"]["pipeline"]
        assert pipe["virtual_stages"] == 2 and pipe["schedule"] in ("1f1b", "circular"), pipe
    assert main([*args, "--fix", "stage=2,schedule=1f1b,virtual=1"]) == 0
    for plan in _json(capsys)["plans"]:
        assert plan["parallel"]["pipeline"].get("virtual_stages", 1) == 1
    assert not list(tmp_path.iterdir())  # no plan.toml unasked


def test_fix_keeps_the_fixed_sizes_and_knobs(tmp_path, capsys):
    args = ["plan", "--cluster", "a100-8", "--hosts", "2", *MODEL, "--json"]
    args += ["--fix", "tensor=2,stage=2,remat=full", "--out", str(tmp_path / "p.toml")]
    assert main(args) == 0
    plans = _json(capsys)["plans"]
    assert plans
    for plan in plans:
        assert plan["mesh"]["tensor"] == 2 and plan["mesh"]["stage"] == 2
        assert plan["parallel"]["remat"] == {"policy": "full"}


def test_a_fixed_schedule_implies_stages():
    space = Space().fixing({"schedule": "circular", "virtual": 2})
    assert space.menu("schedule") == ("circular",) and space.menu("virtual") == (2,)
    assert space.required == ("stage",)
    w = Workload.from_preset("llama-7b", 64, 1024)
    best = search(w, load_cluster("a100-8"), space, top=2).best
    assert best and all(e.plan.pipeline.schedule == "circular" for e in best)
    assert all(dict(e.plan.mesh.axes).get("stage", 1) > 1 for e in best)


def test_why_not_simpler_reports_the_best_plan_of_each_family(tmp_path, capsys):
    args = ["plan", "--cluster", "a100-8", *MODEL, "--out", str(tmp_path / "p.toml")]
    assert main(args) == 0
    out = capsys.readouterr().out
    w, cluster = Workload.from_preset("llama-7b", 64, 1024), load_cluster("a100-8")
    fsdp = search(w, cluster, Space().fixing({"fsdp": 8}), top=1).best[0]
    knobs = PlanView(fsdp.plan).knobs_text()
    assert f"Pure FSDP (fsdp=8): best fsdp=8 ({knobs}), {fsdp.step_s:.3f} s" in " ".join(
        out.split()
    )


BAD = [  # (arguments, words the one-line error must contain)
    (["plan", "--cluster", "a100-8", "--model", "llama-70b", "--fix", "tensor=3"], "tensor=3"),
    (["plan", "--cluster", "a100-8", "--model", "llama-70b", "model.layers=400"], "fits on"),
    (["plan", "--cluster", "a100-8", "--fix", "pipeline=2"], "not a mesh axis or knob"),
    (["plan", "--cluster", "a100-8", *MODEL, "--fix", "fsdp=8,zero=1"], "settings together"),
    (["estimate", "--cluster", "a100-8", "--set", "tensor=16"], "tensor"),
    (["estimate", "--cluster", "a100-8"], "--mesh"),
    (["plan", "--cluster", "CLUSTER"], "lacks inter_host_gbps"),
]


@pytest.mark.parametrize("args, words", BAD)
def test_bad_input_is_one_line_with_a_fix_and_exit_2(tmp_path, capsys, args, words):
    cluster = tmp_path / "partial.toml"
    cluster.write_text(
        "[cluster]\ndevices_per_host = 8\nhosts = 1\nmemory_gb = 80.0\npeak_tflops = 312.0\n"
        "intra_host_gbps = 300.0\n"
    )
    args = [str(cluster) if a == "CLUSTER" else a for a in args]
    assert main([*args, "--out", str(tmp_path / "p.toml")] if args[0] == "plan" else args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and words in err
    assert len(err.strip().splitlines()) == 1 and "Fix" in err, err


def test_validate_shrinks_the_data_axis_past_2048_devices():
    w = Workload.from_preset("llama-7b", 4096, 1024)
    plan = candidate(data=512, tensor=8)
    small_w, small, note = simulable(w, plan)
    sizes = dict(small.mesh.axes)
    assert sizes == {"data": 256, "tensor": 8} and small_w.global_batch == 2048
    assert "2048" in note and sizes["data"] * sizes["tensor"] <= MAX_SIMULATED
    with pytest.raises(ShardingError, match="--hosts"):
        simulable(w, candidate(stage=64, tensor=64))


@pytest.mark.slow
def test_plan_validate_compiles_the_best_plan_and_says_where_it_peaks(capsys):
    """``plan --validate 1``: the best plan compiled on the simulated devices, predicted
    against compiled memory and wire bytes, and the pass the compiled step peaks in."""
    args = ["plan", "--model", "llama-tiny", "--cluster", "cpu-8-small", "--top", "1"]
    assert main([*args, "--global-batch", "16", "--seq", "64", "--validate", "1"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("predicted (cpu backend, fp32) vs compiled") :]
    row = next(line for line in table.splitlines() if "MiB" in line)
    cells = [cell.strip() for cell in row.split("│")[1:-1]]  # mesh, knobs, memory x 3, wire x 3
    memory_ratio, wire_ratio, peak = float(cells[4]), float(cells[7]), cells[8]
    assert 0.9 <= memory_ratio <= 1.1 and 0.95 <= wire_ratio <= 1.05, row
    assert peak in ("forward", "backward"), row
