"""Muon for the drafter's hidden matrices, AdamW for the rest (`optim.name=muon`).

The split (`muon_split`, speculators' rule, `../shared/docs/dflash2-and-2026-recipe.md` section 4):
Muon takes every trainable 2-D parameter with min(dim) > 1 whose name contains none of
`MUON_EXCLUDED` nor a word a drafter head keeps out (`Head.outside_muon`: DFlash 2's codebooks,
DSpark's Markov head; the decoder's projections, `fc`, DFlash 2's `kernel_projection` and
`hidden_projection` go to Muon); AdamW takes norms, biases, other shapes (a 3-D `base_kernel`), the
heads' tables and anything named after the target's embedding or lm_head.

Muon is torch's own `torch.optim.Muon` (momentum 0.95 Nesterov, 5 Newton-Schulz steps in bf16,
torch's coefficients) with `adjust_lr_fn="match_rms_adamw"`: each matrix's step is scaled by
0.2 * sqrt(max(A, B)), which gives its update the RMS of an AdamW update, so one lr and one
schedule serve both parts. Its weight decay is decoupled, lr * muon_weight_decay per step.

On CUDA the module's parameters are bf16 (what the matmuls read) and the Muon part runs on
float32 masters, as `optim.MasterWeightAdamW` does for the AdamW part: the master's gradient is
the (float32-summed, `grads.Float32Grads`) gradient divided by the step's `grad_scale`, torch's
Muon updates the master and its float32 momentum, and the bf16 weight is the master rounded.

A skipped step (`found_inf` = 1) leaves every weight and all state, Muon's momentum included,
exactly as it was. The AdamW part decides on the device; torch's Muon has no found_inf input, so
its part reads the flag on the host: one host sync per step, only with Muon on a GPU (the step
then waits for the backward before launching Muon's Newton-Schulz matmuls, which dominate its
time anyway). On the CPU the sync is free.
"""

from __future__ import annotations

import contextlib
import inspect
import re

import torch

from dflash_train.model.architectures import outside_muon

MUON_EXCLUDED = ("embed_tokens", "lm_head")  # the target's tables, should they ever be trained


def muon_split(named_params) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """(Muon's, AdamW's) trainable (name, parameter) pairs, in module order (rule: module doc)."""
    excluded = MUON_EXCLUDED + outside_muon()  # what each registered head keeps out of Muon
    muon, adamw = [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        hidden_matrix = p.ndim == 2 and min(p.shape) > 1 and not any(word in name for word in excluded)
        (muon if hidden_matrix else adamw).append((name, p))
    return muon, adamw


def describe_split(muon: list, adamw: list) -> str:
    """One line per part: tensors, parameters, float32 bytes and the names (layer indices folded)."""
    def part(label: str, named: list) -> str:
        numel = sum(p.numel() for _, p in named)
        names = list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", name) for name, _ in named))
        size = f"{numel * 4 / 2**20:.1f} MiB" if numel * 4 >= 2**20 else f"{numel * 4 / 2**10:.1f} KiB"
        return (f"optim: {label} {len(named)} tensors, {numel:,} parameters ({size} in float32): "
                f"{', '.join(names) or '-'}")
    return part("Muon ", muon) + "\n" + part("AdamW", adamw)


def torch_muon(params: list[torch.Tensor], lr: float, weight_decay: float, momentum: float, ns_steps: int):
    """torch.optim.Muon with this recipe's settings, on any torch from 2.11 on: the keywords are
    those its signature has (2.11-2.14 share them; a release with `use_addmm` gets True, the
    addmm form the later releases always use)."""
    wanted = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=True, ns_steps=ns_steps,
                  adjust_lr_fn="match_rms_adamw", use_addmm=True)
    accepted = inspect.signature(torch.optim.Muon).parameters
    missing = [k for k in wanted if k not in accepted and k != "use_addmm"]
    if missing:
        raise RuntimeError(f"optim.name=muon: this torch {torch.__version__}'s torch.optim.Muon lacks {missing}")
    return torch.optim.Muon(params, **{k: v for k, v in wanted.items() if k in accepted})


