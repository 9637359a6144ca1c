"""ds_config.json -> shardlib settings: the DeepSpeed documentation's examples, refusals.

The configs below are written out from deepspeed.ai: the config-json page's examples, the
ZeRO++ tutorial's and the 1-bit Adam tutorial's (BERT pre-training / SQuAD fine-tuning).
Pure mapping: nothing is compiled.
"""

import math

import pytest

from shardlib.core.errors import ShardingError
from shardlib.interop.deepspeed import DeepSpeedRefusal, from_deepspeed, implied_devices
from shardlib.train.config import TrainConfig, override
from shardlib.train.optim import schedule

# deepspeed.ai/docs/config-json: the optimizer, scheduler, fp16 and ZeRO examples in one file
CONFIG_JSON = {
    "train_batch_size": 32,
    "gradient_accumulation_steps": 1,
    "optimizer": {
        "type": "Adam",
        "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000},
    },
    "fp16": {
        "enabled": True,
        "auto_cast": False,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "consecutive_hysteresis": False,
        "min_loss_scale": 1,
    },
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 5e8,
        "overlap_comm": False,
        "reduce_scatter": True,
        "reduce_bucket_size": 5e8,
        "contiguous_gradients": True,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    },
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
}

# deepspeed.ai/tutorials/zeropp: its zero_optimization snippet as published (ZeRO-3 with qwZ,
# hpZ over 16 GPUs per node, qgZ), plus the batch and precision of its launch command
# (--batch-size 1 --fp16) on its 4 nodes x 16 V100
ZEROPP = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "fp16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": 10000000,
        "reduce_scatter": False,
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 16,
        "zero_quantized_gradients": True,
        "contiguous_gradients": True,
        "overlap_comm": True,
    },
}

# deepspeed.ai/tutorials/onebit-adam (v2, NCCL): BERT-Large pre-training, seq 128, 4k batch
ONEBIT_BERT = {
    "train_batch_size": 4096,
    "train_micro_batch_size_per_gpu": 16,
    "steps_per_print": 100,
    "prescale_gradients": False,
    "optimizer": {
        "type": "OneBitAdam",
        "params": {
            "lr": 4e-4,
            "weight_decay": 0.01,
            "bias_correction": False,
            "freeze_step": 23000,
            "comm_backend_name": "nccl",
        },
    },
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
}


def test_config_json_examples_map_to_settings():
    ds = from_deepspeed(CONFIG_JSON, devices=8)
    assert ds.mesh == {"data": 8}
    s = ds.settings
    assert (s["dataset.batch"], s["parallel.data.microbatches"]) == (32, 1)
    assert s["parallel.data.zero"] == 2 and s["parallel.offload.optimizer"] is True
    assert s["precision.compute"] == "fp16" and s["precision.initial_scale_power"] == 16
    assert (s["precision.loss_scale_window"], s["precision.hysteresis"]) == (1000, 2)
    assert s["optimizer.name"] == "adamw"  # DeepSpeed's Adam decouples decay (adam_w_mode)
    assert (s["optimizer.b1"], s["optimizer.b2"], s["optimizer.eps"]) == (0.8, 0.999, 1e-8)
    assert s["optimizer.weight_decay"] == 3e-7 and s["optimizer.clip_norm"] == 1.0
    assert s["optimizer.schedule"] == "warmup_linear" and s["optimizer.min_lr_ratio"] == 1.0
    assert (s["optimizer.warmup"], s["optimizer.warmup_type"]) == (1000, "log")
    assert any(n.startswith("zero_optimization.overlap_comm") for n in ds.notes)
    cfg = override(TrainConfig(), s)  # every setting is a real one, with its type
    assert cfg.parallel.data.zero == 2 and cfg.optimizer.lr == 0.001
    assert "zero=2" in ds.command().replace("parallel.data.", "") and "--mesh cpu-8-dp" in (
        ds.command()
    )


def test_zeropp_tutorial_maps_to_quantized_hierarchical_zero3():
    ds = from_deepspeed(ZEROPP, devices=64)
    assert ds.mesh == {"data": 4, "fsdp": 16}  # 4 nodes x 16 GPUs: hpZ inside a node
    s = ds.settings
    assert s["parallel.data.zero"] == 3 and s["parallel.data.hpz"] is True
    assert s["parallel.data.quantized_weights"] and s["parallel.data.quantized_gradients"]
    assert (s["dataset.batch"], s["parallel.data.microbatches"]) == (64, 1)
    assert s["precision.compute"] == "fp16"
    assert s["optimizer.clip_norm"] == 0.0 and s["optimizer.schedule"] == "constant"


