"""The optimizer (AdamW, or Muon + AdamW: `optim.name`) with linear warm-up and cosine decay
(paper: AdamW, lr 6e-4, warm-up 4%, clip 1.0).

The lr is a pure function of the step and of recorded numbers, so every run can be replayed:
without a time budget the cosine runs over `total_steps`; with one (`train.max_minutes`) it runs
over the step count the budget was measured to allow (`TimeBudget`, a recorded decision).

What `step.train_step` asks of an optimizer, beyond torch's: it divides every gradient by
`grad_scale` (a device tensor: the global loss-weight sum times the clip factor) where it can
(torch's fused AdamW, `MasterWeightAdamW`, `muon.MuonAdamW`; otherwise the step divides them in
place), and skips a step exactly on `found_inf` (`step_unless`). Optimizers over bf16 parameters
(`param_dtype`) keep float32 masters (`full_precision_weights`) and read float32 gradient sums
(`grads.Float32Grads`) where a step has several micro-batches or drafter ranks.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from dflash_train.config import OptimConfig
from dflash_train.train.optim.muon import MuonAdamW, describe_cost, describe_split, muon_split

DECIDE_AFTER = 30  # a time budget decides the step count after this many steps ...
MEASURE_AFTER = 10  # ... from the rate over the steps after this many: compilation, autotuning and
# allocator warm-up make the first steps of a GPU run seconds long (measured on an H200: steps 2-5 at
# ~2 s against ~0.12 s later, so a decision at step 5 ended a 90-second budget after 26 seconds)


class TimeBudget:
    """A wall-clock budget turned into a recorded step count. Stateful.

    The rule: a run with `max_minutes` trains its first DECIDE_AFTER steps (from the start or the
    resume point) on the configured schedule, measures the seconds per step over those after the
    first MEASURE_AFTER (warm-up), and then decides `steps` = the steps done + the steps the remaining budget
    allows at that rate (never more than `total_steps`; all drafter ranks take the smallest).
    The decision is recorded in the checkpoint; from then on the cosine's length is `steps`, so
    the lr is a pure function of the step and that number. A resume with the same budget keeps
    the decision; one with another budget decides again. The clock still rules the end: the run
    stops when the budget is spent even if the machine slowed down, and the seconds spent carry
    over on resume (so only a larger budget trains further).

    `revise` re-decides at each checkpoint from the rate since MEASURE_AFTER, which by then holds the
    held-out evals and checkpoints that steps 11-30 cannot: from the rate of those steps alone the
    cosine ended at 87 % (4,552 of 5,255 planned steps, the `gpu` recipe on an H100, 2026-12-07) and 84 %
    (README command 1) of its length when the clock ran out. The loop records a revision before the
    checkpoint is written, so a resume from it continues on the same plan."""

    def __init__(self, minutes: float | None, total_steps: int, decide_after: int = DECIDE_AFTER):
        self.seconds = 60.0 * minutes if minutes else None
        self.total_steps, self.decide_after = total_steps, decide_after
        self.measure_after = max(1, min(MEASURE_AFTER, decide_after - 2))
        self.steps: int | None = None  # the recorded decision
        self.clock_allows = 0  # the step count the clock alone allowed at the last decision (before the epochs' cap)
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
        if self.seconds is None:
            return None
        if step == self.start_step + self.measure_after:
            self.measure_from = self.elapsed()  # also after a resumed decision: `revise` measures from here
        if self.steps is not None or step != self.start_step + self.decide_after or self.measure_from is None:
            return None
        return self._fits(step)

    def revise(self, step: int) -> int | None:
        """After the decision (call at a checkpoint, after its held-out eval): the step count the budget
        allows at the rate measured since MEASURE_AFTER, never below step + 1 (the clock ends a run that
        is out of time), to be agreed and passed to `record`; None before the decision or without a budget."""
        if self.seconds is None or self.steps is None or self.measure_from is None \
                or step <= self.start_step + self.decide_after:
            return None
        return max(step + 1, self._fits(step))

    def _fits(self, step: int) -> int:
        """The step count the rest of the budget allows at the rate over the steps after MEASURE_AFTER."""
        per_step = (self.elapsed() - self.measure_from) / (step - self.start_step - self.measure_after)
        fits = math.floor(max(0.0, self.seconds - self.elapsed()) / max(per_step, 1e-9))
        self.clock_allows = step + fits
        return min(self.total_steps, step + fits)

    def epochs_cap(self) -> str:
        """'' when the clock sets the step count; else what the epoch count leaves of the budget (the run
        ends before its minutes: session 29's 20-minute run on 30,000 prompts ended at 19.0 of them, its 30
        epochs done)."""
        if self.steps is None or self.clock_allows <= self.steps or self.steps < self.total_steps:
            return ""
        share = self.total_steps / self.clock_allows
        return (f"; train.epochs caps it (the minutes would allow {self.clock_allows}): the run ends at ~{share:.0%} of "
                f"its minutes, so more data or more epochs would use the rest")

    def record(self, steps: int) -> None:
        self.steps = steps

    def state_dict(self) -> dict:
        return {"steps": self.steps, "budget_s": self.seconds}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"] if state.get("budget_s") == self.seconds else None


def lr_factor(step: int, total_steps: int, warmup_ratio: float, min_ratio: float, steps: int | None = None
              ) -> float:
    """Multiplier of the peak lr at `step` (0-based): linear warm-up over warmup_ratio of the planned
    steps, then cosine to min_ratio; the plan is `steps` (a time budget's decision) once made, else
    `total_steps`. Why the warm-up follows the decision too: a budget usually cuts an epoch count far
    short (the `gpu` recipe: 30 epochs are 13,260 steps, 3.5 minutes ~2,900), and 4 % of the nominal
    count was 18 % of the run spent warming up. Before the decision (step DECIDE_AFTER) the warm-up
    runs on the nominal count, so the lr steps up once, at the decision, still in warm-up unless the
    budget allows fewer than DECIDE_AFTER / warmup_ratio steps."""
    end = steps if steps is not None else total_steps
    warmup = max(1, round(warmup_ratio * end))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, max(0.0, (step - warmup) / max(1, end - warmup)))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(params, cfg: OptimConfig, total_steps: int, budget: TimeBudget | None = None,
                    master_weights: bool | None = None, log=None):
    """The optimizer over the trainable parameters and its LambdaLR schedule (both resumable; with a
    `budget`, the cosine ends at its recorded decision once made). `params`: a module's
    `named_parameters()` (`optim.name=muon` splits by name) or its `parameters()` (AdamW only).

    Which AdamW follows from the parameters' device: on CUDA MasterWeightAdamW (float32 masters,
    compiled update; `parallel.parallelize` then casts the module to its `param_dtype`) when
    `master_weights` (default: `cfg.master_weights`), else torch's fused AdamW; on the CPU torch's
    AdamW over float32 parameters. `optim.name=muon` gives the hidden matrices to our batched Muon
    (`muon.MuonAdamW`, float32 masters where the AdamW part has them) and logs the split once."""
    named = [item if isinstance(item, tuple) else (None, item) for item in params]
    named = [(name, p) for name, p in named if p.requires_grad]
    cuda = named[0][1].device.type == "cuda"
    master = master_weights if master_weights is not None else keeps_float32_masters(cfg, named[0][1].device)
    if cfg.name == "muon":
        if any(name is None for name, _ in named):
            raise ValueError("optim.name=muon splits the parameters by name: pass module.named_parameters()")
        muon, adamw = muon_split(named)
        if not muon:
            raise ValueError("optim.name=muon: the drafter has no 2-D hidden matrix for Muon")
        if log is not None:
            log(describe_split(muon, adamw))
            log(describe_cost([tuple(p.shape) for _, p in muon], cfg.muon_ns_steps, cfg.muon_iteration,
                              cfg.muon_coefficients, cfg.muon_gram_blocks))
        named = adamw
    optimizer = _adamw([p for _, p in named], cfg, cuda, master)
    if cfg.name == "muon":
        optimizer = MuonAdamW([p for _, p in muon], optimizer, lr=cfg.lr, weight_decay=cfg.muon_weight_decay,
                              momentum=cfg.muon_momentum, ns_steps=cfg.muon_ns_steps, master=master,
                              iteration=cfg.muon_iteration, compiled=cuda, gram_blocks=cfg.muon_gram_blocks,
                              coefficients=cfg.muon_coefficients, polar_lower=cfg.muon_polar_lower)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg.warmup_ratio, cfg.min_lr_ratio,
                                          budget.steps if budget else None))
    return optimizer, scheduler


def keeps_float32_masters(cfg: OptimConfig, device: torch.device) -> bool:
    """Whether the optimizer keeps float32 masters of bf16 parameters on `device` (`build_optimizer`'s default):
    then the module trains in bf16 and is never DDP-wrapped (`parallel.parallelize`)."""
    return torch.device(device).type == "cuda" and cfg.master_weights


def _adamw(params: list, cfg: OptimConfig, cuda: bool, master: bool):
    if master:
        return MasterWeightAdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, compiled=cuda)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                             **({"fused": True} if cuda else {}))


def param_dtype(optimizer) -> torch.dtype | None:
    """The dtype the module's parameters must have for this optimizer (None: leave them)."""
    return getattr(optimizer, "param_dtype", None)


def divides_gradients(optimizer) -> bool:
    """Whether the optimizer's step divides every gradient by its `grad_scale` itself."""
    return isinstance(optimizer, (MasterWeightAdamW, MuonAdamW)) or bool(optimizer.defaults.get("fused"))


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW over bf16 parameters that keeps their float32 master weights in its state.

    Why: with float32 parameters under bf16 autocast every step casts each weight to bf16 in the
    forward and each bf16 weight gradient back to float32 in the backward, and the fused AdamW then
    streams 32 bytes per parameter (float32 weight, gradient, two moments; the clip rewrites the
    gradient). Here the module holds the bf16 weights the matmuls read and gets bf16 gradients
    straight from them; one elementwise kernel per tensor (compiled) reads the bf16 gradient and the
    float32 master and moments and writes them back with the new bf16 weight: 28 bytes, no casts.

    The arithmetic is torch.optim.AdamW's (single-tensor path, float32) applied to the masters, so
    training follows float32 weights whose forward runs in bf16, as under autocast. Gradients are
    summed over micro-batches and drafter ranks in float32 too (`grads.Float32Grads`, which this
    optimizer then reads instead of the bf16 `.grad`); with one micro-batch and one rank the
    update reads the bf16 `.grad` directly. `grad_scale` (a device tensor, set by
    `step.clip_and_step`: the loss normaliser times the clip factor) divides every gradient, as in
    the fused AdamW. Build it on the float32 module (the masters are copied from it); the module is
    then cast to `param_dtype` by `parallel.parallelize`, the one place that sets its dtype.
    """

    def __init__(self, params, lr: float, betas: tuple[float, float], weight_decay: float, eps: float = 1e-8,
                 param_dtype: torch.dtype = torch.bfloat16, compiled: bool = False):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps))
        self.param_dtype = param_dtype
        self.grad_scale: torch.Tensor | None = None
        self.found_inf: torch.Tensor | None = None  # 1.0 on the device: skip this step (`step_unless`)
        self.float32_grads = None  # grads.Float32Grads, when a step sums several gradients
        self._update = torch.compile(_adamw_update, fullgraph=True, dynamic=False) if compiled else _adamw_update
        for p in self._params():
            self.state[p].update(step=torch.zeros((), device=p.device), master=p.detach().float().clone(),
                                 exp_avg=torch.zeros_like(p, dtype=torch.float32),
                                 exp_avg_sq=torch.zeros_like(p, dtype=torch.float32))

    def _params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def module_params(self) -> list[torch.Tensor]:
        return self._params()

    def use_float32_grads(self, grads) -> None:
        """Read the step's gradients from `grads` (a grads.Float32Grads) from now on."""
        self.float32_grads = grads

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step; with `found_inf` (a device float tensor, 1 = skip, set by `step_unless`)
        at 1 it leaves the weights, moments and step count exactly as they were, decided on the
        device (no host sync): the step count lives on the device, and the bias corrections are
        computed there from it."""
        f32 = self.float32_grads
        for group in self.param_groups:
            params = [p for p in group["params"] if (f32.has(p) if f32 is not None else p.grad is not None)]
            if not params:
                continue
            grads = [f32.grad(p) for p in params] if f32 is not None else [p.grad for p in params]
            device = params[0].device
            states = [self.state[p] for p in params]
            skip = self.found_inf if self.found_inf is not None else torch.zeros((), device=device)
            apply = 1.0 - skip
            torch._foreach_add_([s["step"] for s in states], apply)
            scale = self.grad_scale if self.grad_scale is not None else torch.ones((), device=device)
            self._update(params, grads, [s["master"] for s in states],
                         [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                         self._hyper(group, device), states[0]["step"], apply, scale)

    @staticmethod
    def _hyper(group: dict, device: torch.device) -> torch.Tensor:
        """[lr, weight_decay, beta1, beta2, eps] in one non-blocking copy (a tensor, so the
        compiled update never recompiles as the lr moves)."""
        values = [group["lr"], group["weight_decay"], *group["betas"], group["eps"]]
        host = torch.tensor(values, dtype=torch.float32, pin_memory=device.type == "cuda")
        return host.to(device, non_blocking=True)

    def state_dict(self) -> dict:
        """torch.optim.AdamW's layout (step, exp_avg, exp_avg_sq per parameter): either optimizer
        resumes from the other's. The masters are not in it: they are the weights a checkpoint
        stores (`full_precision_weights`), and are loaded back into the module inside that block."""
        full = super().state_dict()
        full["state"] = {i: {k: v.cpu() if k == "step" else v for k, v in s.items() if k != "master"}
                         for i, s in full["state"].items()}  # step on the host, as torch's AdamW keeps it
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
            if "step" in saved:  # the count lives on the device (see `step`)
                self.state[p]["step"] = saved["step"].to(device=p.device, dtype=torch.float32)
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


def _adamw_update(params, grads, masters, exp_avgs, exp_avg_sqs, hyper, step, apply, grad_scale) -> None:
    """torch.optim.AdamW's single-tensor update on the float32 masters, then the bf16 weights.
    hyper: [lr, weight_decay, beta1, beta2, eps]; step: the step count after this update; apply:
    1.0, or 0.0 to leave every tensor bit for bit as it was (decay 1, moment weights 0, step size
    0, and the gradient zeroed, since a NaN times 0 is still NaN)."""
    lr, weight_decay, beta1, beta2, eps = hyper.unbind(0)
    count = step.clamp(min=1.0)  # a skipped first step leaves the count at 0: keep the bias finite
    keep = apply > 0
    decay = torch.where(keep, 1 - lr * weight_decay, 1.0)
    one_minus_beta1 = torch.where(keep, 1 - beta1, 0.0)
    beta2_now = torch.where(keep, beta2, 1.0)
    one_minus_beta2 = torch.where(keep, 1 - beta2, 0.0)
    step_size = torch.where(keep, lr / (1 - beta1 ** count), 0.0)
    bias2_sqrt = (1 - beta2 ** count).sqrt()
    for param, grad, master, exp_avg, exp_avg_sq in zip(params, grads, masters, exp_avgs, exp_avg_sqs):
        g = torch.where(keep, grad.float() / grad_scale, 0.0)
        master.mul_(decay)
        exp_avg.lerp_(g, one_minus_beta1)
        exp_avg_sq.mul_(beta2_now).add_(g * g * one_minus_beta2)
        denom = exp_avg_sq.sqrt() / bias2_sqrt + eps
        master.sub_(exp_avg / denom * step_size)
        param.copy_(master)


def step_unless(optimizer, skip: torch.Tensor) -> None:
    """The optimizer step, unless `skip` (a float32 0/1 tensor on the parameters' device) is 1;
    a skipped step leaves the weights and the optimizer state (moments, step counts) exactly as
    they were. MasterWeightAdamW and torch's fused AdamW decide inside their kernels (the
    `found_inf` input GradScaler uses), so the host never waits for the flag. torch's for-each
    AdamW has no such input: it reads the flag on the host, which costs nothing on the CPU, where
    it is used (`build_optimizer`). MuonAdamW takes the flag like the fused AdamW (muon.py)."""
    if divides_gradients(optimizer):
        optimizer.found_inf = skip
        optimizer.step()
    elif not bool(skip):
        optimizer.step()


def share_over_ranks(optimizer, num_drafters: int, dp_group=None) -> None:
    """With several drafter ranks a Muon optimizer orthogonalises only this rank's share of its
    matrices (`muon.Muon.spread`); other optimizers have nothing to share. Idempotent."""
    if isinstance(optimizer, MuonAdamW):
        optimizer.spread_over_ranks(num_drafters, dp_group)


def full_precision_weights(optimizer):
    """The parameters as a checkpoint must store them: the masters of a MasterWeightAdamW (or of a
    MuonAdamW's parts), else as is."""
    if hasattr(optimizer, "full_precision_weights"):
        return optimizer.full_precision_weights()
    return contextlib.nullcontext()
