"""The ``shardlib`` command line's arguments: one subcommand each, with the options every
mesh-using command shares (mesh, simulated devices, multi-host rank and timeouts), so
``shardlib.tools.cli`` holds what the commands do, not how they are spelled."""

from __future__ import annotations

import argparse

DEFAULT_MESH = "cpu-8-3d"


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardlib", description=description)
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help_)
        c.add_argument(
            "--mesh", default=None, help=f"mesh preset file or name (default {DEFAULT_MESH})"
        )
        c.add_argument(
            "--cpu-devices",
            type=int,
            default=None,
            help="simulate this many CPU devices (default: what a cpu preset needs)",
        )
        c.add_argument("--coordinator", default=None, help="multi-host: process 0's host:port")
        c.add_argument("--num-processes", type=int, default=None, help="multi-host: processes")
        c.add_argument("--process-id", type=int, default=None, help="multi-host: this rank")
        for flag, default in [("init", 300), ("heartbeat", 60), ("shutdown", 60)]:
            c.add_argument(
                f"--{flag}-timeout",
                dest=f"{flag}_timeout_s",
                type=int,
                default=None,
                help=f"multi-host: {flag} timeout in seconds (default {default}, or the mesh "
                "file's [distributed] table)",
            )
        c.add_argument(
            "--job-id",
            default=None,
            help="multi-host: the job's name, checked at join (default $SHARDLIB_JOB_ID, "
            "$SLURM_JOB_ID)",
        )
        c.add_argument(
            "overrides",
            nargs="*",
            metavar="NAME=VALUE",
            help="settings: section.field=VALUE or a short form, e.g. steps=50 model.layers=4",
        )
        return c

    t = command("train", "train on the mesh")
    t.add_argument(
        "--load-params",
        default=None,
        metavar="DIR",
        help="start from these parameters (a checkpoint_dir or a Hugging Face Llama "
        "directory) with a fresh optimizer: checkpoint.init_from=DIR",
    )
    t.add_argument(
        "--deepspeed",
        default=None,
        metavar="DS_CONFIG_JSON",
        help="a DeepSpeed config: its batch, ZeRO, precision, optimizer and scheduler become "
        "settings (NAME=VALUE words still override); --mesh then only sets the device count, "
        "and without --mesh or --cpu-devices shardlib simulates the CPU devices the config's "
        "batch identity implies (train_batch_size / (micro batch x accumulation))",
    )
    g = command("generate", "continue a prompt with a KV cache on the mesh")
    source = g.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a run's checkpoint_dir (latest step)")
    source.add_argument(
        "--hf",
        help="a Hugging Face directory (config.json, safetensors): Llama, Qwen2, Mistral, GPT-2",
    )
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=int, default=0, help="0: every token")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--eos", type=int, default=None, help="end-of-sequence token id")
    g.add_argument("--samples", type=int, default=1, help="sequences generated together")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json (default: the model's or data's, else bytes)",
    )
    e = command("explain", "compile the train step and report its layout; runs nothing")
    e.add_argument("--json", default=None, help="also write the report as JSON here")
    e.add_argument(
        "--peak",
        action="store_true",
        help="also show what is live at the memory peak, where it falls, and the packing",
    )
    par = command("parity", "compare losses and gradients with a one-device run")
    par.add_argument("--steps", type=int, default=5)
    par.add_argument("--tol", type=float, default=1e-5)
    x = sub.add_parser("export", help="write a checkpoint's parameters for use without shardlib")
    x.add_argument("--checkpoint", required=True, help="a run's checkpoint_dir")
    x.add_argument("--out", required=True, help="PATH.safetensors, PATH.npz, or a directory")
    x.add_argument("--step", type=int, default=None, help="default: the latest complete step")
    x.add_argument(
        "--format",
        choices=("shardlib", "hf"),
        default="shardlib",
        help="hf: a Hugging Face Llama directory (per-layer names, LoRA merged)",
    )
    launch = sub.add_parser(
        "launch",
        help="run a launcher (shardlib launch mpirun -n N ... shardlib train ...): a TERM "
        "to this stops the run at a step with a checkpoint, and it exits 0",
    )
    launch.add_argument("launcher", nargs=argparse.REMAINDER, help="the launcher command")
    d = sub.add_parser("data", help="prepare token datasets (docs/data.md)")
    prep = d.add_subparsers(dest="data_command", required=True).add_parser(
        "prepare", help="tokenize text / JSON lines / a saved HF dataset into token shards"
    )
    prep.add_argument("inputs", nargs="+", help="text files, .jsonl files, dataset directories")
    prep.add_argument("--tokenizer", required=True, help="tokenizer.json or sentencepiece .model")
    prep.add_argument("--out", required=True, help="a new directory for shards + index.json")
    prep.add_argument("--eval-fraction", type=float, default=0.05, help="documents held out")
    prep.add_argument("--seed", type=int, default=0, help="seeds the held-out choice")
    prep.add_argument("--eos", default="auto", help="auto, none, or the end-of-sequence token")
    from shardlib.tools.plan_cli import add_plan_command

    add_plan_command(sub)
    return p
