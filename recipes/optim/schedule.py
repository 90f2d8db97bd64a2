"""The learning-rate schedule: linear warmup, then cosine decay to a fraction of the peak."""

from __future__ import annotations

import optax

from spillway.layers.errors import ConfigError
from spillway.recipes.optim.config import OptimizerConfig


def check_schedule_steps(cfg: OptimizerConfig, total_steps: int) -> None:
    """The schedule needs 0 <= warmup_steps < total_steps (cosine decay over the rest)."""
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps <= 0:
        raise ConfigError(f"the schedule's total_steps must be a positive integer, got {total_steps!r}")
    if cfg.warmup_steps >= total_steps:
        raise ConfigError(f"optimizer.warmup_steps ({cfg.warmup_steps}) must be fewer than the schedule's "
                          f"{total_steps} steps")



def make_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to cfg.learning_rate, then cosine decay to min_lr_ratio * learning_rate
    at `total_steps` (warmup included)."""
    check_schedule_steps(cfg, total_steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=total_steps, end_value=cfg.learning_rate * cfg.min_lr_ratio)