def test_onebit_adam_tutorial_maps_to_onebit_adam():
    ds = from_deepspeed(ONEBIT_BERT, devices=64)
    s = ds.settings
    assert s["optimizer.name"] == "onebit_adam" and s["optimizer.freeze_step"] == 23000
    assert s["optimizer.bias_correction"] is False and s["optimizer.weight_decay"] == 0.01
    assert (s["dataset.batch"], s["parallel.data.microbatches"]) == (4096, 4)  # 4096/(16*64)
    assert s["precision.compute"] == "fp16"
    assert any("comm_backend_name" in n for n in ds.notes)
    assert override(TrainConfig(), s).optimizer.name == "onebit_adam"


def test_every_unsupported_key_is_named_in_one_error():
    bad = {
        **CONFIG_JSON,
        "optimizer": {"type": "ZeroOneAdam", "params": {"lr": 1e-3}},
        "sparse_attention": {"mode": "fixed"},
        "fp16": {"enabled": True, "consecutive_hysteresis": True},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}},
        "sparse_gradients": True,
        "train_micro_batch_size_per_gpu": 3,
        "gradient_clippin": 1.0,
    }
    with pytest.raises(DeepSpeedRefusal) as err:
        from_deepspeed(bad, devices=8)
    text = str(err.value)
    for key in (
        "optimizer.type",
        "sparse_attention",
        "fp16.consecutive_hysteresis",
        "sparse_gradients",
        "zero_optimization.offload_param.device",
        "train_batch_size",
        "gradient_clippin",
    ):
        assert key in text, key
    assert "0/1 Adam" in text and "7 unsupported" in text
    assert {r.key for r in err.value.unlisted} == {
        "fp16.consecutive_hysteresis", "sparse_gradients", "train_batch_size",
        "gradient_clippin",
    }  # fmt: skip


def test_inconsistent_batch_is_refused_naming_the_three_values():
    bad = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 3,
           "gradient_accumulation_steps": 1}  # fmt: skip
    bad["sparse_attention"] = {"mode": "fixed"}  # one error names both
    with pytest.raises(ShardingError, match="per_gpu=3.*on 8 devices.*sparse_attention"):
        from_deepspeed(bad, devices=8)


def test_scheduler_examples_with_deepspeeds_log_warmup():
    """WarmupLR's default warm-up is DeepSpeed's log ramp: lr * log(step + 1) / log(warmup);
    WarmupDecayLR then decays linearly to 0 at total_num_steps."""
    ds = from_deepspeed(
        {"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params": {
            "total_num_steps": 100, "warmup_max_lr": 0.01, "warmup_num_steps": 10}}},
        devices=8,
    )  # fmt: skip
    cfg = override(TrainConfig(), ds.settings)
    assert cfg.run.steps == 100 and cfg.optimizer.warmup_type == "log"
    lr = schedule(cfg.optimizer, cfg.run.steps)
    assert abs(float(lr(4)) - 0.01 * math.log(5) / math.log(10)) < 1e-7
    assert abs(float(lr(55)) - 0.005) < 1e-6 and float(lr(100)) == 0.0
    cos = from_deepspeed({"train_batch_size": 8, "scheduler": {"type": "WarmupCosineLR",
                          "params": {"total_num_steps": 50, "warmup_num_steps": 5,
                                     "warmup_type": "linear"}}}, devices=8)  # fmt: skip
    assert cos.settings["optimizer.schedule"] == "warmup_cosine"
    assert cos.settings["optimizer.min_lr_ratio"] == 0.0001


def test_activation_checkpointing_maps_to_remat():
    """partition_activations: remat=full (saved inputs split over tensor where replicated);
    cpu_checkpointing: the residual stream offloaded to host; the rest are tuning notes."""
    from models.llama.model import CHECKPOINT_NAMES
    from shardlib.parallel.remat import parse_remat

    base = {"train_batch_size": 8}
    section = {"partition_activations": True, "contiguous_memory_optimization": True,
               "number_checkpoints": 4, "synchronize_checkpoint_boundary": False,
               "profile": False}  # fmt: skip
    ds = from_deepspeed({**base, "activation_checkpointing": section}, devices=8)
    assert ds.settings["parallel.remat.policy"] == "full"
    for key in ("contiguous_memory_optimization", "number_checkpoints", "profile",
                "synchronize_checkpoint_boundary", "partition_activations"):  # fmt: skip
        assert any(n.startswith(f"activation_checkpointing.{key}") for n in ds.notes), key
    cpu = {**section, "cpu_checkpointing": True}
    ds = from_deepspeed({**base, "activation_checkpointing": cpu}, devices=8)
    policy = ds.settings["parallel.remat.policy"]
    assert parse_remat(policy, CHECKPOINT_NAMES).mode == "offload"  # a name llama tags
    assert override(TrainConfig(), ds.settings).parallel.remat.policy == policy
    off = {"partition_activations": False, "cpu_checkpointing": False}
    ds = from_deepspeed({**base, "activation_checkpointing": off}, devices=8)
    assert "parallel.remat.policy" not in ds.settings


