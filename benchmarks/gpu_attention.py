"""cuDNN fused attention against dense attention on one GPU: parity, speed and memory.

    python benchmarks/gpu_attention.py                       # seq 2048, 4096, 8192 (1 min)
    python benchmarks/gpu_attention.py --json attention.json
    python benchmarks/gpu_attention.py --packed               # rows of 4 packed documents

Both kernels are the ones ``attention_impl`` selects
(``shardlib.core.attention.LocalAttention.kernel``),
causal, with Llama-1B's grouped heads (32 query heads over 8 K/V heads, head_dim 64) and
Llama-7B's (32 x 128, no grouping), bf16 inputs. Parity: the output and the gradients of q,
k and v for a random cotangent, each kernel against dense attention computed in fp32 from
the same bf16 inputs (relative error: max |error| / max |value|); cuDNN passes where its
error is no larger than bf16 dense attention's own plus 1e-2. Speed: forward + backward,
median of timed repeats. Memory: the compiled forward + backward's temporary bytes
(``memory_analysis``): dense attention writes the [B, H, L, L] scores, cuDNN none.

``--packed``: each row holds four documents (1/8, 1/4, 3/8 and 1/4 of it), attention causal
within each (``core.attention.Packed``: dense masks the scores, cuDNN takes the document mask
as its mask); both against packed dense attention in fp32. FLOPs count each document's own
causal half.
"""

from __future__ import annotations

import argparse
import json
import sys

SHAPES = (("1b", 32, 8, 64), ("7b", 32, 32, 128))  # (model, heads, kv_heads, head_dim)
SEQS = (2048, 4096, 8192)


def fwd_bwd(kernel):
    import jax

    def run(q, k, v, do):
        out, vjp = jax.vjp(kernel, q, k, v)
        return (out, *vjp(do))

    return jax.jit(run)


DOCS = (1, 2, 3, 2)  # eighths of a packed row, one per document


def packed_rows(batch: int, seq: int):
    """``Packed`` rows of four documents (``DOCS``), and their causal score count."""
    import jax.numpy as jnp
    import numpy as np

    from shardlib.core.attention import Packed

    lengths = [seq * n // 8 for n in DOCS]
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])
    positions = np.concatenate([np.arange(n) for n in lengths])
    positions, segments = (
        jnp.asarray(np.tile(x, (batch, 1)), jnp.int32) for x in (positions, segments)
    )
    return Packed(positions, segments), sum(n * n for n in lengths)


def attention_fn(impl: str, seq: int, dtype=None, packed=None):
    """``(q, k, v) -> out`` of the kernel ``attention_impl=impl`` selects, causal (within each
    document of ``packed`` rows where given); inputs cast to ``dtype`` first where given
    (the fp32 reference)."""
    import jax.numpy as jnp

    from shardlib.core.attention import LocalAttention

    local = LocalAttention(impl=impl)
    inner = local.kernel(True, seq)
    pos = jnp.arange(seq, dtype=jnp.int32)

    def attend(q, k, v):
        if dtype is not None:
            q, k, v = (x.astype(dtype) for x in (q, k, v))
        return inner(q, k, v, pos, pos) if packed is None else local(q, k, v, packed)

    return attend


def rel_err(got, want) -> float:
    import jax.numpy as jnp

    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqs", default=",".join(map(str, SEQS)))
    parser.add_argument("--packed", action="store_true", help="rows of 4 packed documents")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    from rich.console import Console
    from rich.table import Table

    from benchmarks.matmul import time_fn

    device = jax.devices()[0]
    rows = []
    for model, h, g, d in SHAPES:
        for seq in (int(s) for s in args.seqs.split(",")):
            keys = jax.random.split(jax.random.key(seq + h + d), 4)
            b = args.batch
            q = jax.random.normal(keys[0], (b, seq, h, d), jnp.bfloat16)
            k = jax.random.normal(keys[1], (b, seq, g, d), jnp.bfloat16)
            v = jax.random.normal(keys[2], (b, seq, g, d), jnp.bfloat16)
            do = jax.random.normal(keys[3], (b, seq, h, d), jnp.bfloat16)
            row = {"model": model, "heads": h, "kv_heads": g, "head_dim": d, "seq": seq, "batch": b}
            packed, scores = packed_rows(b, seq) if args.packed else (None, seq * seq)
            row["packed"] = args.packed
            # causal attention: half the score matrix; forward 2 matmuls, backward 5
            row["flops"] = 3.5 * 4 * b * h * scores * d / 2
            fp32 = fwd_bwd(attention_fn("dense", seq, jnp.float32, packed))
            try:
                want = fp32(q, k, v, do.astype(jnp.float32))
            except Exception as err:  # the fp32 reference's scores do not fit: no parity row
                row["reference_error"] = f"{type(err).__name__}: {str(err)[:300]}"
                rows.append(row)
                continue
            for impl in ("dense", "cudnn"):
                fn = fwd_bwd(attention_fn(impl, seq, packed=packed))
                try:
                    compiled = fn.lower(q, k, v, do).compile()
                    got = compiled(q, k, v, do)
                    row[f"{impl}_err"] = max(rel_err(a, w) for a, w in zip(got, want, strict=True))
                    row[f"{impl}_s"] = time_fn(compiled, (q, k, v, do), repeats=10)
                    row[f"{impl}_temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
                except Exception as err:  # cuDNN refuses a shape, or dense runs out of memory
                    row[f"{impl}_error"] = f"{type(err).__name__}: {str(err)[:300]}"
            if "cudnn_err" in row and "dense_err" in row:
                row["cudnn_parity"] = row["cudnn_err"] <= row["dense_err"] + 1e-2
            rows.append(row)
            print(json.dumps(row), flush=True)

    what = "packed causal attention (4 documents a row)" if args.packed else "causal attention"
    table = Table(title=f"{what} fwd+bwd, bf16, on {device.device_kind} (jax {jax.__version__})")
    for col in (
        "shape", "seq", "dense err", "cudnn err", "dense ms", "cudnn ms", "speed-up",
        "cudnn TFLOP/s", "dense temp", "cudnn temp",
    ):  # fmt: skip
        table.add_column(col, justify="left" if col == "shape" else "right")
    mib = 2**20
    for r in rows:
        cells = [f"{r['model']} ({r['heads']}/{r['kv_heads']} x {r['head_dim']})", str(r["seq"])]
        for impl in ("dense", "cudnn"):
            cells.append(f"{r[f'{impl}_err']:.1e}" if f"{impl}_err" in r else "failed")
        for impl in ("dense", "cudnn"):
            cells.append(f"{r[f'{impl}_s'] * 1e3:.2f}" if f"{impl}_s" in r else "-")
        both = "dense_s" in r and "cudnn_s" in r
        cells.append(f"{r['dense_s'] / r['cudnn_s']:.2f}x" if both else "-")
        cells.append(f"{r['flops'] / r['cudnn_s'] / 1e12:.0f}" if "cudnn_s" in r else "-")
        for impl in ("dense", "cudnn"):
            key = f"{impl}_temp_bytes"
            cells.append(f"{r[key] / mib:,.0f} MiB" if key in r else "-")
        table.add_row(*cells)
    Console(width=160).print(table)
    for r in rows:
        for impl in ("dense", "cudnn"):
            if f"{impl}_error" in r:
                print(f"{r['model']} seq {r['seq']} {impl}: {r[f'{impl}_error']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.device_kind, "jax": jax.__version__, "rows": rows}, f)
    failed = [r for r in rows if r.get("cudnn_parity") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
