"""The ``optimizer`` section of ``TrainConfig`` (``shardlib.train.config``): the optax
optimizer, its settings and its learning-rate schedule, checked by ``train.optim`` when the
section is made. Its own module because it is the largest section: one field per setting
of the optimizers DeepSpeed's configs name (1-bit LAMB's factors, 1cycle's momentum, ...).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Optimizer:
    """The optax optimizer and its learning-rate schedule (``shardlib.train.optim``)."""

    name: str = "adamw"
    """adamw, adam, sgd (momentum), lamb, lars or adafactor (all from optax), or onebit_adam /
    onebit_lamb (1-bit Adam / LAMB: compressed momentum communication after ``freeze_step``)."""
    lr: float = 3e-3
    """Peak learning rate."""
    schedule: str = "warmup_cosine"
    """Learning-rate schedule: constant, warmup_cosine, warmup_linear, inverse_sqrt,
    one_cycle (Smith's 1cycle, DeepSpeed's OneCycle) or range_test (DeepSpeed's
    LRRangeTest): ``train/cycles.py``."""
    warmup: int = 10
    """Warm-up steps before the decay (one_cycle: the rising half of the cycle)."""
    warmup_type: str = "linear"
    """Warm-up shape: linear from 0, or log (DeepSpeed's WarmupLR default)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr``."""
    schedule_steps: int = 0
    """Steps the schedule spans (warm-up clipped to it, the decay ending at its last step,
    the final rate after it); 0: ``run.steps``. A resumed run whose ``run.steps`` changed is
    refused where that would change the schedule: set this to the checkpoint's length to
    train on with its schedule (``checkpoint.resume``)."""
    cycle_down_steps: int = 0
    """one_cycle: steps of the falling half (0: as many as ``warmup``)."""
    interval_steps: int = 0
    """one_cycle: after the cycle the rate is ``lr·min_lr_ratio / (1 + interval_rate·k)``
    after k intervals of this many steps (0: no decay); range_test: its interval."""
    interval_rate: float = 0.0
    """one_cycle: the decay rate per interval; range_test: the growth per interval."""
    staircase: bool = False
    """range_test: grow in whole intervals instead of continuously."""
    b1_min: float = 0.0
    """one_cycle with adam/adamw: cycle beta1 against the rate, from ``b1`` down to this and
    back (DeepSpeed's ``cycle_momentum``); 0: beta1 fixed."""
    b1_decay_rate: float = 0.0
    """one_cycle with ``b1_min``: after the cycle beta1 is ``b1·(1 + b1_decay_rate·k)``."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW); norms and biases are exempt."""
    b1: float = 0.9
    """Adam beta1."""
    b2: float = 0.95
    """Adam beta2."""
    eps: float = 0.0
    """Adam/LAMB epsilon; 0: the optimizer's own default (optax: 1e-8, LAMB 1e-6)."""
    freeze_step: int = 20
    """onebit_adam, onebit_lamb: full-precision Adam (LAMB) steps before the variance freezes
    and the momentum is communicated in 1 bit (Tang et al.: about 15-25% of the run)."""
    coeff_beta: float = 0.9
    """onebit_lamb: weight of the running average of the warm-up's trust ratios that becomes
    the frozen coefficient (DeepSpeed: keep 1/(1 - coeff_beta) <= freeze_step)."""
    factor_max: float = 4.0
    """onebit_lamb: upper bound of the factor that scales the frozen coefficient after warm-up."""
    factor_min: float = 0.5
    """onebit_lamb: lower bound of that factor."""
    factor_threshold: float = 0.1
    """onebit_lamb: the most the factor may change in one step, as a fraction of the last."""
    bias_correction: bool = True
    """adamw, adam, onebit_adam, lamb and onebit_lamb: Adam's bias correction (DeepSpeed's
    BERT examples, 1-bit Adam's and LAMB's, turn it off)."""
    trust_ratio_min: float = 0.0
    """lamb, onebit_lamb: lower bound of the trust ratio ||w|| / ||update|| (DeepSpeed's
    ``min_coeff``); 0: unbounded."""
    trust_ratio_max: float = 0.0
    """lamb, onebit_lamb: upper bound of the trust ratio (DeepSpeed's ``max_coeff``);
    0: unbounded."""
    clip_norm: float = 1.0
    """Global gradient-norm clipping threshold (0 disables it)."""
    momentum: float = 0.9
    """Momentum of sgd and lars."""
    factored_min_dim: int = 128
    """Adafactor factors a weight's second moment when its two largest dims are >= this."""

    def __post_init__(self) -> None:
        from shardlib.train.optim import check_optimizer

        check_optimizer(self)