def test_static_loss_scale_and_master_weights():
    ds = from_deepspeed({"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale": 4096,
                         "fp16_master_weights_and_grads": True}}, devices=8)  # fmt: skip
    cfg = override(TrainConfig(), ds.settings)
    assert cfg.precision.compute == "fp16" and cfg.precision.loss_scale == 4096
    assert any(n.startswith("fp16.fp16_master_weights_and_grads: shardlib keeps fp32") for n in
               ds.notes)  # fmt: skip


def test_lamb_keys_and_deepspeeds_default_trust_ratio_bounds():
    lamb = {"type": "Lamb", "params": {"lr": 11e-3, "weight_decay": 0.01,
            "bias_correction": False, "max_coeff": 0.3, "min_coeff": 0.01}}  # fmt: skip
    s = from_deepspeed({"train_batch_size": 8, "optimizer": lamb}, devices=8).settings
    opt = override(TrainConfig(), s).optimizer
    assert (opt.name, opt.bias_correction) == ("lamb", False)
    assert (opt.trust_ratio_min, opt.trust_ratio_max) == (0.01, 0.3)
    plain = {"type": "Lamb", "params": {"lr": 1e-3}}  # FusedLamb bounds it all the same
    s = from_deepspeed({"train_batch_size": 8, "optimizer": plain}, devices=8).settings
    assert (s["optimizer.trust_ratio_min"], s["optimizer.trust_ratio_max"]) == (0.01, 10.0)
    assert s["optimizer.bias_correction"] is True


def test_tuning_keys_and_deepspeeds_own_misspellings_are_notes():
    zero = {"stage": 3, "sub_group_size": 1e9, "stage3_param_persitence_threshold": 1e4,
            "stage3_param_persitance_threshold": 1e5, "comm_overlap": True,
            "stage3_max_live_parameters": 1e9, "round_robin_gradients": True,
            "cpu_offload_params": True, "cpu_offload_use_pin_memory": True}  # fmt: skip
    config = {"train_batch_size": 8, "zero_optimization": zero, "aio": {"block_size": 1048576},
              "flops_profiler": {"enabled": True}, "autotuning": {"enabled": True}}  # fmt: skip
    ds = from_deepspeed(config, devices=8)
    noted = {n.split(":")[0] for n in ds.notes}
    for key in ("sub_group_size", "stage3_param_persitence_threshold", "comm_overlap",
                "stage3_param_persitance_threshold", "round_robin_gradients"):  # fmt: skip
        assert f"zero_optimization.{key}" in noted, key
    assert {"aio", "flops_profiler", "autotuning"} <= noted
    assert ds.settings["parallel.offload.params"] is True  # cpu_offload_params: old spelling


def test_auto_is_shardlibs_own_setting():
    ds = from_deepspeed({"train_micro_batch_size_per_gpu": "auto",
                         "gradient_accumulation_steps": "auto"}, devices=8)  # fmt: skip
    assert "dataset.batch" not in ds.settings and "parallel.data.microbatches" not in ds.settings
    assert any(n.startswith("train_micro_batch_size_per_gpu: 'auto'") for n in ds.notes)


def test_a_config_for_other_gpu_counts_says_which_and_how_to_try_it():
    """The ZeRO-Offload 10B example: 30 = micro x 3 x GPUs, so 1, 2, 5 or 10 GPUs, not 8."""
    config = {"train_batch_size": 30, "gradient_accumulation_steps": 3}
    with pytest.raises(DeepSpeedRefusal) as err:
        from_deepspeed(config, devices=8)
    text = str(err.value)
    assert "on 8 devices; it holds on 1, 2, 5 or 10 GPUs" in text
    assert "leave out --mesh (shardlib then simulates 10 CPU devices)" in text
    assert "--cpu-devices 10" in text
    assert implied_devices(config) == 10
    assert implied_devices({**config, "train_micro_batch_size_per_gpu": 5}) == 2
    assert implied_devices({"train_micro_batch_size_per_gpu": 4}) is None
    assert from_deepspeed(config, devices=10).settings["dataset.batch"] == 30


