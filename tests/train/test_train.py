"""The training loop and the command line, end to end on 8 simulated devices."""

import json

import numpy as np
import pytest

from shardlib.core.mesh import MESHES_DIR
from shardlib.dataset.tokens import batch_starts, embedded_corpus
from shardlib.tools.cli import main


@pytest.mark.slow
def test_cli_train_writes_metrics_and_the_loss_falls(tmp_path):
    metrics = tmp_path / "run.jsonl"
    code = main(
        [
            "train",
            "--mesh",
            str(MESHES_DIR / "cpu-8-fsdp.toml"),
            "model.layers=1",
            "steps=25",
            "batch=16",
            "seq=32",
            f"metrics={metrics}",
        ]
    )
    assert code == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 26))
    for key in ("step", "loss", "step_time_s", "tokens_per_s", "grad_norm", "lr"):
        assert key in records[0]
    first, last = records[0]["loss"], np.mean([r["loss"] for r in records[-5:]])
    assert last < first - 1.0, (first, last)


def test_cli_reports_bad_input_without_a_traceback(capsys):
    assert main(["train", "--mesh", "cpu-8-tp", "model.kv_heads=4", "model.heads=12"]) == 2
    err = capsys.readouterr().err
    # 4 KV heads replicate over tensor=8 (fewer than the degree); 12 query heads cannot split
    assert "('heads', size 12)" in err and "tensor=8" in err and "Traceback" not in err
    assert main(["parity", "--mesh", "cpu-8-nope"]) == 2


def test_data_is_a_pure_function_of_seed_and_step():
    corpus = embedded_corpus()
    assert corpus.dtype == np.uint8 and len(corpus) > 1_000_000
    a = batch_starts(len(corpus), 3, 8, 64, seed=0)
    assert np.array_equal(a, batch_starts(len(corpus), 3, 8, 64, seed=0))
    assert not np.array_equal(a, batch_starts(len(corpus), 4, 8, 64, seed=0))


@pytest.mark.slow
def test_token_file_data(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(5000, dtype=np.uint16).tofile(path)
    code = main(
        [
            "train",
            "--mesh",
            "cpu-8-dp",
            "steps=2",
            "batch=8",
            "seq=16",
            f"data={path}",
            "model.vocab=5000",
            "model.layers=1",
        ]
    )
    assert code == 0
    assert main(["train", "--mesh", "cpu-8-dp", "steps=1", f"data={path}"]) == 2  # vocab 256


@pytest.mark.slow
def test_cli_explain_writes_the_layout_json(tmp_path):
    path = tmp_path / "layout.json"
    code = main(
        [
            "explain",
            "--mesh",
            "cpu-8-3d",
            "--json",
            str(path),
            "--peak",
            "model.layers=1",
            "batch=8",
            "seq=16",
        ]
    )
    assert code == 0
    doc = json.loads(path.read_text())
    memory = doc["memory_per_device"]
    peak = doc["memory_peak"]  # --peak: XLA's heap simulation at its peak, and where
    assert peak["live_bytes"] > 0 and peak["allocated_bytes"] == memory["total_bytes"]
    assert peak["where"].startswith("jit(train_step)/") and peak["phase"] in ("forward", "backward")
    assert doc["mesh"]["axes"] == {"data": 2, "fsdp": 2, "tensor": 2}
    assert doc["params"]["count"] > 0 and doc["params"]["bytes"] == 4 * doc["params"]["count"]
    memory = doc["memory_per_device"]
    assert memory["total_bytes"] == (
        memory["argument_bytes"]
        + memory["output_bytes"]
        - memory["alias_bytes"]
        + memory["temp_bytes"]
    )
    assert doc["flops_per_device"] > 0
    for kind in ("all-reduce", "all-gather"):
        assert set(doc["collective_totals"][kind]) >= {"count", "buffer_bytes", "wire_bytes"}
    specs = {t["path"]: t["spec"] for t in doc["tensors"]}
    assert any("wq" in p and "fsdp" in s and "tensor" in s for p, s in specs.items()), specs


@pytest.mark.slow
def test_cli_parity_exits_zero_when_layouts_agree(capsys):
    assert (
        main(
            ["parity", "--mesh", "cpu-8-3d", "--steps", "2", "batch=8", "seq=16", "model.layers=1"]
        )
        == 0
    )
    assert "PARITY OK" in capsys.readouterr().err


def test_the_dataset_section_keeps_its_old_name_data_as_an_alias():
    """``data`` now means data parallelism only; ``data=PATH`` and ``data.batch=8`` (typed
    before the section became ``dataset``) still set the dataset, and a checkpoint recorded
    under the old names is compared under the new ones."""
    from types import SimpleNamespace

    from shardlib.checkpoint.resume import _changed_settings
    from shardlib.train.config import parse_overrides

    cfg = parse_overrides(["data=tokens.bin", "data.batch=8", "data_microbatches=2"])
    assert (cfg.dataset.path, cfg.dataset.batch) == ("tokens.bin", 8)
    assert cfg.parallel.data.microbatches == 2  # the data-parallel section, as before
    assert parse_overrides(["dataset.seq=64"]).dataset.seq == 64
    old_record = {"data": {"batch": 16, "seq": 128}}
    changed = _changed_settings(old_record, SimpleNamespace(cfg=cfg))
    assert changed == ["dataset.batch 16 -> 8"], changed
