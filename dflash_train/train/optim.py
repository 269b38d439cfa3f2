"""AdamW with linear warm-up and cosine decay (paper: lr 6e-4, warm-up 4%, clip 1.0).

With a wall-clock budget (`train.max_minutes`) the cosine follows whichever runs out first, the
steps or the time, so a budgeted run always ends at the bottom of its schedule however fast the
machine is (a CPU shared with other jobs can run at half speed for minutes).
"""

from __future__ import annotations

import math
import time

import torch

from dflash_train.config import OptimConfig


class TimeBudget:
    """Fraction of a wall-clock budget spent; always 0 without a budget. A resumed run starts
    with the seconds its checkpoint had already spent, so the budget (and the lr that follows
    it) continues instead of starting over."""

    def __init__(self, minutes: float | None):
        self.seconds = 60.0 * minutes if minutes else None
        self.t0 = time.perf_counter()

    def start(self, already_spent_s: float = 0.0) -> None:
        self.t0 = time.perf_counter() - already_spent_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def fraction(self) -> float:
        return self.elapsed() / self.seconds if self.seconds else 0.0

    def spent(self) -> bool:
        return self.seconds is not None and self.elapsed() > self.seconds


def lr_factor(step: int, total_steps: int, warmup_ratio: float, min_ratio: float, time_fraction: float = 0.0
              ) -> float:
    """Multiplier of the peak lr at `step` (0-based): linear warm-up, then cosine to min_ratio; the
    cosine's progress is the larger of the step fraction and `time_fraction` (of a time budget)."""
    warmup = max(1, round(warmup_ratio * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, max((step - warmup) / max(1, total_steps - warmup), time_fraction))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(params, cfg: OptimConfig, total_steps: int, fused: bool = False,
                    budget: TimeBudget | None = None):
    """AdamW over the trainable parameters and its LambdaLR schedule (both resumable; with a
    `budget`, the lr also decays with the time spent, read when the scheduler steps)."""
    params = [p for p in params if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                  **({"fused": True} if fused else {}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg.warmup_ratio, cfg.min_lr_ratio,
                                          budget.fraction() if budget else 0.0))
    return optimizer, scheduler
