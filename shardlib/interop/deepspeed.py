"""A DeepSpeed ``ds_config.json`` as shardlib settings and a mesh (``train --deepspeed``).

Every key is accounted for, one of three ways:

* mapped to a setting (``train_batch_size`` -> ``dataset.batch``, ``zero_optimization.stage``
  -> ``zero``, ``optimizer`` -> ``optimizer.*``, a static ``fp16.loss_scale`` ->
  ``precision.loss_scale``, LAMB's (and 1-bit LAMB's)
  ``max_coeff``/``min_coeff`` -> ``trust_ratio_max/min``,
  ``activation_checkpointing`` -> ``remat``, ...);
* a *note* (``deepspeed_keys.NOTES``): a key that tunes how DeepSpeed's runtime does
  something XLA decides by itself (bucket and prefetch sizes, overlap, persistence
  thresholds, ``sub_group_size``, ``aio``), only logs, or that DeepSpeed itself ignores; the
  note says so, and nothing changes. ``"auto"`` (Hugging Face's placeholder) leaves
  shardlib's own setting;
* refused: a feature shardlib does not have (``deepspeed_keys.NO_COUNTERPART``, NVMe
  offload of parameters, 0/1 Adam), or a value it cannot honour. All of them are named in one
  error (``DeepSpeedRefusal``), with the reason for each, before anything is built: nothing is
  silently ignored.

DeepSpeed's defaults differ from shardlib's in places, and the DeepSpeed meaning wins: no
``gradient_clipping`` means no clipping; no ``scheduler`` means a constant learning rate;
optimizer parameters left out take DeepSpeed's defaults (weight decay 0, betas 0.9/0.999,
LAMB's trust ratio bounded to [0.01, 10]).

The batch identity ``train_batch_size = micro x accumulation x data-parallel size`` is checked
on the devices given; ``implied_devices`` is the count a config is written for, which the CLI
simulates when no mesh is given.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import MESHES_DIR, load_mesh
from shardlib.interop import deepspeed_sections as sections
from shardlib.interop.deepspeed_keys import (
    AUTO_SETTINGS,
    AUTOTUNED,
    DEFAULTS_ONLY,
    NO_COUNTERPART,
    NOTES,
    NVME,
    NVME_DEFAULT_PATH,
    NVME_PARTITIONED,
)


@dataclass(frozen=True)
class Refusal:
    """One key the config sets that shardlib cannot honour."""

    key: str
    """The dotted ds_config key."""
    why: str
    """The reason, and the fix where there is one."""
    listed: bool = False
    """A feature listed as having no counterpart (``NO_COUNTERPART``, NVMe, ``WHY_NOT``),
    rather than a value out of range or a key shardlib does not know."""


class DeepSpeedRefusal(ShardingError):
    """A ds_config with settings shardlib cannot honour; ``refused`` names each one."""

    def __init__(self, message: str, refused: tuple[Refusal, ...]):
        super().__init__(message)
        self.refused = refused

    @property
    def unlisted(self) -> tuple[Refusal, ...]:
        """Refusals not for a feature listed as having no counterpart."""
        return tuple(r for r in self.refused if not r.listed)


@dataclass(frozen=True)
class DeepSpeedPlan:
    """What a ds_config means in shardlib: settings, mesh axes and notes."""

    settings: dict[str, Any]
    """Full dotted shardlib settings (``dataset.batch``, ``parallel.data.zero``, ...)."""
    mesh: dict[str, int]
    """Mesh axes, outer first: ``data`` (and ``fsdp`` for hpZ's nodes x devices per node)."""
    notes: tuple[str, ...]
    """Keys that need no counterpart, each with the reason."""

    def mesh_argument(self) -> str:
        """A preset in ``meshes/`` with exactly these axes, else a TOML to write."""
        for path in sorted(MESHES_DIR.glob("*.toml")):
            spec = load_mesh(path)
            if dict(spec.axes) == self.mesh and not spec.parallel and not spec.train:
                return path.stem
        return "mesh.toml  # with: [mesh] " + ", ".join(f"{a} = {n}" for a, n in self.mesh.items())

    def command(self) -> str:
        """The equivalent ``shardlib train`` command line."""
        words = [f"{k}={_word(v)}" for k, v in self.settings.items()]
        return f"shardlib train {' '.join(words)} --mesh {self.mesh_argument()}"


def _word(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


class _Reader:
    """Walks the config, recording what each key became; collects refusals."""

    def __init__(self, config: Mapping):
        self.config, self.used, self.auto = config, set(), set()
        self.refused: list[Refusal] = []
        self.notes: list[str] = []

    def get(self, path: str, default: Any = None) -> Any:
        """The value at ``path``; ``default`` where absent or ``"auto"``."""
        node: Any = self.config
        for part in path.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return default
            node = node[part]
        self.used.add(path)
        if isinstance(node, list) and node and path in AUTOTUNED:
            self.notes.append(f"{path}: {node} is a search space for DeepSpeed's autotuner, "
                              f"which is not run; the first, {node[0]}")  # fmt: skip
            node = node[0]
        if node == "auto":  # a Hugging Face placeholder: the value shardlib would choose
            self.auto.add(path)
            self.notes.append(f"{path}: 'auto', so shardlib's own setting (NAME=VALUE sets it)")
            return default
        return node

    def refuse(self, path: str, why: str, *, listed: bool = False) -> None:
        self.refused.append(Refusal(path, why, listed))

    def leftovers(self) -> None:
        """Every key neither read nor noted is refused; noted keys become notes."""

        def walk(node: Mapping, prefix: str) -> None:
            for key, value in node.items():
                path = prefix + key
                if path in NOTES:
                    self.notes.append(f"{path}: {NOTES[path]}")
                elif path in NO_COUNTERPART:
                    if isinstance(value, Mapping) and value.get("enabled") is False:
                        self.notes.append(f"{path}: disabled")
                    else:
                        self.refuse(path, NO_COUNTERPART[path], listed=True)
                elif path in DEFAULTS_ONLY:
                    if value != DEFAULTS_ONLY[path]:
                        self.refuse(path, f"only {DEFAULTS_ONLY[path]!r} is supported")
                elif isinstance(value, Mapping) and path not in self.used:
                    walk(value, path + ".")
                elif path not in self.used and not any(u.startswith(path + ".") for u in self.used):
                    self.refuse(path, "not a key shardlib knows (a misspelling?)")

        walk(self.config, "")


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _batch_keys(r: _Reader) -> tuple[int | None, int | None, int | None]:
    total, micro, accum = (r.get(key) for key in BATCH_KEYS)
    return total, micro, accum


def fitting_devices(total: int, micro: int | None, accum: int | None) -> list[int]:
    """Data-parallel sizes for which DeepSpeed's identity ``total = micro x accum x N`` can
    hold, a missing ``micro`` or ``accum`` being DeepSpeed's to derive."""
    known = (micro or 1) * (accum or 1)
    if total % known:
        return []
    rest = total // known
    if micro and accum:
        return [rest]
    return [n for n in range(1, rest + 1) if rest % n == 0]


def implied_devices(config: Mapping) -> int | None:
    """The devices a ds_config is written for, from its batch identity: ``train_batch_size /
    (micro x accumulation)``, a missing one taken as 1 (None without ``train_batch_size``)."""
    r = _Reader(config)
    total, micro, accum = _batch_keys(r)
    if not isinstance(total, int) or total < 1:
        return None
    fits = fitting_devices(total, micro, accum)
    return fits[-1] if fits else None


def _batch(r: _Reader, dp: int) -> dict[str, Any]:
    """DeepSpeed's identity train_batch_size = micro x accumulation x data-parallel size."""
    total, micro, accum = _batch_keys(r)
    given = {k: v for k, v in (("train_batch_size", total),
             ("train_micro_batch_size_per_gpu", micro),
             ("gradient_accumulation_steps", accum)) if v is not None}  # fmt: skip
    if not given:  # absent or 'auto' (the Hugging Face Trainer's to fill): shardlib's batch
        if not any(p in r.used for p in BATCH_KEYS):
            r.notes.append(
                "train_batch_size: not given (DeepSpeed needs it, the Hugging Face Trainer "
                "fills it in); shardlib's batch (batch=, microbatches=)"
            )
        return {}
    if total is None:
        accum = accum or 1
        total = (micro or 1) * accum * dp
    elif micro is None:
        accum = accum or 1
        micro = total // (accum * dp)
    elif accum is None:
        accum = total // (micro * dp)
    if micro * accum * dp != total or min(micro, accum) < 1:
        named = ", ".join(f"{k}={v}" for k, v in given.items())
        micro_given = given.get("train_micro_batch_size_per_gpu")
        fits = fitting_devices(total, micro_given, given.get("gradient_accumulation_steps"))
        written = " or ".join(map(str, fits[-4:])).replace(" or ", ", ", len(fits[-4:]) - 2)
        fix = (f": to try it as written, leave out --mesh (shardlib then simulates {fits[-1]} "
               f"CPU devices) or pass --cpu-devices {fits[-1]}" if fits else
               "; give two of the three, or values whose product holds")  # fmt: skip
        r.refuse(
            "train_batch_size",
            f"{named} break DeepSpeed's identity train_batch_size = "
            f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel "
            f"size on {dp} devices" + (f"; it holds on {written} GPUs" if fits else "") + fix,
        )
        return {}
    return {"dataset.batch": total, "parallel.data.microbatches": accum}


def _offload(r: _Reader, part: str, setting: str) -> dict[str, Any]:
    device = r.get(f"zero_optimization.{part}.device", "none")
    if device == "cpu":
        return {f"parallel.offload.{setting}": True}
    if device == "nvme" and part == "offload_optimizer":  # ZeRO-Infinity's state tier
        path = r.get(f"zero_optimization.{part}.nvme_path", NVME_DEFAULT_PATH)
        r.used.add(f"zero_optimization.{part}")  # buffer_count, pipeline_*: its own streaming
        r.notes.append(
            f"zero_optimization.{part}: nvme, the state in files under {path} "
            "(parallel.offload.nvme_path: shardlib train streams it one layer at a time)"
        )
        return {f"parallel.offload.{setting}": True, "parallel.offload.nvme_path": str(path)}
    optimizer_nvme = r.get("zero_optimization.offload_optimizer.device", "none") == "nvme"
    stage = r.get("zero_optimization.stage", 0)
    if device == "nvme" and optimizer_nvme and stage:  # each rank's own partition in files
        r.refuse(f"zero_optimization.{part}.device", NVME_PARTITIONED.format(stage=stage),
                 listed=True)  # fmt: skip
        r.used.add(f"zero_optimization.{part}")
        return {}
    if device == "nvme" and optimizer_nvme:  # ZeRO-Infinity's weights, next to the state
        path = r.get(f"zero_optimization.{part}.nvme_path", NVME_DEFAULT_PATH)
        r.used.add(f"zero_optimization.{part}")  # buffer_count, buffer_size: its own streaming
        r.notes.append(
            f"zero_optimization.{part}: nvme, the stacked weights in files next to the "
            f"optimizer state's (parallel.offload.nvme_params; {path} is not read: the "
            "state's nvme_path holds both); the layer loop reads one layer at a time"
        )
        return {"parallel.offload.nvme_params": True}
    if device == "nvme":
        r.refuse(f"zero_optimization.{part}.device", NVME, listed=True)
        r.used.add(f"zero_optimization.{part}")  # its NVMe tuning means nothing without it
    elif device not in ("none", None):
        r.refuse(f"zero_optimization.{part}.device", f"{device!r}: only cpu or none")
    return {}


def _zero(r: _Reader, devices: int) -> tuple[dict[str, Any], dict[str, int]]:
    if isinstance(r.config.get("zero_optimization"), bool):  # DeepSpeed's first form
        on = r.get("zero_optimization")
        r.notes.append(f"zero_optimization: {str(on).lower()}, the old form of stage {int(on)}")
        return {"parallel.data.zero": int(on)}, {"data": devices}
    z = lambda key, default=None: r.get(f"zero_optimization.{key}", default)  # noqa: E731
    out: dict[str, Any] = {"parallel.data.zero": z("stage", 0)}
    out.update(_offload(r, "offload_optimizer", "optimizer"))
    out.update(_offload(r, "offload_param", "params"))
    if z("cpu_offload", False):  # DeepSpeed's older spellings
        out["parallel.offload.optimizer"] = True
    if z("cpu_offload_params", False):
        out["parallel.offload.params"] = True
    if z("zero_quantized_weights", False):
        out["parallel.data.quantized_weights"] = True
    if z("zero_quantized_gradients", False):
        out["parallel.data.quantized_gradients"] = True
    hpz = int(z("zero_hpz_partition_size", 1))
    if hpz > 1:
        if devices % hpz or hpz == devices:
            r.refuse("zero_optimization.zero_hpz_partition_size",
                     f"{hpz} must divide the {devices} devices into 2 or more nodes")  # fmt: skip
            return out, {"data": devices}
        out["parallel.data.hpz"] = True
        return out, {"data": devices // hpz, "fsdp": hpz}
    return out, {"data": devices}


def from_deepspeed(config: Mapping, devices: int) -> DeepSpeedPlan:
    """Map a parsed ds_config to shardlib settings on ``devices`` devices (see the module)."""
    r = _Reader(config)
    zero, mesh = _zero(r, devices)
    settings = {**_batch(r, devices), **zero}
    settings["optimizer.clip_norm"] = r.get("gradient_clipping", 0.0)
    for section in (sections.precision, sections.optimizer, sections.scheduler,
                    sections.activation_checkpointing, sections.monitors):  # fmt: skip
        settings.update(section(r))
    for path in r.auto:
        for setting in AUTO_SETTINGS.get(path, ()):
            settings.pop(setting, None)
    r.leftovers()
    if r.refused:
        raise DeepSpeedRefusal(
            f"ds_config: {len(r.refused)} unsupported setting(s): "
            + "; ".join(f"{x.key}: {x.why}" for x in r.refused)
            + ". Fix: remove or change them as each reason says (shardlib README, 'DeepSpeed "
            "users').",
            tuple(r.refused),
        )
    return DeepSpeedPlan(settings=settings, mesh=mesh, notes=tuple(r.notes))


def read_deepspeed(path: str | Path) -> Mapping:
    """A ds_config.json file, parsed."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ShardingError(f"ds_config {path}: {err}. Fix: a readable JSON file.") from err
    if not isinstance(config, Mapping):
        raise ShardingError(f"ds_config {path}: not a JSON object.")
    return config


def load_deepspeed(path: str | Path, devices: int) -> DeepSpeedPlan:
    """Read and map a ds_config.json file."""
    return from_deepspeed(read_deepspeed(path), devices)
