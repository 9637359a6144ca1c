"""PipeDream-2BW (``pipeline_schedule=2bw``) against PipeDream-Flush (1F1B): memory and loss.

Run:  python benchmarks/two_bw.py memory        # planner next to the compiled step
      python benchmarks/two_bw.py bubble        # compiled FLOPs on 1F1B's toy decoder
      python benchmarks/two_bw.py collectives   # data-axis reductions per step
      python benchmarks/two_bw.py convergence   # 200 steps each at 2 rates, writes docs/two_bw.json
      python3 benchmarks/two_bw.py plot         # docs/two_bw.png (needs only matplotlib)

``memory``: for each tiny plan (8 simulated CPU devices, fp32, compiled from abstract
shapes; nothing runs) under ``1f1b`` and ``2bw``: per-device memory, the planner's and the
compiled step's (``planner.validate``). The difference 2bw - 1f1b, compiled and booked
(``planner/cost/terms/two_bw.py``), is printed in units of the parameters a device holds
(fp32).

``bubble``: 1F1B's toy decoder (``tests/parallel/test_pipeline_1f1b.py``) through the
2bw loop and through 1F1B, compiled FLOPs over the one-device step's, at p = 2, 4: 2bw's
steady trips against 1F1B's 1 + (p-1)/m. ``collectives``: the data-axis all-reduces of
the compiled train step (``explain``) on stage 2 x data 2, m = 4, for both schedules.

``convergence``: llama-tiny on the embedded corpus, stage 2 x data 2 (4 simulated CPU
devices), the trainer's default optimizer (AdamW, warm-up and cosine), the same seed and
batches, ``1f1b`` and ``2bw`` for ``STEPS`` steps each; the per-step losses go to
``docs/two_bw.json``, and ``plot`` draws them (a separate step, so the venv needs no
matplotlib). 2bw's step 0 only fills the pipeline (NaN loss); its step t reports batch
t-1's loss, and the two are compared on the same batches. Both at the trainer's default
peak learning rate (3e-3) and at 1e-3 (``LRS``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script too

PLANS = (  # model, batch, seq, layers, mesh axes and micro-batches
    ("llama-tiny", 16, 128, 8, dict(stage=4, tensor=2, microbatches=8)),
    ("llama-tiny", 16, 128, 8, dict(stage=2, data=2, tensor=2, microbatches=4)),
    ("llama-tiny", 32, 128, 16, dict(stage=4, data=2, microbatches=8)),
    ("llama-tiny", 16, 128, 12, dict(stage=2, fsdp=2, tensor=2, microbatches=2)),
)
STEPS, BATCH, SEQ, LAYERS = 200, 16, 64, 4
LRS = (3e-3, 1e-3)
"""The trainer's default peak learning rate, and a third of it: one step of staleness costs
more the larger the step (Narayanan et al. 2021 train at their baselines' rates)."""
RESULTS, FIGURE = ROOT / "docs" / "two_bw.json", ROOT / "docs" / "two_bw.png"


def memory() -> None:
    from shardlib.core.workload import Workload
    from shardlib.planner import candidate
    from shardlib.planner.candidate import PlanView
    from shardlib.planner.cost.coefficients import COEFFICIENTS
    from shardlib.planner.cost.terms import TERMS
    from shardlib.planner.cost.terms.base import MASTER_BYTES, Step
    from shardlib.planner.validate import validate

    print("memory planner/compiled (MB), 8 CPU devices, fp32")
    for model, batch, seq, layers, axes in PLANS:
        w = Workload.from_preset(model, batch, seq, "fp32", layers=layers)
        compiled, predicted = {}, {}
        for schedule in ("1f1b", "2bw"):
            plan = candidate(**axes, schedule=schedule)
            c = validate(w, plan)
            compiled[schedule], predicted[schedule] = c.compiled_memory, c.predicted_memory
            print(f"{model} b{batch} s{seq} L{layers} {axes} {schedule}: memory "
                  f"{c.predicted_memory / 1e6:.3f}/{c.compiled_memory / 1e6:.3f} = "
                  f"{c.memory_ratio:.3f}", flush=True)  # fmt: skip
        held = Step(w, plan, "cpu", PlanView(plan), TERMS, COEFFICIENTS).held_elements
        unit = held * MASTER_BYTES
        extra = (compiled["2bw"] - compiled["1f1b"]) / unit
        booked = (predicted["2bw"] - predicted["1f1b"]) / unit
        print(f"    2bw - 1f1b in held fp32 parameters: compiled {extra:.3f}, booked {booked:.3f}")


def bubble() -> None:
    import jax

    for folder in ("tests", "tests/parallel"):  # the toy decoder of the 1F1B tests
        sys.path.insert(0, str(ROOT / folder))
    import test_pipeline_1f1b as toy

    from shardlib.parallel.pipeline.one_f_one_b import one_f_one_b_value_and_grad
    from shardlib.parallel.pipeline.spec import PipelineSpec
    from shardlib.parallel.pipeline.two_bw_loop import two_bw_loop

    parts = dict(block_fn=toy._block, embed=toy._embed, head_loss=toy._head_loss)
    print("FLOPs over the one-device step's (toy decoder, 16 layers)")
    for p, m in ((2, 4), (2, 8), (4, 8)):
        ideal = toy._flops(toy._one_device(m))
        rest, blocks, tokens = toy._abstract(m)
        init, step = two_bw_loop(PipelineSpec(p, m, 1, "2bw"), **parts)
        carry = jax.eval_shape(init, rest, blocks, tokens)
        two = jax.jit(step).lower(rest, blocks, rest, blocks, carry, tokens).compile()
        vg = one_f_one_b_value_and_grad(PipelineSpec(p, m, 1, "1f1b"), **parts)
        one = jax.jit(vg).lower(rest, blocks, tokens).compile()
        print(f"p={p} m={m}: 2bw {toy._flops(two) / ideal:.4f} (paper: 1), 1f1b "
              f"{toy._flops(one) / ideal:.4f} (1 + (p-1)/m = {1 + (p - 1) / m:.4f})",
              flush=True)  # fmt: skip


def collectives() -> None:
    import jax

    from shardlib import mesh_spec
    from shardlib.analysis import explain
    from shardlib.train.config import train_config
    from shardlib.train.setup import make_setup

    mesh = mesh_spec(stage=2, data=2).build(jax.devices()[:4])
    for schedule in ("1f1b", "2bw"):
        cfg = train_config(
            steps=1, batch=16, seq=128, pipeline_schedule=schedule, pipeline_microbatches=4,
            precision="fp32", **{"model.layers": 8},
        )  # fmt: skip
        setup = make_setup(cfg, mesh)
        report = explain(setup.train_step, setup.abstract_state(), setup.abstract_batch(),
                         mesh=mesh)  # fmt: skip
        ops = [c for c in report.collectives if "data" in c.axes]
        count = sum(c.count for c in ops)
        size = sum(c.count * c.buffer_bytes for c in ops) / 1e6
        print(f"{schedule}: {count} reductions over data per step, {size:.2f} MB")


def convergence() -> None:
    import jax

    from shardlib import mesh_spec
    from shardlib.train.config import train_config
    from shardlib.train.loop import run
    from shardlib.train.setup import make_setup

    mesh = mesh_spec(stage=2, data=2).build(jax.devices()[:4])
    out = {"steps": STEPS, "batch": BATCH, "seq": SEQ, "layers": LAYERS, "runs": {}}
    for lr in LRS:
        runs = out["runs"][f"{lr:g}"] = {}
        for schedule in ("1f1b", "2bw"):
            cfg = train_config(
                steps=STEPS, batch=BATCH, seq=SEQ, pipeline_schedule=schedule,
                pipeline_microbatches=4, **{"model.layers": LAYERS, "optimizer.lr": lr},
            )  # fmt: skip
            runs[schedule] = run(make_setup(cfg, mesh), show=False).losses
        print(f"lr {lr:g}: 2bw / 1f1b, mean loss over the last 20 batches: "
              f"{stale_ratio(runs):.4f}", flush=True)  # fmt: skip
    RESULTS.write_text(json.dumps(out))


def stale_ratio(runs: dict, last: int = 20) -> float:
    """2bw's mean loss over 1f1b's on the same ``last`` batches (2bw's step t reports batch
    t-1's loss)."""
    flush, stale = runs["1f1b"][-last - 1 : -1], runs["2bw"][-last:]
    return sum(stale) / sum(flush)


def plot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = json.loads(RESULTS.read_text())
    fig, axes = plt.subplots(1, len(out["runs"]), figsize=(11, 4), sharey=True)
    labels = {"1f1b": "PipeDream-Flush (1f1b)", "2bw": "PipeDream-2BW (2bw; step t: batch t-1)"}
    for ax, (lr, runs) in zip(axes, out["runs"].items(), strict=True):
        for schedule, label in labels.items():
            ax.plot(range(1, len(runs[schedule]) + 1), runs[schedule], label=label, lw=1)
        ax.set_title(f"AdamW lr {lr}: 2bw / 1f1b over the last 20 = {stale_ratio(runs):.3f}")
        ax.set_xlabel("step")
    axes[0].set_ylabel("training loss")
    axes[0].legend()
    fig.suptitle(
        f"llama-tiny, {out['layers']} layers, stage 2 x data 2, batch {out['batch']} x {out['seq']}"
    )
    fig.tight_layout()
    fig.savefig(FIGURE, dpi=120)
    print(f"wrote {FIGURE}")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "memory"
    if what != "plot":
        from shardlib import simulate_cpu_devices

        simulate_cpu_devices(8)
    modes = {"memory": memory, "bubble": bubble, "collectives": collectives}
    {**modes, "convergence": convergence, "plot": plot}[what]()
