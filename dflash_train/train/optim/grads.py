"""The step's gradients of bf16 parameters, summed in float32.

On CUDA the drafter's parameters are bf16 (the float32 masters live in the optimizer,
`optim.MasterWeightAdamW`, `muon.MuonAdamW`), so autograd would sum the gradients of k micro-batches
in bf16 (8 significant bits: every addition rounds the running sum to them, and a small addend
next to a large sum is lost), and DDP would reduce bf16 buckets across the drafter ranks. `Float32Grads` sums them as the masters are kept: after
each micro-batch's backward one for-each add moves every bf16 `.grad` into a float32 buffer (and
drops the bf16 one, so the next backward starts a fresh bf16 gradient instead of adding into it),
and after the last one a single float32 all-reduce of the flat buffer sums the drafter ranks (the
module is then not wrapped in DDP: `parallel.parallelize`). The optimizer reads the buffer.

Where there is nothing to sum (one micro-batch, one drafter rank: the paper-shape benchmark) no
buffer exists and the optimizer reads the bf16 `.grad` as before: no extra work at all. With it:
per micro-batch one read of the bf16 gradient and one read-write of the float32 sum (on an H200,
~10 bytes per parameter at ~4 TB/s), and the update reads 4 bytes of gradient instead of 2. The
all-reduce cannot overlap the backward (DDP's bucketed one did, in bf16): the compiled backward
hands all gradients over at its end anyway; at D > 1 it moves 4 bytes per parameter, once per step.
Nothing here waits for the device. The buffer carries nothing from one step to the next, so a
checkpoint needs none of it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Float32Grads:
    """Float32 sums of the `.grad`s of `params` over a step's micro-batches and the drafter ranks."""

    def __init__(self, params: list[torch.Tensor], num_drafters: int = 1, dp_group=None):
        self.params, self.num_drafters, self.dp_group = list(params), num_drafters, dp_group
        total = sum(p.numel() for p in self.params)
        self.flat = torch.zeros(total, dtype=torch.float32, device=self.params[0].device)  # one all-reduce
        self.views, offset = {}, 0
        for p in self.params:
            self.views[p] = self.flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        self.used: set = set()

    def add(self, first: bool) -> None:
        """After a micro-batch's backward: add every `.grad` into its float32 sum (`first`: the
        step's first micro-batch, which overwrites the sums) and drop it."""
        with_grad = [p for p in self.params if p.grad is not None]
        if first:
            self.used = set()
            idle = [self.views[p] for p in self.params if p.grad is None]
            if idle:  # a parameter without a gradient (yet) this step: its sum starts at zero
                torch._foreach_zero_(idle)
            if with_grad:
                torch._foreach_copy_([self.views[p] for p in with_grad], [p.grad for p in with_grad])
        elif with_grad:
            torch._foreach_add_([self.views[p] for p in with_grad], [p.grad for p in with_grad])
        for p in with_grad:
            self.used.add(p)
            p.grad = None

    def reduce(self) -> None:
        """Sum over the drafter ranks: one float32 all-reduce of the flat buffer (none for one rank)."""
        if self.num_drafters > 1:
            dist.all_reduce(self.flat, group=self.dp_group)

    def has(self, p: torch.Tensor) -> bool:
        """Whether `p` takes this step: it had a gradient here, or on any rank (several ranks: every
        parameter, so that all ranks step the same ones; DDP requires every parameter to be used)."""
        return p in self.views if self.num_drafters > 1 else p in self.used

    def grad(self, p: torch.Tensor) -> torch.Tensor:
        return self.views[p]

    def stepped(self) -> list[torch.Tensor]:
        return [p for p in self.params if self.has(p)]


def float32_grads(optimizer, micro_batches: int, num_drafters: int = 1, dp_group=None) -> Float32Grads | None:
    """The optimizer's float32 gradient sums, made on first need; None where the gradients are
    float32 anyway (float32 parameters: autograd and DDP sum in float32) or there is nothing to sum
    (one micro-batch, one drafter rank). Made once per run: the micro-batch count and the ranks do
    not change. With several ranks it first gives every rank rank 0's weights, as DDP does when it
    wraps a module (a one-time broadcast of the float32 masters)."""
    existing = getattr(optimizer, "float32_grads", None)
    if existing is not None or getattr(optimizer, "param_dtype", None) is None:
        return existing
    if micro_batches == 1 and num_drafters == 1:
        return None
    grads = Float32Grads(optimizer.module_params(), num_drafters, dp_group)
    optimizer.use_float32_grads(grads)
    if num_drafters > 1:
        _broadcast_masters(optimizer, dp_group)
    return grads


def _broadcast_masters(optimizer, dp_group) -> None:
    source = dist.get_global_rank(dp_group, 0) if dp_group is not None else 0
    with optimizer.full_precision_weights():  # the parameters are the float32 masters inside
        for p in optimizer.module_params():
            dist.broadcast(p.data, src=source, group=dp_group)
