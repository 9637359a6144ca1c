"""The training loop: data in, steps run, progress shown, metrics written."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from shardlib.train.checkpoints import RunCheckpoints
from shardlib.train.data import check_vocab, global_batch, load_tokens
from shardlib.train.precision import check_record
from shardlib.train.preempt import Preemption
from shardlib.train.setup import TrainSetup


@dataclass
class RunResult:
    """What a finished run reports: the per-step records and the final state."""

    records: list[dict] = field(default_factory=list)
    state: dict | None = None
    stopped_by: str | None = None
    """Why the run stopped before ``cfg.run.steps`` (a signal, or ``stop_after``); None if not."""
    checkpoint: Path | None = None
    """The last checkpoint this run saved (None without ``checkpoint_dir``)."""

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]


def batches(setup: TrainSetup, start: int = 0) -> Iterator[tuple[int, jax.Array]]:
    cfg = setup.cfg
    tokens = load_tokens(cfg.data.path)
    check_vocab(tokens, setup.target.dims.get("vocab", 0), cfg.data.path)
    b, s, seed = cfg.data.batch, cfg.data.seq, cfg.run.seed
    for step in range(start, cfg.run.steps):
        yield step, global_batch(tokens, step, b, s, seed, setup.batch_sharding)


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[tps]:>9,.0f} tok/s"),
        TextColumn("{task.fields[dt]:.3f} s/step"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def run(
    setup: TrainSetup,
    *,
    state: dict | None = None,
    show: bool = True,
    console: Console | None = None,
    stop_after: int | None = None,
) -> RunResult:
    """Train for ``setup.cfg.run.steps`` steps from ``state`` (None: the latest checkpoint in
    ``cfg.checkpoint.dir`` if there is one, else a fresh initialisation).

    Step times exclude nothing: the first step includes compilation and is marked so.
    Only process 0 prints and writes metrics. SIGTERM/SIGINT, or reaching step
    ``stop_after``, end the run at the next step boundary with a checkpoint.
    """
    cfg = setup.cfg
    leader = jax.process_index() == 0
    console = console or Console(stderr=True)

    def say(message: str) -> None:
        if leader:
            console.print(message, highlight=False)

    ckpt = RunCheckpoints(setup, say) if cfg.checkpoint.dir else None
    if state is None and ckpt is not None:
        state = ckpt.resume()
    state = setup.init_state() if state is None else state
    start = int(jax.device_get(state["step"]))
    tokens_per_step = cfg.data.batch * cfg.data.seq
    result = RunResult()
    with ExitStack() as stack:
        preempt = stack.enter_context(Preemption())
        if ckpt is not None:  # on leaving: waits until the last save is committed, while
            stack.enter_context(ckpt)  # the signal handlers still keep SIGTERM from killing it
        sink = None
        if cfg.run.metrics and leader:
            Path(cfg.run.metrics).parent.mkdir(parents=True, exist_ok=True)
            sink = stack.enter_context(open(cfg.run.metrics, "a" if start else "w"))
        progress = None
        if show and leader:
            progress = stack.enter_context(_progress(console))
            task = progress.add_task(
                "train", total=cfg.run.steps, completed=start, loss=float("nan"), tps=0.0, dt=0.0
            )
        for step, tokens in batches(setup, start):
            t0 = time.perf_counter()
            state, metrics = setup.train_step(state, tokens)
            metrics = jax.device_get(metrics)  # waits for the step: honest step times
            dt = time.perf_counter() - t0
            record = {
                "step": step + 1,
                "loss": float(metrics["loss"]),
                "grad_norm": float(metrics["grad_norm"]),
                "lr": float(metrics["lr"]),
                "step_time_s": dt,
                "tokens_per_s": tokens_per_step / dt,
                "compiled": step == start,
            }
            record.update({k: float(v) for k, v in metrics.items() if k not in record})
            check_record(record, cfg.precision)  # fp16 overflow at the minimum loss scale
            result.records.append(record)
            if sink:
                sink.write(json.dumps(record) + "\n")
                sink.flush()
            if progress is not None:
                progress.update(
                    task, advance=1, loss=record["loss"], tps=record["tokens_per_s"], dt=dt
                )
            done = step + 1
            if done < cfg.run.steps and (preempt.should_stop(done) or done == stop_after):
                result.stopped_by = preempt.reason or f"stop_after={stop_after}"
            if ckpt is not None:
                ckpt.after_step(state, done, final=bool(result.stopped_by) or done == cfg.run.steps)
            if result.stopped_by:
                break
    result.state = state
    result.checkpoint = ckpt.last if ckpt is not None else None
    if result.stopped_by:
        where = (
            f"checkpoint saved to {result.checkpoint}; run the same command to resume"
            if result.checkpoint
            else "no checkpoint_dir set, so nothing was saved"
        )
        say(f"stopped by {result.stopped_by} after step {done}: {where}")
    return result
