"""AdamW with linear warm-up and cosine decay (paper: lr 6e-4, warm-up 4%, clip 1.0).

The lr is a pure function of the step and of recorded numbers, so every run can be replayed:
without a time budget the cosine runs over `total_steps`; with one (`train.max_minutes`) it runs
over the step count the budget was measured to allow (`TimeBudget`, a recorded decision).
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from dflash_train.config import OptimConfig

DECIDE_AFTER = 5  # a time budget measures steps 2..5 (step 1 compiles), then decides the step count


class TimeBudget:
    """A wall-clock budget turned into a recorded step count. Stateful.

    The rule: a run with `max_minutes` trains its first DECIDE_AFTER steps (from the start or the
    resume point) on the configured schedule, measures the seconds per step over all but the
    first of them, and then decides `steps` = the steps done + the steps the remaining budget
    allows at that rate (never more than `total_steps`; all drafter ranks take the smallest).
    The decision is recorded in the checkpoint; from then on the cosine's length is `steps`, so
    the lr is a pure function of the step and that number. A resume with the same budget keeps
    the decision; one with another budget decides again. The clock still rules the end: the run
    stops when the budget is spent even if the machine slowed down, and the seconds spent carry
    over on resume (so only a larger budget trains further)."""

    def __init__(self, minutes: float | None, total_steps: int, decide_after: int = DECIDE_AFTER):
        self.seconds = 60.0 * minutes if minutes else None
        self.total_steps, self.decide_after = total_steps, decide_after
        self.steps: int | None = None  # the recorded decision
        self.t0 = time.perf_counter()
        self.start_step, self.measure_from = 0, None

    def start(self, step: int, already_spent_s: float = 0.0) -> None:
        """The loop begins at `step` with `already_spent_s` of the budget gone (a resume)."""
        self.t0 = time.perf_counter() - already_spent_s
        self.start_step, self.measure_from = step, None

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def spent(self) -> bool:
        return self.seconds is not None and self.elapsed() > self.seconds

    def propose(self, step: int) -> int | None:
        """Call after every step; at the decision step, the step count the budget allows (to be
        agreed between ranks and passed to `record`), else None."""
        if self.seconds is None or self.steps is not None:
            return None
        if step == self.start_step + 1:
            self.measure_from = self.elapsed()
        if step != self.start_step + self.decide_after or self.measure_from is None:
            return None
        per_step = (self.elapsed() - self.measure_from) / (self.decide_after - 1)
        fits = math.floor(max(0.0, self.seconds - self.elapsed()) / max(per_step, 1e-9))
        return min(self.total_steps, step + fits)

    def record(self, steps: int) -> None:
        self.steps = steps

    def state_dict(self) -> dict:
        return {"steps": self.steps, "budget_s": self.seconds}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"] if state.get("budget_s") == self.seconds else None


def lr_factor(step: int, total_steps: int, warmup_ratio: float, min_ratio: float, steps: int | None = None
              ) -> float:
    """Multiplier of the peak lr at `step` (0-based): linear warm-up over warmup_ratio of
    `total_steps`, then cosine to min_ratio, ending at `steps` (a time budget's decision) or at
    `total_steps`."""
    warmup = max(1, round(warmup_ratio * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    end = steps if steps is not None else total_steps
    progress = min(1.0, max(0.0, (step - warmup) / max(1, end - warmup)))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(params, cfg: OptimConfig, total_steps: int, budget: TimeBudget | None = None,
                    master_weights: bool | None = None):
    """AdamW over the trainable parameters and its LambdaLR schedule (both resumable; with a
    `budget`, the cosine ends at its recorded decision once made).
    Which AdamW follows from the parameters' device: on CUDA MasterWeightAdamW (float32 masters,
    compiled update; `parallel.parallelize` then casts the module to its `param_dtype`) when
    `master_weights` (default: `cfg.master_weights`), else torch's fused AdamW; on the CPU torch's
    AdamW over float32 parameters."""
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
                                          budget.steps if budget else None))
    return optimizer, scheduler


def param_dtype(optimizer) -> torch.dtype | None:
    """The dtype the module's parameters must have for this optimizer (None: leave them)."""
    return optimizer.param_dtype if isinstance(optimizer, MasterWeightAdamW) else None


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
    fused AdamW. Build it on the float32 module (the masters are copied from it); the module is
    then cast to `param_dtype` by `parallel.parallelize`, the one place that sets its dtype.
    """

    def __init__(self, params, lr: float, betas: tuple[float, float], weight_decay: float, eps: float = 1e-8,
                 param_dtype: torch.dtype = torch.bfloat16, compiled: bool = False):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps))
        self.param_dtype = param_dtype
        self.grad_scale: torch.Tensor | None = None
        self._update = torch.compile(_adamw_update, fullgraph=True, dynamic=False) if compiled else _adamw_update
        for p in self._params():
            self.state[p].update(step=torch.tensor(0.0), master=p.detach().float().clone(),
                                 exp_avg=torch.zeros_like(p, dtype=torch.float32),
                                 exp_avg_sq=torch.zeros_like(p, dtype=torch.float32))

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
