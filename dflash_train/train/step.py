"""One optimizer step of the drafter over its micro-batches, and the forward it is made of.

The step's loss is normalised by the loss-weight sum of the *global* batch (all micro-batches of
all drafter ranks), which depends only on the data, so it is known before the forward: one small
all-reduce per step, no host sync inside the step. DDP averages gradients over D ranks, hence
the factor D in `scale`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dflash_train.data.anchors import block_inputs, block_labels, position_ids
from dflash_train.model.attention import MaskSpec, PersistentMasks, build_training_masks
from dflash_train.model.config import DrafterConfig
from dflash_train.model.scaling import scale_embeddings
from dflash_train.train.batching import MicroBatch, host_to_device, to_device
from dflash_train.train.loss import CE, LossMix, LossStats, block_loss, slot_weights, teacher_hidden_at
from dflash_train.train.optim import MasterWeightAdamW, step_unless
from dflash_train.train.vocab import VocabSubset


@dataclass(frozen=True)
class StepContext:
    """Everything the step needs that does not change between steps."""

    embed_weight: torch.Tensor  # the target's input embedding, frozen
    lm_head_weight: torch.Tensor  # the target's lm_head (== embed_weight when tied), frozen
    drafter: DrafterConfig  # block size, mask token, layer types, sliding window
    gamma: float
    chunk_tokens: int
    backend: str
    device: torch.device
    autocast_dtype: torch.dtype | None  # bf16 on GPU; None on CPU (fp32)
    dp_group: object = None  # drafter process group; None for one drafter
    num_drafters: int = 1
    compile_loss: bool = False  # fuse the lm_head/softmax passes with torch.compile (compiled runs)
    train_vocab: VocabSubset | None = None  # training-only softmax subset (loss.train_vocab)
    train_lm_head: torch.Tensor | None = None  # lm_head rows of train_vocab, [V', H]
    persistent_masks: PersistentMasks | None = None  # CUDA graphs (bench): masks kept at fixed addresses
    loss: LossMix = CE  # loss.kind as coefficients; teacher terms read batch["final_hidden"]
    loss_head_fp8: object = None  # fp8.Float8Head of the lm_head the loss uses (train.fp8_lm_head), or None

    @property
    def block_size(self) -> int:
        return self.drafter.block_size


def loss_weight_sum(mb: MicroBatch, ctx: StepContext) -> torch.Tensor:
    """Sum of w_k over the valid slots of a micro-batch (the loss denominator's share), counting
    only the slots the loss will see (with `loss.train_vocab`, labels inside the subset)."""
    labels, valid = block_labels(mb.input_ids, mb.loss_mask, mb.anchors, mb.keep, ctx.block_size)
    if ctx.train_vocab is not None:
        _, valid = ctx.train_vocab.map_labels(labels, valid)
    w = slot_weights(ctx.block_size, ctx.gamma, dtype=torch.float64)
    return (valid[:, :, 1:].double() * w).sum()


def drafter_hidden(model, batch: dict, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drafter's output hidden [b, N*B, H] for one micro-batch already on the device, with the
    block labels and valid slots [b, N, B] it is scored against (call inside `autocast(ctx)`)."""
    input_ids, anchors, keep, taps = batch["input_ids"], batch["anchors"], batch["keep"], batch["taps"]
    seq_len, num_anchors = input_ids.shape[1], anchors.shape[1]
    labels, valid = block_labels(input_ids, batch["loss_mask"], anchors, keep, ctx.block_size)
    dcfg = ctx.drafter
    block_embeds = scale_embeddings(F.embedding(block_inputs(input_ids, anchors, dcfg.block_size, dcfg.mask_token_id),
                                                ctx.embed_weight), dcfg.input_embedding_scale)  # [b, N*B, H]
    spec = MaskSpec(seq_len, dcfg.block_size, num_anchors, dcfg.sliding_window)
    masks = build_training_masks(spec, dcfg.layer_types, anchors, keep, ctx.backend,
                                 persistent=ctx.persistent_masks)
    hidden = model(block_embeds, taps, position_ids(seq_len, anchors, ctx.block_size), masks, ctx.backend)
    return hidden, labels, valid


def autocast(ctx: StepContext):
    """bf16 autocast on the GPU; nothing on the CPU (float32)."""
    return (torch.autocast(ctx.device.type, dtype=ctx.autocast_dtype) if ctx.autocast_dtype
            else contextlib.nullcontext())


def forward_stats(model, batch: dict, ctx: StepContext) -> LossStats:
    """Drafter forward + loss sums for one micro-batch already on the device."""
    with autocast(ctx):
        hidden, labels, valid = drafter_hidden(model, batch, ctx)
        lm_head = ctx.lm_head_weight
        if ctx.train_vocab is not None:
            labels, valid = ctx.train_vocab.map_labels(labels, valid)
            lm_head = ctx.train_lm_head
        teacher = teacher_hidden_at(batch["final_hidden"], batch["anchors"], ctx.block_size) \
            if ctx.loss.needs_teacher else None  # [b, N, B, H]
        return block_loss(hidden, lm_head, labels, valid, ctx.gamma, ctx.chunk_tokens, teacher_hidden=teacher,
                          compiled=ctx.compile_loss, mix=ctx.loss, fp8=ctx.loss_head_fp8)


def global_weight_sum(mbs: list[MicroBatch], ctx: StepContext) -> torch.Tensor:
    total = host_to_device(sum(loss_weight_sum(mb, ctx) for mb in mbs), ctx.device)
    if ctx.num_drafters > 1:
        dist.all_reduce(total, group=ctx.dp_group)
    return total


def train_step(model, optimizer, scheduler, mbs: list[MicroBatch], ctx: StepContext, grad_clip: float,
               apply: bool = True) -> tuple[LossStats, torch.Tensor, torch.Tensor]:
    """Forward/backward over the micro-batches (gradient accumulation), clip, optimizer step,
    guarded: a step whose loss or gradient norm is not finite is not applied (`step_unless`).

    Returns the summed LossStats of this rank, the pre-clip gradient norm and the step's
    `health_flags` (device tensors; nothing here waits for the device). `apply=False` skips the
    update on the host (the reference a test compares the guard with).
    """
    scale = ctx.num_drafters / global_weight_sum(mbs, ctx).clamp(min=1e-9)
    total, losses = None, []
    for i, mb in enumerate(mbs):
        last = i == len(mbs) - 1
        sync = model.no_sync() if hasattr(model, "no_sync") and not last else contextlib.nullcontext()
        with sync:
            stats = forward_stats(model, to_device(mb, ctx.device), ctx)
            (stats.loss_sum * scale.to(stats.loss_sum.dtype)).backward()
        losses.append(stats.loss_sum.detach().float().reshape(()))
        total = stats.detach() if total is None else total + stats.detach()
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = total_grad_norm(params)
    flags = health_flags(torch.stack(losses), grad_norm, ctx.num_drafters, ctx.dp_group)
    if apply:
        clip_and_step(optimizer, params, grad_clip, flags[0], grad_norm)
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()  # a skipped step still spends its step number: the lr stays a function of the step
    return total, grad_norm, flags


def health_flags(losses: torch.Tensor, grad_norm: torch.Tensor, num_drafters: int = 1, dp_group=None
                 ) -> torch.Tensor:
    """[1 + m] float32: [skip, bad micro-batch 0, ..., m-1]. A micro-batch is bad when its loss is
    not finite; the step is skipped when any drafter rank has a bad micro-batch or the (reduced,
    hence common) gradient norm is not finite. The MAX all-reduce makes every rank skip the same
    steps (a NaN loss on one rank usually reaches the others through DDP's gradients, but the
    weights must never diverge on a 'usually'); it is one more tiny collective, no host sync."""
    bad_mbs = (~torch.isfinite(losses)).float()
    skip = (~torch.isfinite(grad_norm)).float().reshape(1)
    if bad_mbs.numel():
        skip = torch.maximum(skip, bad_mbs.max())
    if num_drafters > 1:
        dist.all_reduce(skip, op=dist.ReduceOp.MAX, group=dp_group)
    return torch.cat([skip, bad_mbs])


def clip_and_step(optimizer, params: list, max_norm: float, skip: torch.Tensor | None = None,
                  norm: torch.Tensor | None = None) -> torch.Tensor:
    """Clip the gradients to a total norm of `max_norm` and take the optimizer step, unless
    `skip` (a 0/1 device tensor, `health_flags`) is 1; returns the pre-clip norm (a float32
    device tensor, no host sync; pass `norm` when already computed).

    A fused AdamW (and MasterWeightAdamW) applies the clip inside its kernel: it divides every
    gradient by `grad_scale` (the hook GradScaler uses), so `clip_grad_norm_`'s separate
    read-multiply-write pass over all gradients goes (2.3 ms at the paper's shapes; the AdamW
    kernel spends 1.5 ms of it back). Same arithmetic: g / ((norm + 1e-6) / max_norm) ==
    g * (max_norm / (norm + 1e-6)), both only when the norm exceeds max_norm. The norm is summed
    in float32 also over bf16 gradients.
    """
    norm = total_grad_norm(params) if norm is None else norm
    if optimizer.defaults.get("fused") or isinstance(optimizer, MasterWeightAdamW):
        optimizer.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0)
    else:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    step_unless(optimizer, skip if skip is not None else torch.zeros((), device=norm.device))
    return norm


def total_grad_norm(params: list) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in params], 2,
                                                                    dtype=torch.float32)))


def reduce_stats(stats: LossStats, ctx: StepContext) -> LossStats:
    """Sum LossStats over the drafter ranks in one flat all-reduce."""
    flat = stats.flat()
    if ctx.num_drafters > 1:
        dist.all_reduce(flat, group=ctx.dp_group)
    return LossStats.from_flat(flat, ctx.block_size)
