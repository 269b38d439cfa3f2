"""AdamW with linear warm-up and cosine decay (paper: lr 6e-4, warm-up 4%, clip 1.0)."""

from __future__ import annotations

import math

import torch

from dflash_train.config import OptimConfig


def lr_factor(step: int, total_steps: int, warmup_ratio: float, min_ratio: float) -> float:
    """Multiplier of the peak lr at `step` (0-based): linear warm-up, then cosine to min_ratio."""
    warmup = max(1, round(warmup_ratio * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(params, cfg: OptimConfig, total_steps: int, fused: bool = False):
    """AdamW over the trainable parameters and its LambdaLR schedule (both resumable)."""
    params = [p for p in params if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                  **({"fused": True} if fused else {}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg.warmup_ratio, cfg.min_lr_ratio))
    return optimizer, scheduler
