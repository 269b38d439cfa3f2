"""One optimizer step of the drafter over its micro-batches, and the forward it is made of.

The step's loss is normalised by the loss-weight sum W of the *global* batch (all micro-batches of
all drafter ranks). The weights may depend on the forward (D-PACE weights come from the per-slot
cross-entropy), so W is known only after every forward: each micro-batch backpropagates its
unnormalised `loss_sum` (times D under DDP, which averages over the D ranks), and the summed
gradient is divided by W afterwards, inside the optimizer's update where it divides every gradient
anyway (`grad_scale` = W x the clip factor; the clip norm is that of the normalised gradient,
norm_raw / W). W and the ranks' non-finite flags travel in one small all-reduce per step; nothing
here waits for the device.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dflash_train.data.anchors import block_inputs, drafted_targets, position_ids
from dflash_train.model.drafter.attention import MaskSpec, PersistentMasks, build_training_masks
from dflash_train.model.drafter.config import DrafterConfig
from dflash_train.model.drafter.backbone import drafted_rows
from dflash_train.model.target.logits import LogitTransform
from dflash_train.model.target.scaling import scale_embeddings
from dflash_train.train.feed.batching import MicroBatch, to_device
from dflash_train.train.optim.grads import float32_grads
from dflash_train.train.loss.objective import CE, LossMix, LossStats, Objective, block_loss, teacher_hidden_at
from dflash_train.train.optim.optimizer import divides_gradients, share_over_ranks, step_unless
from dflash_train.train.watch.profile import profiled
from dflash_train.train.loss.softmax_rows import RowsSpec
from dflash_train.train.loss.vocab import VocabSubset


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
    persistent_masks: PersistentMasks | None = None  # CUDA graphs (train.compile_mode): masks at fixed addresses
    loss: LossMix = CE  # loss.kind as coefficients; teacher terms read batch["final_hidden"]
    loss_head_fp8: object = None  # fp8.Float8Head of the lm_head the loss uses (train.fp8_lm_head), or None
    head: object = None  # the (unwrapped) drafter: its head's drafted slots, logit bias and own loss term
    weighting: str = "decay"  # loss.weighting
    dpace_alpha: float = 0.5
    head_weight: float = 1.0  # loss.head_weight

    @property
    def graphs(self) -> bool:
        """The drafter's forward and backward replay as CUDA graphs (their masks are kept at fixed addresses)."""
        return self.persistent_masks is not None

    @property
    def block_size(self) -> int:
        return self.drafter.block_size

    @property
    def drafted(self) -> int:
        """Tokens a block drafts (the head's; B - 1 for DFlash)."""
        return self.head.drafted(self.block_size) if self.head is not None else self.block_size - 1

    @functools.cached_property
    def objective(self) -> Objective:
        """Built once per context: the compiled loss guards on it, so it must not be a new object per step."""
        topk = self.head.candidates_per_row if self.head is not None else 0
        spec = RowsSpec(self.loss, LogitTransform.of(self.drafter), topk)
        return Objective(spec, self.weighting, self.gamma, self.dpace_alpha, self.chunk_tokens, self.compile_loss,
                         self.head_weight)


def embed_tokens(ctx: StepContext, ids: torch.Tensor) -> torch.Tensor:
    """The target's input embeddings of token ids [...] -> [..., H], scaled as the target scales them."""
    return scale_embeddings(F.embedding(ids, ctx.embed_weight), ctx.drafter.input_embedding_scale)


def drafter_hidden(model, batch: dict, ctx: StepContext) -> torch.Tensor:
    """The drafter's output hidden [b, N*B, H] for one micro-batch already on the device (call inside
    `autocast(ctx)`)."""
    input_ids, anchors, keep, taps = batch["input_ids"], batch["anchors"], batch["keep"], batch["taps"]
    seq_len, num_anchors = input_ids.shape[1], anchors.shape[1]
    dcfg = ctx.drafter
    ids = block_inputs(input_ids, anchors, dcfg.block_size, dcfg.mask_token_id)  # [b, N*B]
    block_embeds = embed_tokens(ctx, ids)  # [b, N*B, H]
    spec = MaskSpec(seq_len, dcfg.block_size, num_anchors, dcfg.sliding_window, dcfg.window_causal)
    masks = build_training_masks(spec, dcfg.layer_types, anchors, keep, ctx.backend,
                                 persistent=ctx.persistent_masks)
    return model(block_embeds, taps, position_ids(seq_len, anchors, ctx.block_size), masks, ctx.backend)


