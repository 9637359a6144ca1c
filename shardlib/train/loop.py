"""The training loop: data in, steps run, progress shown, metrics written.

Each step's record holds the loss, learning rate, gradient norm, step time, tokens/s, MFU
and HFU (``train.metrics``), memory in use where the backend reports it, the loss scale and
MoE statistics where they apply, and the running goodput (``train.goodput``); every
``dataset.eval_every`` steps it also holds the held-out ``eval_loss`` and ``eval_perplexity``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from shardlib.checkpoint.resume import RunCheckpoints
from shardlib.checkpoint.store import jsonable
from shardlib.core.errors import ShardingError
from shardlib.dataset.tokens import FlatData, check_vocab, load_tokens
from shardlib.distributed.preempt import Preemption
from shardlib.train.goodput import Goodput
from shardlib.train.metrics import (
    Writers,
    compiled_flops,
    device_peak,
    model_flops,
    open_writers,
    previous_records,
)
from shardlib.train.precision import check_record
from shardlib.train.profiling import ProfileWindow, compile_cache, persistent_cache
from shardlib.train.setup import TrainSetup


@dataclass
class RunResult:
    """What a finished run reports: the per-step records and the final state."""

    records: list[dict] = field(default_factory=list)
    state: dict | None = None
    """As the step holds it: stacked rows in ``setup.layer_order`` (``setup.natural``)."""
    stopped_by: str | None = None
    """Why the run stopped before ``cfg.run.steps`` (a signal, or ``stop_after``); None if not."""
    checkpoint: Path | None = None
    """The last checkpoint this run saved (None without ``checkpoint_dir``)."""
    peak_flops: float = 0.0
    """One device's peak FLOP/s the MFU figures use."""
    peak_source: str = ""
    """Where ``peak_flops`` comes from (data sheet, measurement, setting)."""
    first_grads: dict | None = None
    """The first step's gradients (stored layer order), where the step records them
    (``build_train_step(record_grads=True)``, which parity runs)."""

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]


def open_data(setup: TrainSetup):
    """The run's data, checked: a prepared dataset (or mixture) through grain, else the
    embedded corpus or a flat token file (whole uint16 tokens, ids below the vocabulary).

    Called at the top of ``run``: bad data (a corrupt shard, a tokenizer larger than the
    model's vocabulary, a prompt longer than a row) is an error before any state is built
    or any progress line is printed, not after a ``0/2 loss nan`` line.
    """
    own = getattr(setup, "open_data", None)
    if own is not None:  # a model of one's own: the user's batches (``train.user_data``)
        return own()
    from shardlib.dataset.index import is_prepared

    data, seed, vocab = setup.cfg.dataset, setup.cfg.run.seed, setup.workload.dims.get("vocab", 0)
    if data.mix or is_prepared(data.path):
        from shardlib.dataset.loader import PreparedData

        if setup.plan.pipeline_spec() is not None:
            raise ShardingError(
                "a prepared dataset's packed rows cannot run through a pipeline schedule yet. "
                "Fix: a mesh without a stage axis, or a flat token file."
            )
        setup.plan.check_packed()
        return PreparedData.open(
            data.path, data.mix, seq=data.seq, batch=data.batch, seed=seed, vocab=vocab
        )
    tokens = load_tokens(data.path)
    check_vocab(tokens, vocab, data.path)
    return FlatData(tokens, data.path, batch=data.batch, seq=data.seq, seed=seed)


def batches(setup: TrainSetup, start: int = 0, source=None) -> Iterator[tuple[int, jax.Array]]:
    """The steps' batches from ``start`` on (a token file is checked before each)."""
    source = open_data(setup) if source is None else source
    for step in range(start, setup.cfg.run.steps):
        yield step, source.batch_for(step, setup.batch_sharding)


class Evaluation:
    """Held-out loss every ``dataset.eval_every`` steps: the same batches each time, one
    compiled step, loss and perplexity (exp of the loss, per token that counts)."""

    def __init__(self, setup: TrainSetup, source) -> None:
        self.setup, self.source = setup, source
        self.every = setup.cfg.dataset.eval_every
        if self.every:  # a flat file without held-out data fails here, before step 1
            self._batches = source.eval_batches(
                setup.cfg.dataset.eval_batches, setup.batch_sharding
            )

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.setup.cfg.run.steps)

    def __call__(self, state) -> dict:
        """``eval_loss`` (and ``eval_perplexity`` for a decoder, ``eval_NAME`` for each of a
        user's loss's metrics): means over the held-out batches, weighted by their size."""
        totals: dict[str, float] = {}
        weight = 0.0
        for batch in self._batches:
            loss, w, metrics = jax.device_get(self.setup.eval_step(state, batch))
            for name, value in {"loss": loss, **metrics}.items():
                totals[name] = totals.get(name, 0.0) + float(value) * float(w)
            weight += float(w)
        out = {f"eval_{name}": total / max(weight, 1.0) for name, total in totals.items()}
        if self.setup.eval_perplexity:
            out["eval_perplexity"] = float(np.exp(min(out["eval_loss"], 80.0)))
        return out


