"""Simulated acceptance: what training's forward says speculative decoding would accept.

Two measures, both greedy, both from one drafter forward over a known text with the target's taps:
- per anchor (`simulated_tau`, training's held-out figure): the mean of 1 + accepted drafts over
  the anchors evaluated, each position weighted alike;
- the decode walk (`accepted_walk`, the train/serve check of the eval): start where decoding
  starts (the first output token, which the prefill produced) and jump as the decode loop does,
  from anchor a to a + accepted + 1. The decode loop visits the positions where drafts fail more
  often than the ones where they run long, so its tau is the token-weighted harmonic mean of the
  per-anchor figure, below it wherever acceptance is uneven (code: boilerplate, then logic). In
  float32 the walk reproduces the real loop's accepted counts (tests/train/watch/test_simulate.py).
A drafter with a confidence head (`acceptance_logits`) is also scored on the walk's text: its prediction for
every drafted slot against that slot's greedy acceptance (`eval/calibration.py`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from dflash_train.data.anchors import drafted_targets
from dflash_train.data.records import Sample
from dflash_train.eval.calibration import Calibration
from dflash_train.eval.spec_decode import DraftHead
from dflash_train.train import setup
from dflash_train.train.feed.batching import to_device
from dflash_train.train.loss.objective import summarize
from dflash_train.train.step import StepContext, autocast, drafter_hidden, embed_tokens, forward_stats
from dflash_train.train.feed.taps import target_tensors, taps_spec

ARGMAX_ROWS = 1024  # drafter rows scored against the full vocabulary at a time
SIM_BATCH_TOKENS = 4096
"""Padded text tokens a simulated-walk batch holds: one sequence at a time cost the eval 13-18 s of launches and
device reads for 144 prompts on an H200 (session 28); a batch this size stays small on a CPU."""


def eval_context(ctx: StepContext) -> StepContext:
    """The uncompiled drafter's path: SDPA, the eager loss, the full vocabulary (eval shapes differ
    from training shapes; no recompiles of the training graphs)."""
    return dataclasses.replace(ctx, backend="sdpa", num_drafters=1, compile_loss=False, train_vocab=None,
                               train_lm_head=None, persistent_masks=None, loss_head_fp8=None)


def simulated_tau(drafter, eval_mbs, ctx: StepContext) -> dict:
    """Greedy acceptance on held-out data at fixed anchors, averaged per anchor."""
    eval_ctx, total = eval_context(ctx), None
    drafter.eval()
    with torch.no_grad():
        for mb in eval_mbs:
            stats = forward_stats(drafter, to_device(mb, ctx.device), eval_ctx)
            total = stats if total is None else total + stats
    drafter.train()
    return summarize(total) if total is not None else {"sim_tau": float("nan"), "acc": []}


def anchor_acceptance(drafter, batch: dict, ctx: StepContext, head: DraftHead | None = None,
                      confidence: Calibration | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per anchor of a batch on the device: (draft tokens accepted greedily [b, N], whether the anchor
    has a supervised token after it [b, N]); accepted = leading drafted tokens whose greedy choice
    (the head's, `greedy`, given the data's previous tokens: on a leading run of accepted
    drafts those are the drafted ones) equals the label, over the full vocabulary or, as the decode
    loop drafts, over `head`'s draft vocabulary. `confidence` collects the drafter's acceptance logits against
    each slot's own greedy acceptance (given the data's tokens before it), when the drafter has them."""
    with autocast(ctx):
        hidden = drafter_hidden(drafter, batch, ctx)
    labels, valid, prev = drafted_targets(batch["input_ids"], batch["loss_mask"], batch["anchors"], batch["keep"],
                                          drafter.drafted(ctx.block_size))
    b, n, drafted = labels.shape
    rows = drafter.drafted_rows(hidden, ctx.block_size).reshape(b * n, drafted, -1)  # [b*N, D, H]
    head = head or DraftHead.of(ctx.lm_head_weight, scaling=ctx.drafter.scaling)
    blocks = max(1, ARGMAX_ROWS // drafted)  # whole blocks at a time: a head's bias may run along its block
    embed = functools.partial(embed_tokens, ctx)
    pred = torch.cat([drafter.greedy(r, p, head, embed).to(labels.device)
                      for r, p in zip(rows.split(blocks), prev.reshape(b * n, drafted).split(blocks))])
    correct = (pred.view(b, n, drafted) == labels) & valid  # [b, N, D]
    accepted = correct.int().cumprod(-1).sum(-1)  # [b, N]
    logits = drafter.acceptance_logits(rows.reshape(-1, rows.shape[-1]), prev.reshape(-1)) \
        if confidence is not None else None  # [b*N*D]
    if logits is not None:
        confidence.add(logits.view(b, n, drafted), correct, valid)
    return accepted, valid[:, :, 0]


def accepted_walk(anchors: list[int], accepted: list[int], start: int) -> list[int]:
    """The decode loop's accepted counts on this text: from anchor `start`, each step accepts
    accepted[a] drafts and emits them plus the target's token, so the next anchor is a + acc + 1."""
    at = dict(zip(anchors, accepted))
    walk, pos = [], start
    while pos in at:
        walk.append(at[pos])
        pos += at[pos] + 1
    return walk


def _groups(items: list[tuple[int, list[int], list[int]]], budget: int) -> list[list]:
    """Consecutive (index, prompt, output) items in groups whose padded length x count stays within `budget`
    tokens (a longer item alone)."""
    groups, group, longest = [], [], 0
    for item in items:
        length = len(item[1]) + len(item[2])
        if group and max(longest, length) * (len(group) + 1) > budget:
            groups.append(group)
            group, longest = [], 0
        group.append(item)
        longest = max(longest, length)
    return groups + ([group] if group else [])


def simulated_walks(drafter, target, ctx: StepContext, sequences: list[tuple[list[int], list[int]]],
                    draft_vocab: torch.Tensor | None = None, confidence: Calibration | None = None
                    ) -> tuple[list[list[int]], float]:
    """For (prompt ids, output ids) pairs: the decode walk of each (accepted counts per step), and the
    per-anchor tau over every eligible anchor of all of them. Taps come from the target's forward
    over the whole text, stopped after the last tapped layer (acceptance compares argmaxes with the
    text: no final hidden state is needed). `draft_vocab`: the ids the decode loop drafts over; `confidence`:
    see `anchor_acceptance`."""
    spec = taps_spec(drafter.config, target.dtype)
    eval_ctx, layer_ids = eval_context(ctx), list(drafter.config.target_layer_ids)
    walks, anchor_sum, anchor_count = [[] for _ in sequences], 0, 0
    head = DraftHead.of(ctx.lm_head_weight, draft_vocab, ctx.drafter.scaling)  # once: the subset's rows are a copy
    usable = [(i, prompt, out) for i, (prompt, out) in enumerate(sequences) if len(out) >= 2]
    was_training = drafter.training
    drafter.eval()
    with torch.no_grad():
        for group in _groups(usable, SIM_BATCH_TOKENS):
            samples = [Sample(f"sim{i}", tuple(prompt + out), (0,) * len(prompt) + (1,) * len(out))
                       for i, prompt, out in group]
            # every eligible anchor: they lie in the outputs, at most len(out) - 1 of them a row
            most = max(len(out) for _, _, out in group)
            (mb,) = setup.eval_batches(samples, num_anchors=most, pad_multiple=1, max_len=max(map(len, samples)),
                                       max_samples=len(samples), per_batch=len(samples))  # the group: one batch
            mb.from_target = target_tensors(target, layer_ids, mb, ctx.device, spec)
            accepted, has_label = anchor_acceptance(drafter, to_device(mb, ctx.device), eval_ctx, head, confidence)
            accepted, has_label = accepted.cpu(), has_label.cpu()  # [b, N] each: one device read a group
            for row, (i, prompt, _) in enumerate(group):
                kept = has_label[row]  # `valid` already holds `keep`
                counts = accepted[row][kept].tolist()
                walks[i] = accepted_walk(mb.anchors[row][kept].tolist(), counts, start=len(prompt))
                anchor_sum, anchor_count = anchor_sum + sum(counts), anchor_count + len(counts)
    drafter.train(was_training)
    return walks, (1 + anchor_sum / anchor_count) if anchor_count else float("nan")


def simulator(drafter, target, ctx: StepContext, draft_vocab: torch.Tensor | None = None):
    """The eval's train/serve check: `simulate(pairs)` -> {"sim_tau": the decode walk's tau on that
    text, "sim_tau_anchors": the per-anchor figure training reports, and for a drafter with a confidence head
    "confidence": its calibration on that text (`calibration.Calibration.summary`)}, drafting over
    `draft_vocab` where the eval does."""

    def simulate(sequences: list[tuple[list[int], list[int]]]) -> dict:
        confidence = Calibration()
        walks, per_anchor = simulated_walks(drafter, target, ctx, sequences, draft_vocab, confidence)
        steps = [a for walk in walks for a in walk]
        walk_tau = sum(a + 1 for a in steps) / len(steps) if steps else float("nan")
        calibration = confidence.summary()
        return {"sim_tau": walk_tau, "sim_tau_anchors": per_anchor,
                **({"confidence": calibration} if calibration else {})}

    return simulate
