"""DeepSpeed's own example configs, as published (``deepspeed_configs/``, sources in
``SOURCES.toml``): each trains a few steps on a simulated mesh of its GPU count, or is
refused only for features listed as having no counterpart, each named.
"""

import json
import math
import tomllib
from pathlib import Path

import jax
import pytest

from shardlib.interop.deepspeed import DeepSpeedRefusal, from_deepspeed
from shardlib.tools.deepspeed_cli import deepspeed_train_config
from shardlib.train.config import parse_overrides
from shardlib.train.loop import run
from shardlib.train.setup import make_setup

CONFIGS = Path(__file__).parent / "deepspeed_configs"
SOURCES = tomllib.loads((CONFIGS / "SOURCES.toml").read_text())
TRAINS = [name for name, entry in SOURCES.items() if not entry["refused"]]
REFUSED = [name for name, entry in SOURCES.items() if entry["refused"]]
# the tiny model, two steps; the batch stays the config's (4096 rows for 1-bit Adam: short rows)
WORDS = ["model=llama-tiny", "model.layers=1", "steps=2", "seq=2", "eval_every=0"]


def _config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def test_every_stored_config_is_listed_with_its_source():
    assert len(SOURCES) >= 10
    assert {p.stem for p in CONFIGS.glob("*.json")} == set(SOURCES)
    for entry in SOURCES.values():
        assert entry["repo"] and entry["path"].endswith(".json") and len(entry["commit"]) == 40


@pytest.mark.parametrize("name", REFUSED)
def test_refused_only_for_features_without_a_counterpart(name):
    entry = SOURCES[name]
    with pytest.raises(DeepSpeedRefusal) as err:
        from_deepspeed(_config(name), devices=entry["gpus"])
    assert err.value.unlisted == ()
    assert sorted(r.key for r in err.value.refused) == sorted(entry["refused"])
    for key in entry["refused"]:
        assert key in str(err.value)


@pytest.mark.parametrize("name", TRAINS)
def test_maps_to_a_config_on_its_gpu_count(name):
    """Fast: the mapping alone (no compile), and the batch identity on its GPUs."""
    entry = SOURCES[name]
    ds = from_deepspeed(_config(name), devices=entry["gpus"])
    cfg = parse_overrides(WORDS, deepspeed_train_config(ds, platform="cpu"))
    assert math.prod(cfg.parallel.mesh.sizes(entry["gpus"]).values()) == entry["gpus"]
    micro = cfg.dataset.batch // (cfg.parallel.data.microbatches * entry["gpus"])
    assert micro * cfg.parallel.data.microbatches * entry["gpus"] == cfg.dataset.batch


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINS)
def test_trains_on_a_simulated_mesh_of_its_gpu_count(name):
    entry = SOURCES[name]
    ds = from_deepspeed(_config(name), devices=entry["gpus"])
    cfg = parse_overrides(WORDS, deepspeed_train_config(ds, platform="cpu"))
    mesh = cfg.parallel.with_devices(entry["gpus"]).build_mesh(jax.devices()[: entry["gpus"]])
    result = run(make_setup(cfg, mesh), show=False)
    assert len(result.losses) == 2 and all(math.isfinite(x) for x in result.losses)
