"""Anchors and the block tensors built from them (spec 2.2, 2.3).

An anchor is a position a whose clean token starts a training block; the block predicts tokens
a+1 .. a+B-1. Eligible anchors: loss_mask[a] and loss_mask[a+1] (the anchor and its first target
are both supervised). Per sequence, min(N, eligible) anchors are drawn without replacement,
uniformly, sorted, and padded to exactly N with `keep=False` so every step has static shapes.
They are redrawn every epoch from a generator seeded by (seed, epoch, sample id), so the draw of a
sample does not depend on which rank or batch it lands in.
"""

from __future__ import annotations

import hashlib

import torch


def anchor_generator(seed: int, epoch: int, sample_id: str | int) -> torch.Generator:
    """A CPU generator that depends only on (seed, epoch, sample id)."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{sample_id}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def eligible_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions t < S-1 with loss_mask[t] and loss_mask[t+1]; loss_mask [S] -> indices [n]."""
    mask = loss_mask.bool()
    return torch.nonzero(mask[:-1] & mask[1:]).flatten()


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted anchors [N] (int64) and keep [N] (bool) for one sequence; padding is anchor 0."""
    return draw_anchors(eligible_anchors(loss_mask.cpu()), num_anchors, generator)


def draw_anchors(candidates: torch.Tensor, num_anchors: int, generator: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_anchors` from a sequence's eligible positions [n] (sorted, int64) already found."""
    count = min(num_anchors, candidates.numel())
    chosen = candidates[torch.randperm(candidates.numel(), generator=generator)[:count]].sort().values
    anchors = torch.zeros(num_anchors, dtype=torch.long)
    keep = torch.zeros(num_anchors, dtype=torch.bool)
    anchors[:count] = chosen
    keep[:count] = True
    return anchors, keep


def all_anchors(loss_mask: torch.Tensor, num_anchors: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic anchors for evaluation: every eligible position, evenly thinned to N."""
    candidates = eligible_anchors(loss_mask.cpu())
    if candidates.numel() > num_anchors:
        pick = torch.linspace(0, candidates.numel() - 1, num_anchors).round().long()
        candidates = candidates[pick]
    anchors = torch.zeros(num_anchors, dtype=torch.long)
    keep = torch.zeros(num_anchors, dtype=torch.bool)
    anchors[: candidates.numel()] = candidates
    keep[: candidates.numel()] = True
    return anchors, keep


def block_inputs(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
                 ) -> torch.Tensor:
    """Block token ids [b, N*B]: the anchor's token then B-1 mask tokens per block.

    input_ids [b, S], anchors [b, N].
    """
    b, n = anchors.shape
    ids = torch.full((b, n, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, :, 0] = torch.gather(input_ids, 1, anchors)  # [b, N]
    return ids.view(b, n * block_size)  # [b, N*B]


def position_ids(seq_len: int, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[b, S + N*B]: context positions 0..S-1, then anchor + 0..B-1 for each block (spec 1.7)."""
    b, n = anchors.shape
    ctx = torch.arange(seq_len, device=anchors.device).expand(b, seq_len)  # [b, S]
    blocks = anchors[:, :, None] + torch.arange(block_size, device=anchors.device)  # [b, N, B]
    return torch.cat([ctx, blocks.reshape(b, n * block_size)], dim=1)


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [b, N, B] = input_ids[a + k], and valid [b, N, B].

    valid[j, k] needs: k >= 1 (slot 0 is the anchor, not predicted), the block kept, a + k < S, and
    loss_mask[a + k] (only supervised tokens are targets).
    """
    b, seq_len = input_ids.shape
    offsets = torch.arange(block_size, device=anchors.device)
    target_pos = anchors[:, :, None] + offsets  # [b, N, B]
    in_range = target_pos < seq_len
    flat = target_pos.clamp(max=seq_len - 1).view(b, -1)  # [b, N*B]
    labels = torch.gather(input_ids, 1, flat).view_as(target_pos)
    supervised = torch.gather(loss_mask.bool(), 1, flat).view_as(target_pos)
    valid = in_range & supervised & keep[:, :, None] & (offsets > 0)
    return labels, valid


def drafted_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor,
                    drafted: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What each block drafts: labels [b, N, D] = input_ids[a + 1 + i], valid [b, N, D] (kept block,
    in range, supervised), and prev [b, N, D] = input_ids[a + i], the token before each label (the
    anchor for i = 0), which heads that condition on the previous token are teacher-forced with."""
    labels, valid = block_labels(input_ids, loss_mask, anchors, keep, drafted + 1)  # [b, N, D + 1]
    return labels[:, :, 1:], valid[:, :, 1:], labels[:, :, :-1]


def anchor_coverage(loss_masks, num_anchors: int) -> dict:
    """Anchors a step draws per document against its supervised tokens (published pitfall 2,
    speculators #1071: anchors drawn per packed row starve short documents). Here every sequence
    is one document and draws min(N, eligible) anchors (`sample_anchors`), so a document with at
    most N eligible positions is anchored at every one of them. Returns the per-document ratio
    anchors / supervised tokens (median, min), the documents capped at N, and those starved (an
    eligible position but no anchor: 0 by construction, reported so a change would show)."""
    ratios, capped, starved = [], 0, 0
    for mask in loss_masks:
        mask = torch.as_tensor(mask)
        supervised, eligible = int(mask.sum()), int(eligible_anchors(mask).numel())
        drawn = min(num_anchors, eligible)
        capped += eligible > num_anchors
        starved += eligible > 0 and drawn == 0
        if supervised:
            ratios.append(drawn / supervised)
    ratios.sort()
    return {"documents": len(ratios), "median": ratios[len(ratios) // 2] if ratios else 0.0,
            "min": ratios[0] if ratios else 0.0, "capped": capped, "starved": starved}
