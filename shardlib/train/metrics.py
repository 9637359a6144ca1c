"""Per-step metrics: one writer interface, JSON lines, TensorBoard and W&B behind it; MFU.

Every writer gets the same record (a flat dict of numbers, ``step`` included) and any number
of them run at once; each is opened, and its destination checked, before the first step, so
a typo in a directory fails in a second rather than after compilation. TensorBoard files
come from tensorboardX (MaxText's choice: no TensorFlow needed); W&B is an optional extra.

MFU follows PaLM's definition (Chowdhery et al. 2022, appendix B): model FLOPs (forward
and backward, no recompute) per second over the devices' peak. The model FLOPs come from
the planner's count of the model (``Workload.model_flops``, 6 per parameter per token plus
attention), the compiled step's FLOPs (recompute and pipeline bubble included, loops
counted per trip) give HFU beside it. The peak is the bf16 dense figure of a table of known
devices; on a CPU it is measured once with a matmul and shared by the simulated devices.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Protocol

import jax
import jax.numpy as jnp

from shardlib.core.errors import ShardingError

# bf16 dense peak FLOP/s per device, from the vendors' data sheets (device_kind substring,
# most specific first)
PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A10G", 125e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("V100", 125e12),
    ("TPU v6", 918e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5", 459e12),
    ("TPU v4", 275e12),
)


class Writer(Protocol):
    """Where records go: ``write`` once per step, ``close`` once at the end."""

    def write(self, record: dict) -> None: ...

    def close(self) -> None: ...


def writable_dir(path: Path, what: str) -> Path:
    """``path`` created and proven writable, or a ShardingError naming it (before step 1)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".shardlib-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ShardingError(
            f"{what} {str(path)!r} cannot be written ({err.strerror}). Fix: choose a directory "
            "you can write to."
        ) from None
    return path


class JsonLines:
    """One JSON object per line; appended to on a resumed run."""

    def __init__(self, path: str, *, append: bool) -> None:
        writable_dir(Path(path).resolve().parent, "metrics.jsonl's directory")
        self._file = open(path, "a" if append else "w")  # noqa: SIM115 (closed in close)

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoard:
    """Scalars under ``train/<name>`` at their step, held-out figures (``eval_loss``,
    ``eval_perplexity``) under ``eval/<name>`` (tensorboardX event files)."""

    def __init__(self, directory: str) -> None:
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(str(writable_dir(Path(directory), "metrics.tensorboard")))

    def write(self, record: dict) -> None:
        step = int(record["step"])
        for name, value in record.items():
            if name != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                tag = f"eval/{name[5:]}" if name.startswith("eval_") else f"train/{name}"
                self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandB:
    """A W&B run; offline (synced later) unless WANDB_MODE says otherwise."""

    def __init__(self, project: str, directory: str, config: dict) -> None:
        try:
            import wandb
        except ImportError:
            raise ShardingError(
                "metrics.wandb is set but wandb is not installed. Fix: pip install wandb, or "
                "drop metrics.wandb."
            ) from None
        writable_dir(Path(directory), "metrics.wandb_dir")
        mode = os.environ.get("WANDB_MODE", "offline")
        self._run = wandb.init(project=project, dir=directory, config=config, mode=mode)

    def write(self, record: dict) -> None:
        self._run.log({k: v for k, v in record.items() if k != "step"}, step=int(record["step"]))

    def close(self) -> None:
        import wandb

        self._run.finish()
        teardown = getattr(wandb, "teardown", None)
        if teardown is not None:  # waits for W&B's service to write everything out
            teardown()


class Writers:
    """Several writers as one."""

    def __init__(self, writers: list[Writer]) -> None:
        self.writers = writers

    def write(self, record: dict) -> None:
        for w in self.writers:
            w.write(record)

    def close(self) -> None:
        for w in self.writers:
            w.close()


def open_writers(cfg, *, append: bool, config: dict) -> Writers:
    """The writers ``cfg`` (a ``Metrics`` section) sets, opened and checked."""
    writers: list[Writer] = []
    if cfg.jsonl:
        writers.append(JsonLines(cfg.jsonl, append=append))
    if cfg.tensorboard:
        writers.append(TensorBoard(cfg.tensorboard))
    if cfg.wandb:
        writers.append(WandB(cfg.wandb, cfg.wandb_dir, config))
    return Writers(writers)


def previous_records(cfg) -> list[dict]:
    """The records an earlier attempt of this run wrote to ``metrics.jsonl`` (for goodput)."""
    path = Path(cfg.jsonl) if cfg.jsonl else None
    if path is None or not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
    return out


# --- MFU -----------------------------------------------------------------------------------
_CPU_PEAK: float | None = None


def _measured_cpu_peak() -> float:
    """FLOP/s of one fp32 1024x1024 matmul on this host (all its cores), measured once."""
    global _CPU_PEAK
    if _CPU_PEAK is None:
        n = 1024
        x = jnp.ones((n, n), jnp.float32)
        matmul = jax.jit(lambda a: a @ a)
        matmul(x).block_until_ready()
        t0, reps = time.perf_counter(), 5
        for _ in range(reps):
            matmul(x).block_until_ready()
        _CPU_PEAK = reps * 2 * n**3 / (time.perf_counter() - t0)
    return _CPU_PEAK


def device_peak(device, override: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from)."""
    if override > 0:
        return override, "metrics.peak_flops"
    kind = device.device_kind
    for name, peak in PEAK_FLOPS:
        if name.lower() in kind.lower():
            return peak, f"{kind}: bf16 dense data-sheet peak"
    if device.platform == "cpu":
        shared = max(1, len(jax.local_devices()))
        peak = _measured_cpu_peak() / shared
        return peak, f"cpu: measured fp32 matmul, host shared by {shared} simulated devices"
    raise ShardingError(
        f"no peak FLOP/s known for device {kind!r}, so MFU cannot be computed. Fix: set "
        "metrics.peak_flops to one device's peak FLOP/s."
    )


def model_flops(setup) -> tuple[float, str]:
    """(forward + backward FLOPs of one step without recompute, how they were counted)."""
    try:
        return float(setup.workload.model_flops), "6 per parameter per token + attention"
    except (AttributeError, KeyError, ShardingError, TypeError):
        # a model whose dims the planner does not read: the parameter count alone
        tokens = setup.workload.global_batch * setup.workload.seq
        return 6.0 * setup.workload.param_count * tokens, "6 per parameter per token"


def compiled_flops(compiled) -> float:
    """FLOPs per device of one run of a compiled program, loops counted per trip."""
    from shardlib.analysis import hlo, hlo_flops

    module = hlo.parse_module(compiled.as_text())
    multipliers, _ = hlo.call_multipliers(module)
    return float(hlo_flops.count_flops(module, multipliers))
