"""What one Llama block keeps for its backward under remat=none, in bytes per token per h.

Run:  python benchmarks/activation_bytes.py [--quick] [--gpu]

Llama 7B's block (h 4096, heads 32, head_dim 128, mlp 11008, seq 2048, bf16), three ways:

(a) compiled: ``memory_analysis()`` of a jitted loss + gradient of the decoder at 2 and 4
    layers and micro-batch 1 and 2: the temp bytes' slope in layers and tokens, which cancels
    the head, the weights and their gradients, leaves one layer's saved activations per token.
    On this CPU backend the attention is shardlib's chunked kernel (online softmax, a
    custom VJP that keeps its output and one log-sum-exp per query, as a fused kernel does),
    and dense attention beside it; with ``--gpu`` on a device, cuDNN's fused kernel too.
(b) listed: ``jax.ad_checkpoint``'s saved residuals of one block's forward (the residuals
    autodiff keeps), each by name, shape, dtype and bytes per token per h. Attention here is
    ``FusedStandIn``: a custom VJP that keeps what cuDNN's kernel keeps beyond its inputs
    (its output is the output projection's input, ``attn_context``: one buffer, listed once).
(c) booked: what the planner books per layer (``shardlib estimate``'s model) for a GPU
    cluster (a100-8: ``terms.remat.KEPT["none"]``, by definition) and for the CPU backend
    (the fitted ``layer_*`` coefficients), against Korthikanti et al.'s 34 (REFERENCE.md).

What the CPU backend shows (jax 0.10.2): the compiled bytes equal the listed residuals in
fp32 exactly, and bf16 compiles to the *same* bytes as fp32: XLA:CPU keeps every bf16
residual in fp32 (2x). Before the model's SwiGLU kept only gate and up
(``models.llama.swiglu``), autodiff of silu also kept gate, sigmoid(gate) and
silu(gate): three more mlp-wide buffers (100.5 -> 68.3 B/tok/h compiled on CPU, 16 in bf16).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax._src.ad_checkpoint import saved_residuals  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from models.llama.model import Block, Llama, LlamaConfig  # noqa: E402
from shardlib.core.attention import LocalAttention, dense_attention  # noqa: E402
from shardlib.core.ops import use_ops  # noqa: E402
from shardlib.planner import Workload, candidate, estimate, load_cluster  # noqa: E402
from shardlib.planner.cost.terms.remat import KEPT  # noqa: E402

console = Console(width=160)
LLAMA_7B = LlamaConfig(
    vocab=32_000, embed=4096, layers=32, heads=32, kv_heads=32, head_dim=128, mlp=11_008
)
SEQ, MICRO_BATCH, GPUS = 2048, 6, 8
KORTHIKANTI = 34.0  # bytes per token per h per layer, fused attention (sbh·34, fp16)
DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}


# --- (b) the residuals autodiff keeps -----------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fused(q_BLHK, k_BLGK, v_BLGK, causal):
    pos_L = jnp.arange(q_BLHK.shape[1])
    return dense_attention(q_BLHK, k_BLGK, v_BLGK, pos_L, pos_L, causal=causal)


def _fused_fwd(q_BLHK, k_BLGK, v_BLGK, causal):
    out_BLHK = _fused(q_BLHK, k_BLGK, v_BLGK, causal)
    lse_BLH = jnp.zeros(q_BLHK.shape[:3], jnp.float32)  # the kernel's row statistics
    return out_BLHK, (q_BLHK, k_BLGK, v_BLGK, lse_BLH)


def _fused_bwd(causal, saved, g_BLHK):
    q, k, v, _ = saved
    _, vjp = jax.vjp(lambda q, k, v: _fused(q, k, v, causal), q, k, v)
    return vjp(g_BLHK)


_fused.defvjp(_fused_fwd, _fused_bwd)


@dataclasses.dataclass(frozen=True)
class FusedStandIn:
    """An attention form (``use_ops(attention=...)``) that keeps what a fused kernel keeps:
    q, k, v and the row statistics (fp32, heads per token); its output is the output
    projection's input (``attn_context``), so it is not listed a second time. Its backward
    recomputes densely: it exists to list residuals, not to be fast."""

    def __call__(self, q_BLHK, k_BLGK, v_BLGK, positions_L=None, *, causal: bool = True):
        return _fused(q_BLHK, k_BLGK, v_BLGK, causal)


@dataclasses.dataclass(frozen=True)
class Residual:
    name: str
    shape: tuple[int, ...]
    dtype: str
    per_token: float
    """Elements per token (0: not per token: a weight, or a per-position table)."""
    bytes: float
    """Bytes per token."""


def block_residuals(
    cfg: LlamaConfig, dtype, micro_batch: int, seq: int, attention=None
) -> list[Residual]:
    """The residuals ``saved_residuals`` lists for one ``Block``'s forward (abstract shapes:
    nothing is allocated). Per token: those whose leading dims are [micro_batch, ..., seq]."""
    with nnx.use_eager_sharding(False):
        block = nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(0)))
    graph, state = nnx.split(block)
    x_BLD = jax.ShapeDtypeStruct((micro_batch, seq, cfg.embed), dtype)

    def forward(state, x_BLD):
        with use_ops(attention=attention or FusedStandIn()):
            return nnx.merge(graph, state)(x_BLD).astype(jnp.float32).sum()

    out = []
    for aval, why in saved_residuals(forward, state, x_BLD):
        shape = tuple(aval.shape)
        weight = why.startswith("from the argument st")
        token = not weight and len(shape) >= 2 and shape[0] == micro_batch and seq in shape[1:]
        per_token = aval.size / (micro_batch * seq) if token else 0
        size = per_token * aval.dtype.itemsize
        out.append(Residual(_short(why), shape, str(aval.dtype), per_token, size))
    return out


def _short(why: str) -> str:
    """'named attn_k', 'the block input', 'norm.py:33 (_forward)' ..."""
    if why.startswith("named "):
        return why.split(" from ")[0].replace("'", "")
    if why.startswith("from the argument x"):
        return "the block input"
    if why.startswith("from the argument"):
        return "weight " + why.split("'")[1]
    where = why.split(" from ")[-1].split("/")[-1]
    return f"{why.split(' from ')[0].replace('output of ', '')} @ {where}"


# --- (a) compiled bytes per token per h per layer --------------------------------------------


def compiled_temp(cfg: LlamaConfig, dtype, micro_batch: int, seq: int, attention) -> int:
    """Temp bytes of a jitted loss + gradient of the decoder (abstract: nothing allocated)."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0)))
    graph, state = nnx.split(model)
    tokens_BL = jax.ShapeDtypeStruct((micro_batch, seq), jnp.int32)

    def loss(state, tokens_BL):
        with use_ops(attention=attention):
            logits_BLV = nnx.merge(graph, state)(tokens_BL, dtype=dtype)
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits_BLV), tokens_BL[..., None], -1)
        return -jnp.mean(picked)

    compiled = jax.jit(jax.value_and_grad(loss)).lower(state, tokens_BL).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def compiled_per_layer(cfg: LlamaConfig, dtype, seq: int, attention) -> float:
    """One layer's saved bytes per token per h: the temp bytes' slope in layers (2 -> 4) and
    micro-batch (1 -> 2), which cancels the head, the weights and the gradients."""
    small = dataclasses.replace(cfg, vocab=1024)  # the head cancels; a small one compiles fast
    temp = {
        (n, b): compiled_temp(dataclasses.replace(small, layers=n), dtype, b, seq, attention)
        for n in (2, 4)
        for b in (1, 2)
    }
    per_layer = [(temp[4, b] - temp[2, b]) / 2 for b in (1, 2)]
    return (per_layer[1] - per_layer[0]) / (seq * cfg.embed)


