"""``shardlib`` command line: train, explain, parity, export, generate, plan, estimate,
data prepare, launch.

Settings are ``NAME=VALUE`` words after the options (``steps=50 model.layers=4``); the mesh
is a preset file or name. For presets marked ``platform = "cpu"`` the CLI simulates as many
CPU devices as the mesh needs, before JAX starts its backend.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import MeshSpec, load_mesh, simulate_cpu_devices
from shardlib.tools.cli_parser import DEFAULT_MESH, parser
from shardlib.tools.deepspeed_cli import deepspeed_base, deepspeed_devices


def _prepare(args) -> tuple:
    """Mesh spec -> (simulated devices) -> mesh, config. JAX starts only here."""
    from shardlib.distributed.peers import watch_peers
    from shardlib.distributed.preempt import install_early
    from shardlib.distributed.runtime import initialize, process_group

    spec: MeshSpec = load_mesh(args.mesh or DEFAULT_MESH)
    if getattr(args, "deepspeed", None) and args.mesh is None and args.cpu_devices is None:
        args.cpu_devices = deepspeed_devices(args.deepspeed, DEFAULT_MESH)
    group = process_group(args, spec.distributed)
    cpu = spec.platform == "cpu" or args.cpu_devices is not None
    processes = initialize(group, cpu=cpu)  # before JAX starts: it fixes the device list
    if args.command == "train":
        install_early()  # again: JAX's preemption notifier has just taken SIGTERM over
        args.peers = watch_peers(group.heartbeat_timeout_s)  # a process failing ends all
    devices = args.cpu_devices
    if devices is None and spec.platform == "cpu" and spec.fixed_size:
        if spec.fixed_size % processes:
            raise ShardingError(
                f"mesh {spec.source}: {spec.fixed_size} devices cannot be split evenly over "
                f"{processes} processes. Fix: pass --cpu-devices (devices per process)."
            )
        devices = spec.fixed_size // processes
    if devices:
        simulate_cpu_devices(devices)
    import jax

    from shardlib.core.values import flatten_table
    from shardlib.parallel.plan import ParallelPlan
    from shardlib.train.config import TrainConfig, override, parse_overrides
    from shardlib.train.init_from import with_source_model
    from shardlib.train.xla_flags import apply_gpu_defaults

    # [mesh] and [parallel.*] make the plan; [train] holds typed settings (the planner's too)
    plan = ParallelPlan.from_mesh_spec(spec)
    base = override(TrainConfig(parallel=plan), flatten_table(spec.train))
    if getattr(args, "deepspeed", None):  # the ds_config replaces the mesh file's layout
        base = deepspeed_base(args.deepspeed, len(jax.devices()), spec.platform, spec.rules)
    from shardlib.tools.user_cli import refuse_decoder_only, split_words

    overrides, args.own = split_words(list(args.overrides))  # loss=, data=: a model of one's own
    if args.command not in ("train", "explain", "parity"):
        refuse_decoder_only(args.command, args.own, getattr(args, "checkpoint", None))
    if getattr(args, "load_params", None):
        overrides.append(f"checkpoint.init_from={args.load_params}")
    if getattr(args, "steps", None) is not None and args.command == "parity":
        overrides.append(f"steps={args.steps}")
    cfg = with_source_model(parse_overrides(overrides, base))  # --load-params HF_DIR: its shapes
    apply_gpu_defaults(cfg.run.gpu_flags)  # XLA reads XLA_FLAGS when the backend starts: now
    return cfg.parallel.with_devices(len(jax.devices())).build_mesh(), cfg


def cmd_train(args, console: Console) -> int:
    import jax

    from shardlib.train.loop import run

    mesh, cfg = _prepare(args)
    console.quiet = jax.process_index() != 0  # one voice in multi-host runs: process 0
    setup = _setup(args, cfg, mesh)
    shape = " x ".join(f"{n}={s}" for n, s in zip(mesh.axis_names, mesh.devices.shape, strict=True))
    platform = mesh.devices.flat[0].platform
    console.print(
        f"[bold]shardlib train[/] {cfg.model} on {shape} ({mesh.devices.size} {platform} "
        f"devices); {setup.attention.describe() if setup.attention else 'its own loss'}",
        soft_wrap=True,
    )
    from shardlib.distributed.launchers import launcher_grace_note
    from shardlib.train.fp8 import advice

    for hint in (advice(cfg.precision, setup.plan.remat.policy, platform), launcher_grace_note()):
        if hint:
            console.print(f"note: {hint}", highlight=False, soft_wrap=True)
    result = run(setup, console=console)
    if args.peers is not None:  # every process finished: a peer exiting now is no failure
        args.peers.stop()
    losses = result.losses
    if not losses:
        console.print(f"nothing to do: the checkpoint is already at step {cfg.run.steps}")
        return 0
    steady = [r for r in result.records if not r["warmup"]] or result.records
    unit = "tokens" if "tokens_per_s" in steady[0] else "examples"
    tps = sum(r[f"{unit}_per_s"] for r in steady) / len(steady)
    mfu = sum(r["mfu"] for r in steady) / len(steady)
    last = result.records[-1]
    console.print(
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps, "
        f"{tps:,.0f} {unit}/s after the first step, MFU {mfu:.2%} "
        f"(peak {result.peak_flops / 1e9:,.1f} GFLOP/s per device: {result.peak_source}), "
        f"goodput {last['goodput']:.0%}"
    )
    evals = [r for r in result.records if "eval_loss" in r]
    if evals:
        console.print(
            f"held-out loss {evals[0]['eval_loss']:.4f} -> {evals[-1]['eval_loss']:.4f} "
            f"(perplexity {evals[-1]['eval_perplexity']:.2f}) over {len(evals)} evaluations"
        )
    for name in ("jsonl", "tensorboard", "wandb"):
        if getattr(cfg.metrics, name):
            console.print(f"metrics.{name}: {getattr(cfg.metrics, name)}")
    return 0


def _setup(args, cfg, mesh):
    """The token trainer's setup, or with ``loss=``/``data=`` the generic trainer's."""
    from shardlib.tools import user_cli
    from shardlib.train.setup import make_setup

    return make_setup(cfg, mesh) if args.own is None else user_cli.setup(cfg, mesh, args.own)


def cmd_explain(args, console: Console) -> int:
    from shardlib.analysis import explain

    mesh, cfg = _prepare(args)
    setup = _setup(args, cfg, mesh)
    state = setup.abstract_state()
    batch = setup.abstract_batch()
    report = explain(
        setup.train_step, state, batch, mesh=mesh, params=state["params"], peak=args.peak
    )
    notes = (setup.attention.describe(),) if setup.attention else ()
    report = dataclasses.replace(report, notes=notes)
    report.render(console)
    if args.json:
        report.write_json(args.json)
        console.print(f"wrote {args.json}")
    return 0


def cmd_parity(args, console: Console) -> int:
    from rich.table import Table

    from shardlib.tools.parity import check_parity

    mesh, cfg = _prepare(args)
    if args.own is None:
        result = check_parity(cfg, mesh)
    else:  # a model of one's own: losses and gradient norms (its batches, its loss)
        from shardlib.tools.user_cli import check_parity as own_parity

        result = own_parity(cfg, mesh, args.own)
    table = Table(title=f"parity: {args.mesh or DEFAULT_MESH} vs one device, {cfg.run.steps} steps")
    for col in ("step", "loss (mesh)", "loss (1 device)", "rel. error"):
        table.add_column(col, justify="right")
    for i, (a, b) in enumerate(zip(result.losses, result.reference_losses, strict=True), 1):
        table.add_row(str(i), f"{a:.7f}", f"{b:.7f}", f"{abs(a - b) / abs(b):.2e}")
    console.print(table)
    console.print(f"max relative loss error      {result.max_rel_loss_err:.2e}")
    console.print(f"max relative grad-norm error {result.max_rel_grad_norm_err:.2e}")
    if args.own is None:  # traced for the token trainer only
        console.print(f"max relative gradient error  {result.max_rel_grad_err:.2e}  (first step)")
    ok = result.ok(args.tol)
    console.print("[green]PARITY OK[/]" if ok else f"[red]PARITY FAILED[/] (tolerance {args.tol})")
    return 0 if ok else 1


def cmd_generate(args, console: Console) -> int:
    from shardlib.tools.generate import generate_command

    mesh, cfg = _prepare(args)
    return generate_command(args, console, mesh, cfg)


def cmd_export(args, console: Console) -> int:
    from shardlib.interop.export import export, export_hf_checkpoint

    if args.format == "hf":
        from shardlib.tools.user_cli import refuse_decoder_only

        refuse_decoder_only("export --format hf", None, args.checkpoint)
        files = export_hf_checkpoint(args.checkpoint, args.out, step=args.step)
        console.print(f"wrote {args.out}: {', '.join(f.name for f in files)}")
        return 0
    out = export(args.checkpoint, args.out, step=args.step)
    console.print(f"wrote {out.path} ({out.tensors} tensors, {out.bytes:,} bytes, step {out.step})")
    return 0


def cmd_launch(args, console: Console) -> int:
    """``shardlib launch`` (``tools.entry`` runs it before JAX loads; this is the same)."""
    from shardlib.distributed.relay import main

    return main(args.launcher)


def cmd_data(args, console: Console) -> int:
    from shardlib.dataset.prepare import prepare

    index = prepare(
        args.inputs,
        args.tokenizer,
        args.out,
        eval_fraction=args.eval_fraction,
        seed=args.seed,
        eos=args.eos,
        console=console,
    )
    splits = index["splits"]
    console.print(
        f"wrote {args.out}: {splits['train']['documents']} train documents "
        f"({splits['train']['tokens']:,} tokens), {splits['eval']['documents']} held out "
        f"({splits['eval']['tokens']:,} tokens), {index['dtype']}, vocabulary "
        f"{index['vocab_size']:,}, eos {index['eos_id']}"
    )
    return 0


def main(argv: list[str] | None = None, *, early: Sequence[str] = (), originals=None) -> int:
    """The command line; ``early``/``originals``: the signals ``tools.entry`` kept while this
    module loaded, and the handlers it replaced (``preempt.install_early``)."""
    try:
        return _main(argv, early, originals)
    finally:  # the signal handlers installed for the run, if no run took them over
        from shardlib.distributed.preempt import restore_early

        restore_early()


def _main(argv: list[str] | None, early: Sequence[str] = (), originals=None) -> int:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    if args.command == "train":  # a signal from now on stops the run after its first step
        from shardlib.distributed.preempt import install_early

        install_early(originals, early)
    errors = Console(stderr=True)
    # the planner's results go to stdout (tools read them); training logs stay on stderr
    # (a console of its own: process 0 alone logs, but every process prints its errors)
    console = Console() if args.command in ("plan", "estimate") else Console(stderr=True)
    from shardlib.tools.plan_cli import cmd_estimate, cmd_plan

    handler = {
        "train": cmd_train,
        "explain": cmd_explain,
        "parity": cmd_parity,
        "export": cmd_export,
        "generate": cmd_generate,
        "plan": cmd_plan,
        "estimate": cmd_estimate,
        "data": cmd_data,
        "launch": cmd_launch,
    }[args.command]
    try:
        return handler(args, console)
    except ShardingError as err:
        return _fail(errors, str(err), 2)
    except ValueError as err:  # model/config validation outside shardlib's own types
        return _fail(errors, f"{type(err).__name__}: {err}", 2)
    except Exception as err:
        from shardlib.distributed.peers import multi_process

        if not multi_process():
            raise
        peers, words = getattr(args, "peers", None), str(err).lower()
        if peers is not None and any(w in words for w in ("peer", "gloo", "nccl", "connection")):
            peers.await_verdict()  # a collective lost its peer: name it, not gloo's words
        # a collective that lost its peers (gloo), an orbax error...: one line, then stop
        first = (str(err).strip().splitlines() or [""])[0][:300]
        return _fail(errors, f"{type(err).__name__}: {first}", 1)


def _fail(errors: Console, message: str, code: int) -> int:
    """Print one line; in a multi-process run, with the rank, told to the others, and exit
    at once (JAX's shutdown barrier would wait for processes that have stopped)."""
    from shardlib.distributed.peers import (
        exit_now,
        failing,
        multi_process,
        publish_error,
        rank_prefix,
    )

    if multi_process():
        failing()  # this line, not the watcher's "stopping: process N failed" after it
    prefix = rank_prefix()
    errors.print(f"{prefix}[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    if multi_process():
        publish_error(message)
        exit_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