@pytest.mark.slow
def test_cli_simulates_the_devices_a_config_is_written_for():
    """``shardlib train --deepspeed`` without --mesh: the ZeRO-Offload 10B example (stored
    unchanged) on the 10 CPU devices its identity implies; ZeRO-2 splits the optimizer
    state 10 ways, so the tiny model's widths are multiples of 10."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[2]
    path = Path(__file__).parent / "deepspeed_configs" / "megatron_zero_offload_10b.json"
    words = ["model=llama-tiny", "model.layers=1", "model.embed=80", "model.mlp=320",
             "steps=2", "seq=8"]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "shardlib.tools.entry", "train", "--deepspeed", str(path), *words],
        capture_output=True, text=True, timeout=300, cwd=root,
        env={**os.environ, "COLUMNS": "400"},  # rich: one line per message
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "without --mesh: 10 simulated CPU devices" in text
    assert "on data=10 (10 cpu devices)" in text and "over 2 steps" in text
    assert "precision.loss_scale=4096" in text and "remat.policy=offload:" in text


def test_bert_examples_adam_switches_and_autotuning_lists():
    """BingBertSquad's Adam (bias_correction false, apex's max_grad_norm), the PLD example's
    prescaling (a note: the mean is the same), the autotuner's list of micro batches."""
    adam = {"type": "Adam", "params": {"lr": 3e-5, "max_grad_norm": 1.0, "weight_decay": 0.0,
            "bias_correction": False}}  # fmt: skip
    ds = from_deepspeed({"train_batch_size": 24, "optimizer": adam,
                         "prescale_gradients": True, "gradient_predivide_factor": 8},
                        devices=4)  # fmt: skip
    opt = override(TrainConfig(), ds.settings).optimizer
    assert (opt.name, opt.bias_correction, opt.clip_norm) == ("adam", False, 1.0)
    assert {"prescale_gradients", "gradient_predivide_factor"} <= {
        n.split(":")[0] for n in ds.notes
    }
    ds = from_deepspeed({"train_micro_batch_size_per_gpu": [8, 16],
                         "zero_optimization": {"stage": [1, 2]}}, devices=2)  # fmt: skip
    assert (ds.settings["dataset.batch"], ds.settings["parallel.data.zero"]) == (16, 1)
    assert any("search space for DeepSpeed's autotuner" in n for n in ds.notes)


def test_old_forms_and_a_config_without_batch_keys():
    """Megatron-LM/scripts/ds_config.json's ``"zero_optimization": true`` (stage 1); MoQ's
    example gives no batch at all (its Hugging Face script does): shardlib's batch."""
    ds = from_deepspeed({"train_batch_size": 16, "zero_optimization": True}, devices=8)
    assert ds.settings["parallel.data.zero"] == 1
    assert any(n.startswith("zero_optimization: true, the old form") for n in ds.notes)
    ds = from_deepspeed({"gradient_clipping": 1.0, "fp16": {"enabled": True}}, devices=8)
    assert "dataset.batch" not in ds.settings
    assert any(n.startswith("train_batch_size: not given") for n in ds.notes)


def test_onebit_lamb_maps_to_onebit_lamb_with_deepspeeds_settings():
    """OneBitLamb: its freeze and factor settings, LAMB's trust-ratio bounds, and the moments
    uncorrected whatever ``bias_correction`` says (DeepSpeed's OnebitLamb never corrects)."""
    onebit = {"type": "OneBitLamb", "params": {"lr": 5e-3, "freeze_step": 1000,
              "factor_max": 2.0, "max_coeff": 0.3, "cuda_aware": False}}  # fmt: skip
    ds = from_deepspeed({"train_batch_size": 8, "optimizer": onebit}, devices=8)
    opt = override(TrainConfig(), ds.settings).optimizer
    assert (opt.name, opt.freeze_step, opt.factor_max, opt.factor_min) == (
        "onebit_lamb", 1000, 2.0, 0.5)  # fmt: skip
    assert (opt.coeff_beta, opt.factor_threshold) == (0.9, 0.1)
    assert (opt.trust_ratio_min, opt.trust_ratio_max) == (0.01, 0.3)
    assert opt.bias_correction is False
    assert any(n.startswith("optimizer.params.bias_correction: OnebitLamb") for n in ds.notes)


def test_nvme_optimizer_offload_maps_to_the_nvme_tier():
    config = {**CONFIG_JSON, "zero_optimization": {"stage": 0, "offload_optimizer": {
        "device": "nvme", "nvme_path": "/nvme_data", "pipeline_read": True}}}  # fmt: skip
    s = from_deepspeed(config, devices=8).settings
    assert s["parallel.offload.optimizer"] is True
    assert s["parallel.offload.nvme_path"] == "/nvme_data"
    both = {**config["zero_optimization"], "offload_param": {"device": "nvme"}}
    s = from_deepspeed({**config, "zero_optimization": both}, devices=8).settings
    assert s["parallel.offload.nvme_params"] is True  # the weights next to the state
    assert s["parallel.offload.nvme_path"] == "/nvme_data"
    # ZeRO-Infinity's partitioned files (stage 3): no counterpart, refused naming the key
    with pytest.raises(DeepSpeedRefusal, match="offload_param.device.*stage 3"):
        from_deepspeed({**config, "zero_optimization": {**both, "stage": 3}}, devices=8)