# --- (c) what the planner books -------------------------------------------------------------


def workload_7b(micro_batch: int = MICRO_BATCH, seq: int = SEQ) -> Workload:
    return Workload.from_preset("llama-7b", micro_batch * GPUS, seq)


def plan_7b(impl: str = "cudnn"):
    """8-way FSDP, remat=none, micro-batch 6 per device, attention_impl ``impl``."""
    plan = candidate(fsdp=GPUS)
    return dataclasses.replace(plan, context=dataclasses.replace(plan.context, attention_impl=impl))


def booked_per_layer(impl: str = "cudnn", **where) -> tuple[float, object]:
    """(bytes per token per h per layer the planner books, the estimate)."""
    w = workload_7b()
    est = estimate(w, plan_7b(impl), **where)
    tokens = MICRO_BATCH * SEQ
    return est.memory["activations"] / (tokens * w.embed * w.layers), est


def kept_per_h(cfg: LlamaConfig, dtype_bytes: int = 2) -> float:
    """``KEPT["none"]`` in bytes per token per h at ``cfg``'s widths (fused attention)."""
    kept = KEPT["none"]
    q = cfg.heads * cfg.head_dim
    widths = {"h": cfg.embed, "q": q, "qkv": q + 2 * cfg.kv_heads * cfg.head_dim, "mlp": cfg.mlp}
    return sum(kept[k] * widths[k] for k in kept) * dtype_bytes / cfg.embed