def batch_targets(batch: dict, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """labels, valid and previous tokens [b, N, D] of the drafted tokens (`anchors.drafted_targets`)."""
    return drafted_targets(batch["input_ids"], batch["loss_mask"], batch["anchors"], batch["keep"], ctx.drafted)


def autocast(ctx: StepContext):
    """bf16 autocast on the GPU; nothing on the CPU (float32)."""
    return (torch.autocast(ctx.device.type, dtype=ctx.autocast_dtype) if ctx.autocast_dtype
            else contextlib.nullcontext())


def forward_stats(model, batch: dict, ctx: StepContext, progress: float = 1.0) -> LossStats:
    """Drafter forward + loss sums for one micro-batch already on the device; `progress` is the share of
    the training schedule done before this step (a head's own loss term may follow it; 1: none left)."""
    # with `train.profile_steps` the ranges split the step's host time (train/watch/profile.py)
    with autocast(ctx), profiled("forward"):
        with profiled("drafter_forward"):
            hidden = drafter_hidden(model, batch, ctx)
        labels, valid, prev = batch_targets(batch, ctx)
        rows = (ctx.head.drafted_rows(hidden, ctx.block_size) if ctx.head is not None
                else drafted_rows(hidden, ctx.block_size))  # [b, N, D, H]; no head given: DFlash's slots
        lm_head, vocab_ids = ctx.lm_head_weight, None
        if ctx.train_vocab is not None:
            labels, valid = ctx.train_vocab.map_labels(labels, valid)
            lm_head, vocab_ids = ctx.train_lm_head, ctx.train_vocab.ids
        teacher = teacher_hidden_at(batch["final_hidden"], batch["anchors"], ctx.drafted) \
            if ctx.loss.needs_teacher else None  # [b, N, D, H]
        return block_loss(rows, lm_head, labels, valid, ctx.objective, teacher, prev, ctx.head, ctx.loss_head_fp8,
                          vocab_ids, functools.partial(embed_tokens, ctx), progress)


def global_weight_sum(weight_sum: torch.Tensor, losses: torch.Tensor, ctx: StepContext
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, bad ranks): the loss-weight sum over the global batch (this rank's micro-batches'
    `LossStats.weight_sum`, summed over the drafter ranks) and the number of drafter ranks with a
    non-finite micro-batch loss (`losses` [m], this rank's): one all-reduce of two float32 numbers,
    no host sync."""
    local = torch.stack([weight_sum.detach().float().reshape(()),
                         (~torch.isfinite(losses)).any().float()])
    if ctx.num_drafters > 1:
        dist.all_reduce(local, group=ctx.dp_group)
    return local[0], local[1]


def train_step(model, optimizer, scheduler, mbs: list[MicroBatch], ctx: StepContext, grad_clip: float,
               apply: bool = True, progress: float = 1.0) -> tuple[LossStats, torch.Tensor, torch.Tensor]:
    """Forward/backward over the micro-batches (gradient accumulation), normalise, clip, optimizer
    step, guarded: a step whose loss or gradient norm is not finite is not applied (`step_unless`).
    `progress`: the share of the schedule done before this step (`forward_stats`).

    Returns the summed LossStats of this rank, the pre-clip norm of the normalised gradient and
    the step's `health_flags` (device tensors; nothing here waits for the device). `apply=False`
    skips the update on the host (the reference a test compares the guard with).
    """
    grads32 = float32_grads(optimizer, len(mbs), ctx.num_drafters, ctx.dp_group)  # None: the .grads as they are
    share_over_ranks(optimizer, ctx.num_drafters, ctx.dp_group)  # Muon: each rank its share of the matrices
    ddp = ctx.num_drafters > 1 and grads32 is None  # parallelize wrapped the model
    total, losses = None, []
    for i, mb in enumerate(mbs):
        last = i == len(mbs) - 1
        sync = model.no_sync() if ddp and not last else contextlib.nullcontext()
        with sync:
            if ctx.graphs:  # this forward's replay may reuse the last one's memory
                torch.compiler.cudagraph_mark_step_begin()
            stats = forward_stats(model, to_device(mb, ctx.device), ctx, progress)
            # DDP averages the ranks' gradients: x D makes it their sum
            with profiled("backward"):
                (stats.loss_sum * ctx.num_drafters if ddp else stats.loss_sum).backward()
        if grads32 is not None:
            grads32.add(first=i == 0)
        losses.append(stats.loss_sum.detach().float().reshape(()))
        total = stats.detach() if total is None else total + stats.detach()
    losses = torch.stack(losses)
    weight_sum, bad_ranks = global_weight_sum(total.weight_sum, losses, ctx)
    weight_sum = weight_sum.clamp(min=1e-9)
    if grads32 is not None:
        grads32.reduce()
        params = grads32.stepped()
        grads = [grads32.grad(p) for p in params]
    else:
        params = [p for p in model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
    grad_norm = total_grad_norm(grads) / weight_sum
    flags = health_flags(losses, grad_norm, bad_ranks)
    if apply:
        clip_and_step(optimizer, params, grad_clip, flags[0], grad_norm, weight_sum, grads)
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()  # a skipped step still spends its step number: the lr stays a function of the step
    return total, grad_norm, flags


def health_flags(losses: torch.Tensor, grad_norm: torch.Tensor, bad_ranks: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """[1 + m] float32: [skip, bad micro-batch 0, ..., m-1]. A micro-batch is bad when its loss is
    not finite; the step is skipped when any drafter rank has a bad micro-batch (`bad_ranks`, the
    count `global_weight_sum` reduced; this rank's own are counted without it) or the gradient
    norm (reduced, hence common) is not finite. All ranks thus skip the same steps (a NaN loss on
    one rank usually reaches the others through the gradient sum, but the weights must never
    diverge on a 'usually')."""
    bad_mbs = (~torch.isfinite(losses)).float()
    skip = (~torch.isfinite(grad_norm)).float().reshape(1)
    if bad_mbs.numel():
        skip = torch.maximum(skip, bad_mbs.max())
    if bad_ranks is not None:
        skip = torch.maximum(skip, (bad_ranks > 0).float().reshape(1))
    return torch.cat([skip, bad_mbs])


def clip_and_step(optimizer, params: list, max_norm: float, skip: torch.Tensor | None = None,
                  norm: torch.Tensor | None = None, weight_sum: torch.Tensor | None = None,
                  grads: list | None = None) -> torch.Tensor:
    """Normalise the gradients (divide by `weight_sum`, the loss normaliser; None: 1), clip them to
    a total norm of `max_norm` and take the optimizer step, unless `skip` (a 0/1 device tensor,
    `health_flags`) is 1; returns the pre-clip norm of the normalised gradient (a float32 device
    tensor, no host sync; pass `norm` when already computed). `grads` (default: the `.grad`s of
    `params`) are what the optimizer will read: float32 sums where `grads.Float32Grads` made them.

    Optimizers that divide every gradient by `grad_scale` (the hook GradScaler uses: torch's fused
    AdamW, MasterWeightAdamW, MuonAdamW) get the normaliser and the clip in it, so neither costs a
    pass over the gradients (`clip_grad_norm_`'s read-multiply-write pass was 2.3 ms at the paper's
    shapes; the AdamW kernel spends 1.5 ms of it back). Same arithmetic as clipping the normalised
    gradient: g / W / ((norm + 1e-6) / max_norm), only when the norm exceeds max_norm. Others (the
    for-each AdamW of the CPU) get one in-place multiply. The norm is summed in float32 also over
    bf16 gradients.
    """
    grads = [p.grad for p in params] if grads is None else grads
    weight_sum = torch.ones((), device=grads[0].device) if weight_sum is None else weight_sum
    norm = total_grad_norm(grads) / weight_sum if norm is None else norm
    if divides_gradients(optimizer):
        optimizer.grad_scale = weight_sum * ((norm + 1e-6) / max_norm).clamp(min=1.0)
    else:
        torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0) / weight_sum)
    step_unless(optimizer, skip if skip is not None else torch.zeros((), device=norm.device))
    return norm


def total_grad_norm(grads: list) -> torch.Tensor:
    """The 2-norm of all `grads` together, summed in float32."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))


def reduce_stats(stats: LossStats, ctx: StepContext) -> LossStats:
    """Sum LossStats over the drafter ranks in one flat all-reduce."""
    flat = stats.flat()
    if ctx.num_drafters > 1:
        dist.all_reduce(flat, group=ctx.dp_group)
    return LossStats.from_flat(flat, ctx.drafted)
