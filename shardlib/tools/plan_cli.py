"""``shardlib plan`` (search, explain, write, optionally compile) and ``shardlib estimate``
(cost one given layout): the planner's two commands.

Both read a model (``--model`` and ``model.NAME=VALUE`` words) and a cluster preset
(``--cluster``, ``--hosts``), print their results on stdout (``--json``: one JSON document
for tools) and leave errors to ``shardlib.tools.cli`` (stderr, exit 2). A layout is given as
``NAME=VALUE`` settings, comma-separated: mesh axis sizes (``tensor=8,stage=8``) and knobs
(``zero``, ``microbatches``, ``schedule``, ``virtual``, ``split_saved``, ``remat``,
``offload``, ``grid_depth``, ``products``): ``plan --fix`` fixes some and searches the
rest, ``estimate --set`` gives them all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from shardlib.core.attention import IMPLS
from shardlib.core.errors import ShardingError
from shardlib.core.workload import Workload
from shardlib.parallel.tensor import PRODUCTS
from shardlib.planner.candidate import AXIS_ORDER, REMAT, PlanView, candidate
from shardlib.planner.cost.terms import SEARCH_AXES
from shardlib.planner.cost.terms.remat import modelled_segments
from shardlib.planner.inputs.cluster import Cluster, load_cluster
from shardlib.planner.search import Space, meshes, search

SCHEDULES = ("gpipe", "1f1b", "circular", "chimera", "terapipe", "2bw")
KNOBS = (
    "zero", "microbatches", "schedule", "virtual", "split_saved", "remat", "offload",
    "attention", "loss_chunk", "grid_depth", "products",
)  # fmt: skip
"""The ``candidate`` knobs a layout setting may name besides the mesh axes."""
CHOICES = {
    "schedule": SCHEDULES,
    "remat": (*REMAT, "segments:<k>", "sqrt"),  # and any modelled ``segments:k``
    "attention": IMPLS,
    "products": PRODUCTS,
}
"""The knobs whose value is one of a list, and the list (said in the error)."""
WORKLOAD_DEFAULTS = {"model": "llama-small", "global_batch": 1024, "seq": 4096, "precision": "bf16"}


def _common_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("--model", default=None, help="registered model name or package.module:function")
    c.add_argument("--cluster", required=True, help="cluster preset file or name")
    c.add_argument("--hosts", type=int, default=None, help="override the preset's host count")
    c.add_argument("--global-batch", type=int, default=None, help="sequences per step (1024)")
    c.add_argument("--seq", type=int, default=None, help="tokens per sequence (4096)")
    c.add_argument("--precision", default=None, choices=("bf16", "fp32"))
    c.add_argument("--json", action="store_true", help="print one JSON document instead")
    c.add_argument("overrides", nargs="*", metavar="model.NAME=VALUE", help="model fields")


def add_plan_command(sub) -> argparse.ArgumentParser:
    c = sub.add_parser("plan", help="choose the layout for a model on a cluster")
    _common_args(c)
    c.add_argument("--top", type=int, default=5, help="plans to show")
    c.add_argument("--out", help="where to write the chosen plan (default: nowhere)")
    c.add_argument(
        "--fix",
        action="append",
        default=[],
        metavar="NAME=VALUE,...",
        help="settings every plan keeps, e.g. tensor=8,stage=8,schedule=1f1b (rest searched)",
    )
    c.add_argument(
        "--no-tensor-grid",
        action="store_true",
        help="try each tensor size t as Megatron's 1D only, not also as a 2D/2.5D "
        "(Tesseract) grid d x q x q beside data",
    )
    c.add_argument(
        "--validate",
        type=int,
        nargs="?",
        const=3,
        default=0,
        metavar="K",
        help="compile the top K plans on simulated CPU devices and compare (default K=3)",
    )
    e = sub.add_parser("estimate", help="cost one given layout of a model on a cluster")
    _common_args(e)
    e.add_argument("--mesh", default=None, help="a mesh/plan TOML (e.g. one `plan` wrote)")
    e.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE,...",
        help="the layout as settings, e.g. tensor=8,stage=8,schedule=1f1b,microbatches=16",
    )
    return c


def parse_settings(words: list[str], flag: str) -> dict[str, int | str | bool]:
    """``["tensor=8,stage=4", "remat=full"]`` -> ``{"tensor": 8, "stage": 4, "remat": "full"}``,
    typed and checked (ShardingError names the fix)."""
    axes = [str(a) for a in AXIS_ORDER]
    out: dict[str, int | str | bool] = {}
    for word in (w.strip() for w in ",".join(words).split(",")):
        if not word:
            continue
        key, sep, value = (part.strip() for part in word.partition("="))
        example = f"Fix: e.g. {flag} tensor=8,stage=8,schedule=1f1b,microbatches=16."
        if not sep or not value:
            raise ShardingError(f"{flag} {word!r} is not NAME=VALUE. {example}")
        if key in CHOICES:
            allowed = CHOICES[key]
            if value not in allowed and not (key == "remat" and modelled_segments(value)):
                raise ShardingError(f"{flag} {word}: {key} is one of {', '.join(allowed)}.")
            out[key] = value
        elif key in ("offload", "split_saved"):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ShardingError(f"{flag} {word}: {key} is true or false.")
            out[key] = value.lower() in ("true", "1", "yes")
        elif key in (*axes, "zero", "microbatches", "virtual", "loss_chunk", "grid_depth"):
            least = 0 if key in ("zero", "loss_chunk", "grid_depth") else 1
            if not value.isdigit() or int(value) < least:
                raise ShardingError(f"{flag} {word}: {key} is a whole number >= {least}.")
            out[key] = int(value)
        else:
            raise ShardingError(
                f"{flag} {word}: {key!r} is not a mesh axis or knob. Fix: use "
                f"{', '.join([*axes, *KNOBS])}."
            )
    return out


def _model_overrides(words: list[str]) -> dict[str, str]:
    out = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or not key.startswith("model."):
            raise ShardingError(f"{word!r} is not model.NAME=VALUE (e.g. model.layers=4).")
        out[key.removeprefix("model.")] = value
    return out


def _cluster(args) -> Cluster:
    cluster = load_cluster(args.cluster)
    if args.hosts is not None:
        if args.hosts < 1:
            raise ShardingError(f"--hosts {args.hosts}: a cluster has at least one host.")
        cluster = cluster.with_hosts(args.hosts)
    return cluster


def _workload(args, train: dict | None = None) -> Workload:
    """The command's model and batch; unset options come from a plan file's ``[train]``
    table (``train``), then from ``WORKLOAD_DEFAULTS``."""
    train = dict(train or {})
    given = {
        "model": args.model,
        "global_batch": args.global_batch,
        "seq": args.seq,
        "precision": args.precision,
    }
    from_file = {
        "model": train.pop("model", None),
        "global_batch": train.pop("dataset.batch", None),
        "seq": train.pop("dataset.seq", None),
        "precision": train.pop("precision.compute", None),
    }
    values = {
        k: next(v for v in (given[k], from_file[k], WORKLOAD_DEFAULTS[k]) if v is not None)
        for k in given
    }
    overrides = {k.removeprefix("model."): v for k, v in train.items() if k.startswith("model.")}
    overrides |= _model_overrides(args.overrides)
    return Workload.from_preset(
        values["model"], values["global_batch"], values["seq"], values["precision"], **overrides
    )


def _flat(table: dict, prefix: str = "") -> dict:
    """A TOML table as dotted keys (``[train] data = {batch = 8}`` -> ``dataset.batch``)."""
    out = {}
    for k, v in table.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def _check_fixed(workload: Workload, cluster: Cluster, space: Space) -> None:
    """Each fixed axis size is one some mesh of the unfixed space has, and together they
    leave some mesh: else a one-line error naming the sizes that would do."""
    free = list(meshes(workload, cluster, dataclasses.replace(space, fixed=())))
    n = cluster.num_devices
    for name, size in space.fixed:
        sizes = sorted({m[name] for m in free})
        if size not in sizes:
            rule = next(a.rule for a in SEARCH_AXES if str(a.axis) == name)
            raise ShardingError(
                f"--fix {name}={size}: no mesh of {n} devices for {workload.model} has it ("
                f"{name}: {rule}). Fix: {name} is one of {', '.join(map(str, sizes)) or 'none'}."
            )
    if not any(all(m[k] == v for k, v in space.fixed) for m in free):
        fixed = ",".join(f"{k}={v}" for k, v in space.fixed)
        raise ShardingError(
            f"--fix {fixed}: no mesh of {n} devices has all of these (the fixed sizes must "
            "divide the device count and the rest must split the batch). Fix: fix fewer axes."
        )


def cmd_plan(args, console: Console) -> int:
    from shardlib.planner.report import no_plan_error, render, result_record
    from shardlib.planner.writer import plan_toml

    cluster = _cluster(args)
    workload = _workload(args)
    space = Space(grid_depth=(0,)) if args.no_tensor_grid else Space()
    space = space.fixing(parse_settings(args.fix, "--fix"))
    _check_fixed(workload, cluster, space)
    start = time.perf_counter()
    result = search(workload, cluster, space, top=args.top)
    seconds = time.perf_counter() - start
    if not result.best:
        raise ShardingError(no_plan_error(workload, cluster, space))
    out = Path(args.out) if args.out else None
    if out is not None:
        out.write_text(plan_toml(workload, result.best[0], cluster))
    if args.json:
        record = result_record(result, workload, cluster, space, seconds)
        print(json.dumps({**record, "wrote": str(out) if out else None}, indent=1))
    else:
        render(result, workload, cluster, console, seconds)
        if out is not None:
            console.print(f"wrote {out}: shardlib train --mesh {out}")
        else:
            console.print("not written: --out FILE writes it (for shardlib train --mesh FILE)")
    if args.validate:  # with --json its table goes to stderr: stdout stays one document
        _validate(result, workload, args.validate, Console(stderr=True) if args.json else console)
    return 0


def layout_plan(settings: dict, devices: int):
    """The ``ParallelPlan`` of ``estimate --set``: ``data`` takes the devices the other axes
    leave unless it is given."""
    sizes = {k: v for k, v in settings.items() if k not in KNOBS}
    knobs = {k: v for k, v in settings.items() if k in KNOBS}
    used = math.prod(sizes.values())
    if "data" not in sizes:
        if devices % used:
            given = ",".join(f"{k}={v}" for k, v in sizes.items())
            raise ShardingError(
                f"--set {given}: the axes use {used} devices, which does not divide the "
                f"cluster's {devices}. Fix: sizes whose product divides {devices}."
            )
        sizes["data"] = devices // used
    return candidate(**sizes, **knobs)


def cmd_estimate(args, console: Console) -> int:
    from shardlib.core.mesh import load_mesh
    from shardlib.parallel.plan import ParallelPlan
    from shardlib.planner.cost.total import estimate
    from shardlib.planner.report import estimate_record, render_estimate

    cluster = _cluster(args)
    if bool(args.mesh) == bool(args.set):
        raise ShardingError(
            "estimate: give the layout once. Fix: --mesh plan.toml, or --set "
            "tensor=8,stage=8,schedule=1f1b,microbatches=16 (data takes the rest)."
        )
    train = None
    if args.mesh:
        spec = load_mesh(args.mesh)
        plan = ParallelPlan.from_mesh_spec(spec).with_devices(cluster.num_devices)
        train = _flat(spec.train)
    else:
        plan = layout_plan(parse_settings(args.set, "--set"), cluster.num_devices)
    workload = _workload(args, train)
    est = estimate(workload, plan, cluster)
    if args.json:
        print(json.dumps(estimate_record(est, workload, cluster), indent=1))
    else:
        render_estimate(est, workload, cluster, console)
    return 0


def _validate(result, workload: Workload, k: int, console: Console) -> None:
    """Compile the top ``k`` plans (fp32) on as many simulated CPU devices as they need (at
    most ``validate.MAX_SIMULATED``: larger plans with fewer data replicas, said so)."""
    from shardlib.analysis.report import format_bytes
    from shardlib.core.mesh import simulate_cpu_devices
    from shardlib.planner.validate import simulable, validate

    runs = [simulable(workload, est.plan) for est in result.best[:k]]
    simulate_cpu_devices(max(PlanView(plan).size for _, plan, _ in runs))
    table = Table(title="predicted (cpu backend, fp32) vs compiled, per device and step")
    cols = ("mesh", "knobs", "memory pred", "compiled", "ratio", "wire pred", "compiled", "ratio")
    for col in (*cols, "peak in"):  # where the compiled step's memory peaks (analysis.peak)
        table.add_column(col, justify="left" if col in ("mesh", "knobs") else "right")
    for small, plan, note in runs:
        if note:
            console.print(note, highlight=False)
        check = validate(small, plan, peak=True)
        view = PlanView(plan)
        peak = check.compiled_peak
        table.add_row(
            view.mesh_text(),
            view.knobs_text(),
            format_bytes(check.predicted_memory),
            format_bytes(check.compiled_memory),
            f"{check.memory_ratio:.3f}",
            format_bytes(check.predicted_wire),
            format_bytes(check.compiled_wire),
            f"{check.wire_ratio:.3f}",
            peak.phase if peak is not None else "-",
        )
    Console(file=console.file, width=max(console.width, 160)).print(table)