# --- the report --------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seq 1024, fewer programs")
    parser.add_argument("--gpu", action="store_true", help="also compile on the GPU (cuDNN)")
    args = parser.parse_args()
    seq = 1024 if args.quick else SEQ
    cfg, h = LLAMA_7B, LLAMA_7B.embed
    kept = kept_per_h(cfg)

    table = Table(title=f"(a) compiled: one 7B layer's saved bytes per token per h (seq {seq})")
    for col in ("backend", "attention", "dtype", "B/tok/h/layer", "vs KEPT none", "compile s"):
        table.add_column(col, justify="left" if col in ("backend", "attention") else "right")
    runs = [("cpu", "chunked", "bf16"), ("cpu", "chunked", "fp32")]
    if not args.quick:
        runs.append(("cpu", "dense", "bf16"))
    if args.gpu:
        if jax.default_backend() != "gpu":
            console.print("[red]--gpu: jax sees no GPU here; the GPU rows are skipped.[/red]")
        else:
            runs = [("gpu", "cudnn", "bf16"), ("gpu", "dense", "bf16")] + runs
    for backend, impl, dt in runs:
        start = time.time()
        device = jax.devices(backend)[0]
        with jax.default_device(device):
            attention = LocalAttention(impl=impl, chunk=512)
            per_h = compiled_per_layer(cfg, DTYPES[dt], seq, attention)
        spent = time.time() - start
        table.add_row(backend, impl, dt, f"{per_h:.2f}", f"{per_h / kept:.2f}x", f"{spent:.0f}")
    console.print(table)
    if not args.gpu or jax.default_backend() != "gpu":
        console.print(
            "GPU column: none this session (no device). Run with --gpu where jax sees a GPU: "
            "the same measurement, compiled for it, cuDNN's fused attention and dense."
        )

    rows = block_residuals(cfg, jnp.bfloat16, 2, seq)  # 2: per-position tables stand apart
    table = Table(title="(b) saved residuals of one 7B block's forward (bf16, fused stand-in)")
    for col in ("residual", "shape", "dtype", "elements/token", "B/tok/h"):
        table.add_column(col, justify="left" if col in ("residual", "dtype") else "right")
    total = 0.0
    for r in rows:
        if r.per_token:
            total += r.bytes
            shape = "x".join(map(str, r.shape))
            table.add_row(r.name, shape, r.dtype, f"{r.per_token:.0f}", f"{r.bytes / h:.3f}")
    table.add_row("total", "", "", "", f"{total / h:.2f}", style="bold")
    console.print(table)
    others = sum(1 for r in rows if not r.per_token)
    console.print(
        f"({others} more residuals not per token: weights in the compute dtype, "
        "the rotary tables per position)"
    )
    chunked = LocalAttention(impl="chunked", chunk=512)
    fp32 = sum(r.bytes for r in block_residuals(cfg, jnp.float32, 2, seq, chunked)) / h
    console.print(
        f"listed with shardlib's chunked kernel (the CPU rows of (a)), fp32: {fp32:.2f} B/tok/h: "
        "the compiled fp32 and bf16 figures of (a) (XLA:CPU keeps bf16 residuals in fp32); "
        "the kernel keeps its own output beside attn_context (a layout copy: +2 B/tok/h in bf16)"
    )

    gpu_b, gpu_est = booked_per_layer(cluster=load_cluster("a100-8"))
    cpu_b, _ = booked_per_layer(backend="cpu")
    dense_b, _ = booked_per_layer("dense", cluster=load_cluster("a100-8"))
    table = Table(title="(c) booked per layer, 7B, bf16: bytes per token per h")
    for col in ("what", "B/tok/h/layer", "vs Korthikanti 34"):
        table.add_column(col, justify="left" if col == "what" else "right")
    for what, value in (
        ("KEPT['none'] at 7B widths (by definition)", kept),
        ("planner, a100-8, cuDNN attention", gpu_b),
        ("planner, a100-8, dense attention (fitted scores)", dense_b),
        ("planner, CPU backend (fitted layer_* coefficients)", cpu_b),
        ("listed residuals (b)", total / h),
        ("Korthikanti et al. 2022, fused attention", KORTHIKANTI),
    ):
        table.add_row(what, f"{value:.2f}", f"{value / KORTHIKANTI:.2f}")
    console.print(table)
    gib = gpu_est.memory["activations"] / 2**30
    total_gib = sum(v for k, v in gpu_est.memory.items() if not k.startswith("host")) / 2**30
    console.print(
        f"shardlib estimate, llama-7b on a100-8 (fsdp 8, micro-batch {MICRO_BATCH} x {SEQ}, bf16, "
        f"cuDNN attention, remat=none): activations {gib:.1f} GiB, total {total_gib:.1f} GiB, "
        f"fits: {gpu_est.fits}"
    )


if __name__ == "__main__":
    main()
