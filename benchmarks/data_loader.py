"""Prepared data: how fast it is written and read, and how full packing keeps the rows.

    python benchmarks/data_loader.py                        # 4,000 synthetic chat examples
    python benchmarks/data_loader.py --docs 20000 --plot packing.png

Writes synthetic prompt/completion JSON lines (lengths log-normal, like chat data: many
short examples, a tail cut at 240 words), trains a word-level tokenizer on them (nothing
downloaded), runs ``shardlib data prepare`` and reads batches through the grain loader. For each row
length it prints the share of row tokens that are real (packed, against one example per
padded row, the form without packing), the share that carries loss (completion tokens:
prompt masking), and the loader's rows/s and tokens/s on this host. Figures are of this
machine's CPU; the fill ratios depend only on the length distribution.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np

WORDS = "the cat sat on a mat dog ran far away quick brown fox jumps over lazy".split()


def synthetic(path: Path, docs: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    with open(path, "w") as f:
        for _ in range(docs):
            prompt_n = min(60, max(2, int(rng.lognormvariate(3.0, 0.6))))  # ~20 words, long tail
            completion_n = min(180, max(1, int(rng.lognormvariate(3.8, 0.7))))  # ~45 words
            prompt = " ".join(rng.choice(WORDS) for _ in range(prompt_n))
            completion = " ".join(rng.choice(WORDS) for _ in range(completion_n))
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
            lines.append(prompt + " " + completion)
    return lines


def tokenizer(path: Path, lines: list[str]) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(lines, trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    tok.save(str(path))
    return str(path)


def measure(directory: str, seq: int, rows: int, batches: int) -> dict:
    from shardlib.dataset.index import Prepared
    from shardlib.dataset.loader import packed_rows

    data = Prepared(directory)
    pieces = data.pieces("train", seq)
    it = iter(packed_rows([(data, 1.0)], "train", seq, rows, seed=0))
    next(it)  # warm-up
    real = counted = 0
    t0 = time.perf_counter()
    for _ in range(batches):
        b = next(it)
        real += int((b["segments"] > 0).sum()) + rows  # + the last column of each row
        counted += int(b["weights"].sum())
    seconds = time.perf_counter() - t0
    slots = batches * rows * (seq + 1)
    unpacked = float(np.minimum(pieces.length, seq + 1).mean() / (seq + 1))
    return {
        "seq": seq,
        "fill_packed": min(real / slots, 1.0),
        "fill_unpacked": unpacked,
        "loss_share": counted / (batches * rows * seq),
        "rows_per_s": batches * rows / seconds,
        "tokens_per_s": slots / seconds,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=4000)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--plot", default=None, help="write a bar chart of the fill ratios here")
    args = p.parse_args()
    from shardlib.dataset.prepare import prepare

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        lines = synthetic(root / "chat.jsonl", args.docs)
        tok = tokenizer(root / "tok.json", lines)
        t0 = time.perf_counter()
        index = prepare([str(root / "chat.jsonl")], tok, str(root / "out"), eval_fraction=0.05)
        seconds = time.perf_counter() - t0
        tokens = index["splits"]["train"]["tokens"] + index["splits"]["eval"]["tokens"]
        longest = max(np.diff(s["offsets"]).max() for s in index["splits"]["train"]["shards"])
        print(
            f"prepare: {args.docs} examples, {tokens:,} tokens in {seconds:.2f} s "
            f"({tokens / seconds:,.0f} tokens/s), longest example {longest} tokens"
        )
        results = []
        print(
            f"{'seq':>5} {'fill packed':>12} {'fill unpacked':>14} {'loss share':>11} "
            f"{'rows/s':>9} {'tokens/s':>11}"
        )
        for seq in (256, 512, 1024):
            if seq + 1 < longest:
                continue  # examples are never cut: a row must hold the longest
            r = measure(str(root / "out"), seq, args.rows, args.batches)
            results.append(r)
            print(
                f"{seq:>5} {r['fill_packed']:>12.1%} {r['fill_unpacked']:>14.1%} "
                f"{r['loss_share']:>11.1%} {r['rows_per_s']:>9,.0f} {r['tokens_per_s']:>11,.0f}"
            )
    if args.plot and results:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        x = np.arange(len(results))
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar(x - 0.2, [r["fill_packed"] for r in results], 0.4, label="packed")
        ax.bar(x + 0.2, [r["fill_unpacked"] for r in results], 0.4, label="one example per row")
        ax.set_xticks(x, [str(r["seq"]) for r in results])
        ax.set_xlabel("row length (seq)")
        ax.set_ylabel("share of row tokens that are data")
        ax.set_ylim(0, 1)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