def _progress(console: Console, unit: str) -> Progress:
    return Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[tps]:>9,.0f} " + unit),
        TextColumn("MFU {task.fields[mfu]:6.2%}"),
        TextColumn("{task.fields[dt]:.3f} s/step"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def compile_step(
    setup: TrainSetup, state: dict, tokens, cache: Path | None = None, step=None
) -> tuple:
    """The train step (``step``, default ``setup.train_step``) compiled ahead of time for these
    inputs (through the persistent cache in ``cache``, if any), and the seconds it took.

    Compiling before step 1 keeps compilation out of every step time (and out of a profile
    window), reports it on its own, and hands MFU the executable's FLOPs.
    """
    t0 = time.perf_counter()
    with persistent_cache(cache):
        compiled = (step or setup.train_step).lower(state, tokens).compile()
    return compiled, time.perf_counter() - t0


def run(
    setup: TrainSetup,
    *,
    state: dict | None = None,
    show: bool = True,
    console: Console | None = None,
    stop_after: int | None = None,
    train_step=None,
) -> RunResult:
    """Train for ``setup.cfg.run.steps`` steps from ``state`` (None: the latest checkpoint in
    ``cfg.checkpoint.dir`` if there is one, else a fresh initialisation). A given ``state``
    is in the trainer's layer order, as ``init_state`` and a previous run return it
    (``setup.stored`` converts one in the model's natural order).

    The step is compiled before step 1 (through the persistent cache, ``run.compile_cache``);
    step times are execution only. Only process 0 prints and writes metrics. SIGTERM/SIGINT,
    or reaching step ``stop_after``, end the run at the next step boundary with a checkpoint.
    ``train_step`` replaces ``setup.train_step`` (parity's records the gradients).
    Bad metrics, profile or cache settings fail here, before anything is compiled.
    """
    cfg = setup.cfg
    leader = jax.process_index() == 0
    console = console or Console(stderr=True)

    def say(message: str) -> None:
        if leader:
            console.print(message, highlight=False)

    t_start, started_at = time.perf_counter(), time.time()
    source = open_data(setup)
    evaluation = Evaluation(setup, source)
    cache, cache_off = compile_cache(cfg.run.compile_cache, list(setup.mesh.devices.flat))
    if cache_off and cfg.run.compile_cache != "auto":
        say(cache_off)
    tiers = cfg.checkpoint.dir or cfg.checkpoint.local_dir  # a local_dir alone is refused
    ckpt = RunCheckpoints(setup, say) if tiers else None
    with ExitStack() as stack:
        preempt = stack.enter_context(Preemption())  # a signal from here on stops the run
        if ckpt is not None:  # before reading or writing anything in its directory
            stack.enter_context(ckpt.locked())
            ckpt.data = source.identity()  # what the run trains on, checked on resume
            if source.state() is not None:
                ckpt.loader_state = source.state  # where the loader is, saved with each step
        if state is None and ckpt is not None:
            state = ckpt.resume()
            state = None if state is None else setup.live_form(state)  # the NVMe tier's files
        state = setup.init_state() if state is None else state
        start = int(jax.device_get(state["step"]))
        if start and ckpt is not None and ckpt.loader_state is not None:
            if not cfg.dataset.allow_changed:  # changed data on purpose: its loader starts anew
                source.restore(ckpt.saved_loader)  # the batches an uninterrupted run reads
        run_cfg = cfg.run
        profile = ProfileWindow(
            run_cfg.profile_steps, run_cfg.profile_dir, first=start, last=run_cfg.steps
        )
        goodput = (  # a resumed run carries an earlier attempt's totals (its metrics.jsonl)
            Goodput.resumed(previous_records(cfg.metrics), start, started_at)
            if start
            else Goodput(started_at=started_at)
        )
        peak, peak_source = device_peak(jax.devices()[0], cfg.metrics.peak_flops)
        # a model of one's own: MFU from the compiled step's FLOPs (its recompute included),
        # the decoder's from the planner's count of the model (``metrics.model_flops``)
        examples = getattr(setup, "examples_per_step", None)
        flops = model_flops(setup)[0] if examples is None else None
        devices = setup.mesh.devices.size
        per_step, unit = (
            (cfg.dataset.batch * cfg.dataset.seq, "tokens")
            if examples is None
            else (examples, "examples")
        )
        result = RunResult(peak_flops=peak, peak_source=peak_source)
        if ckpt is not None:  # on leaving: waits until the last save is committed, while
            stack.enter_context(ckpt)  # the signal handlers still keep SIGTERM from killing it
        writers = (
            open_writers(cfg.metrics, append=bool(start), config=jsonable(cfg))
            if leader
            else Writers([])
        )
        stack.callback(writers.close)
        stack.callback(profile.close)
        goodput.startup_s += time.perf_counter() - t_start  # initialisation or restore
        compiled = None
        progress = None
        if show and leader:
            progress = stack.enter_context(
                _progress(console, "tok/s" if unit == "tokens" else "ex/s")
            )
            task = progress.add_task(
                "train", total=cfg.run.steps, completed=start, loss=float("nan"), tps=0.0,
                mfu=0.0, dt=0.0,
            )  # fmt: skip
        data_t0 = time.perf_counter()
        for step, batch in batches(setup, start, source):
            goodput.data_s += time.perf_counter() - data_t0
            if compiled is None:
                compiled, seconds = compile_step(setup, state, batch, cache, train_step)
                goodput.compile_s += seconds  # an earlier attempt's compilation counts too
                hw_flops = compiled_flops(compiled) * devices
                flops = hw_flops if flops is None else flops
                step_memory = _compiled_memory(compiled)
                say(f"compiled the step in {seconds:.2f} s")
            profile.before(step + 1)
            t0 = time.perf_counter()
            state, metrics = compiled(state, batch)
            metrics = jax.device_get(metrics)  # waits for the step: honest step times
            grads = metrics.pop("grads", None)
            if result.first_grads is None:
                result.first_grads = grads
            dt = time.perf_counter() - t0
            profile.after(step + 1)
            goodput.productive_s += dt
            record = {
                "step": step + 1,
                "loss": float(metrics["loss"]),
                "grad_norm": float(metrics["grad_norm"]),
                "lr": float(metrics["lr"]),
                "step_time_s": dt,
                f"{unit}_per_s": per_step / dt,
                "mfu": flops / (dt * devices * peak),
                "hfu": hw_flops / (dt * devices * peak),
                "warmup": step == start,
            }
            record.update({k: float(v) for k, v in metrics.items() if k not in record})
            record.update(step_memory)
            record.update(_memory_in_use())
            check_record(record, cfg.precision)  # fp16 overflow at the minimum loss scale
            done = step + 1
            if done < cfg.run.steps and (preempt.should_stop(done) or done == stop_after):
                result.stopped_by = preempt.reason or f"stop_after={stop_after}"
            if ckpt is not None:
                t_save = time.perf_counter()
                ckpt.after_step(state, done, final=bool(result.stopped_by) or done == cfg.run.steps)
                goodput.checkpoint_s += time.perf_counter() - t_save
            record.update(goodput.record())
            if evaluation.due(done):
                record.update(evaluation(state))
                said = [f"{k[5:]} {v:.4f}" for k, v in record.items() if k.startswith("eval_")]
                say(f"step {done}: eval {', '.join(said)}")
            result.records.append(record)
            writers.write(record)
            if progress is not None:
                progress.update(
                    task, advance=1, loss=record["loss"], tps=record[f"{unit}_per_s"],
                    mfu=record["mfu"], dt=dt,
                )  # fmt: skip
            if result.stopped_by:
                break
            data_t0 = time.perf_counter()
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


def _compiled_memory(compiled) -> dict:
    """Bytes per device the compiled step holds (``memory_analysis``: inputs, outputs not
    aliased to them, temporaries), the figure every backend reports."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    held = stats.argument_size_in_bytes + stats.output_size_in_bytes
    held += stats.temp_size_in_bytes - stats.alias_size_in_bytes
    out = {"memory_step_bytes": float(held)}
    # host offload (optimizer state, offloaded residuals): pinned host memory the step uses;
    # GPU and TPU report it, the CPU backend lowers the moves to plain copies and reports 0
    host = sum(
        getattr(stats, f"host_{part}_size_in_bytes", 0) or 0
        for part in ("argument", "output", "temp")
    ) - (getattr(stats, "host_alias_size_in_bytes", 0) or 0)
    if host:
        out["memory_host_bytes"] = float(host)
    return out


def _memory_in_use() -> dict:
    """Bytes in use on the first local device, where the backend reports it (GPU, TPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    keys = ("bytes_in_use", "peak_bytes_in_use")
    return {f"memory_{k}": float(stats[k]) for k in keys if k in stats}