class MuonAdamW(torch.optim.Optimizer):
    """torch's Muon over the hidden matrices (or their float32 masters) and an AdamW over the rest,
    as one optimizer: one LambdaLR scales both parts' lrs (`param_groups` are the parts' own
    groups), one state_dict, one step. The step divides every gradient by `grad_scale` and is
    skipped, exactly, when `found_inf` is 1 (both set by `step.clip_and_step` / `optim.step_unless`,
    as for the fused AdamW)."""

    def __init__(self, muon_params: list[torch.Tensor], adamw, *, lr: float, weight_decay: float, momentum: float,
                 ns_steps: int, master: bool):
        self.adamw = adamw  # MasterWeightAdamW (with `master`) or torch's AdamW, over the other parameters
        self.params = list(muon_params)  # the module's Muon parameters (bf16 with `master`)
        self.masters = [p.detach().float().clone() for p in self.params] if master else None
        self.muon = torch_muon(self.masters if master else self.params, lr, weight_decay, momentum, ns_steps)
        self.param_dtype = getattr(adamw, "param_dtype", None) if master else None
        self.grad_scale: torch.Tensor | None = None
        self.found_inf: torch.Tensor | None = None
        self.float32_grads = None  # grads.Float32Grads over every module parameter, when made
        super().__init__(self.muon.param_groups + adamw.param_groups, {})

    def module_params(self) -> list[torch.Tensor]:
        return self.params + [p for group in self.adamw.param_groups for p in group["params"]]

    def use_float32_grads(self, grads) -> None:
        self.float32_grads = grads
        self.adamw.use_float32_grads(grads)

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        f32 = self.float32_grads
        return (f32.grad(p) if f32.has(p) else None) if f32 is not None else p.grad

    @torch.no_grad()
    def step(self, closure=None):
        device = self.params[0].device if self.params else None
        scale = self.grad_scale if self.grad_scale is not None else torch.ones((), device=device)
        skip = self.found_inf if self.found_inf is not None else torch.zeros((), device=device)
        self._step_adamw(scale, skip)
        pairs = [(i, g) for i, p in enumerate(self.params) if (g := self._grad(p)) is not None]
        if not pairs:
            return
        if self.masters is not None:  # Muon reads the masters' float32 gradients
            grads = [g if g.dtype == torch.float32 else g.float() for _, g in pairs]
            for (i, _), g in zip(pairs, grads):
                self.masters[i].grad = g
        else:
            grads = [g for _, g in pairs]
        torch._foreach_div_(grads, scale)  # in place: a float32 sum or this step's own gradient
        if not bool(skip):  # the host sync of the module doc
            self.muon.step()
            if self.masters is not None:
                torch._foreach_copy_([self.params[i] for i, _ in pairs], [self.masters[i] for i, _ in pairs])
        if self.masters is not None:
            for i, _ in pairs:
                self.masters[i].grad = None

    def _step_adamw(self, scale: torch.Tensor, skip: torch.Tensor) -> None:
        part = self.adamw
        if hasattr(part, "found_inf") or part.defaults.get("fused"):  # decides on the device
            part.grad_scale, part.found_inf = scale, skip
            part.step()
            return
        grads = [p.grad for group in part.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, scale)
        if not bool(skip):
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none)
        self.muon.zero_grad(set_to_none)
        for p in self.params:  # with masters, the module's own Muon parameters are in no group
            p.grad = None

    def state_dict(self) -> dict:
        return {"optimizer": "muon", "muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("optimizer") != "muon":
            raise ValueError("optim.name=muon cannot resume this checkpoint: its optimizer state is AdamW's "
                             "(resume with the optim.name it was trained with)")
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = self.muon.param_groups + self.adamw.param_groups  # loading made new group dicts

    @contextlib.contextmanager
    def full_precision_weights(self):
        """Inside the block every parameter is its float32 master (see MasterWeightAdamW's)."""
        with contextlib.ExitStack() as stack:
            if hasattr(self.adamw, "full_precision_weights"):
                stack.enter_context(self.adamw.full_precision_weights())
            if self.masters is None:
                yield
                return
            low = [p.data for p in self.params]
            try:
                for p, master in zip(self.params, self.masters):
                    p.data = master
                yield
            finally:
                for p, data, master in zip(self.params, low, self.masters):
                    p.data = data
                    data.copy_(master)
