"""AdamW with linear warm-up and cosine decay (paper: lr 6e-4, warm-up 4%, clip 1.0).

With a wall-clock budget (`train.max_minutes`) the cosine follows whichever runs out first, the
steps or the time, so a budgeted run always ends at the bottom of its schedule however fast the
machine is (a CPU shared with other jobs can run at half speed for minutes).
"""

from __future__ import annotations

import contextlib
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


def build_optimizer(params, cfg: OptimConfig, total_steps: int, budget: TimeBudget | None = None,
                    master_weights: bool | None = None):
    """AdamW over the trainable parameters and its LambdaLR schedule (both resumable; with a
    `budget`, the lr also decays with the time spent, read when the scheduler steps).
    Which AdamW follows from the parameters' device: on CUDA MasterWeightAdamW (bf16 parameters,
    float32 masters, compiled update) when `master_weights` (default: `cfg.master_weights`), else
    torch's fused AdamW; on the CPU torch's AdamW over float32 parameters."""
    params = [p for p in params if p.requires_grad]
    cuda = params[0].device.type == "cuda"
    if master_weights if master_weights is not None else cuda and cfg.master_weights:
        optimizer = MasterWeightAdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                      compiled=cuda)
    else:
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                      **({"fused": True} if cuda else {}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg.warmup_ratio, cfg.min_lr_ratio,
                                          budget.fraction() if budget else 0.0))
    return optimizer, scheduler


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW over bf16 parameters that keeps their float32 master weights in its state.

    Why: with float32 parameters under bf16 autocast every step casts each weight to bf16 in the
    forward and each bf16 weight gradient back to float32 in the backward, and the fused AdamW then
    streams 32 bytes per parameter (float32 weight, gradient, two moments; the clip rewrites the
    gradient). Here the module holds the bf16 weights the matmuls read and gets bf16 gradients
    straight from them; one elementwise kernel per tensor (compiled) reads the bf16 gradient and the
    float32 master and moments and writes them back with the new bf16 weight: 28 bytes, no casts.

    The arithmetic is torch.optim.AdamW's (single-tensor path, float32) applied to the masters, so
    training follows float32 weights whose forward runs in bf16, as under autocast. What differs:
    gradients accumulate over micro-batches (and DDP reduces them) in bf16.
    `grad_scale` (a device tensor, set by `step.clip_and_step`) divides every gradient, as in the
    fused AdamW. Build it on the float32 module: the masters are copied before the cast to bf16.
    """

    def __init__(self, params, lr: float, betas: tuple[float, float], weight_decay: float, eps: float = 1e-8,
                 param_dtype: torch.dtype = torch.bfloat16, compiled: bool = False):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps))
        self.grad_scale: torch.Tensor | None = None
        self._update = torch.compile(_adamw_update, fullgraph=True, dynamic=False) if compiled else _adamw_update
        for p in self._params():
            self.state[p].update(step=torch.tensor(0.0), master=p.detach().float().clone(),
                                 exp_avg=torch.zeros_like(p, dtype=torch.float32),
                                 exp_avg_sq=torch.zeros_like(p, dtype=torch.float32))
            p.data = p.data.to(param_dtype)

    def _params(self):
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self.state[p] for p in params]
            for state in states:
                state["step"] += 1
            coeffs = self._coefficients(group, float(states[0]["step"]), params[0].device)
            scale = self.grad_scale if self.grad_scale is not None else torch.ones((), device=params[0].device)
            self._update(params, [p.grad for p in params], [s["master"] for s in states],
                         [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], coeffs, scale)

    @staticmethod
    def _coefficients(group: dict, step: float, device: torch.device) -> torch.Tensor:
        """AdamW's per-step scalars, computed on the host as torch's AdamW does, sent in one
        non-blocking copy (a tensor, so the compiled update never recompiles as the lr moves)."""
        lr, (beta1, beta2) = group["lr"], group["betas"]
        values = [1 - lr * group["weight_decay"], 1 - beta1, beta2, 1 - beta2,
                  lr / (1 - beta1 ** step), (1 - beta2 ** step) ** 0.5, group["eps"]]
        host = torch.tensor(values, dtype=torch.float32, pin_memory=device.type == "cuda")
        return host.to(device, non_blocking=True)

    def state_dict(self) -> dict:
        """torch.optim.AdamW's layout (step, exp_avg, exp_avg_sq per parameter): either optimizer
        resumes from the other's. The masters are not in it: they are the weights a checkpoint
        stores (`full_precision_weights`), and are loaded back into the module inside that block."""
        full = super().state_dict()
        full["state"] = {i: {k: v for k, v in s.items() if k != "master"} for i, s in full["state"].items()}
        return full

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore step and moments, the moments as float32 (the base class would cast them to the
        parameters' bf16); the masters stay as they are (load the weights first, see state_dict)."""
        params = self._params()
        kept = {p: dict(self.state[p]) for p in params}
        super().load_state_dict(state_dict)
        for index, p in enumerate(params):
            saved = state_dict["state"].get(index, {})
            self.state[p] = {**kept[p], **self.state[p]}
            for key in ("exp_avg", "exp_avg_sq"):
                if key in saved:
                    self.state[p][key] = saved[key].to(device=p.device, dtype=torch.float32)
            self.state[p]["master"] = kept[p]["master"]

    @contextlib.contextmanager
    def full_precision_weights(self):
        """Inside the block the parameters are the float32 masters: what a checkpoint stores, and
        where loading a checkpoint's weights must write. On exit the bf16 weights are the masters
        rounded again."""
        low = [(p, p.data) for p in self._params()]
        try:
            for p, _ in low:
                p.data = self.state[p]["master"]
            yield
        finally:
            for p, data in low:
                p.data = data
                data.copy_(self.state[p]["master"])


def _adamw_update(params, grads, masters, exp_avgs, exp_avg_sqs, coeffs, grad_scale) -> None:
    """torch.optim.AdamW's single-tensor update on the float32 masters, then the bf16 weights.
    coeffs: [1 - lr*wd, 1 - beta1, beta2, 1 - beta2, lr / bias1, sqrt(bias2), eps]."""
    decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bias2_sqrt, eps = coeffs.unbind(0)
    for param, grad, master, exp_avg, exp_avg_sq in zip(params, grads, masters, exp_avgs, exp_avg_sqs):
        g = grad.float() / grad_scale
        master.mul_(decay)
        exp_avg.lerp_(g, one_minus_beta1)
        exp_avg_sq.mul_(beta2).add_(g * g * one_minus_beta2)
        denom = exp_avg_sq.sqrt() / bias2_sqrt + eps
        master.sub_(exp_avg / denom * step_size)
        param.copy_(master)


def full_precision_weights(optimizer):
    """The parameters as a checkpoint must store them: the masters of a MasterWeightAdamW, else as is."""
    if isinstance(optimizer, MasterWeightAdamW):
        return optimizer.full_precision_weights()
    return contextlib.nullcontext()
