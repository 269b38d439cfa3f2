"""DFlash attention: the training mask, its dense twin, the flex BlockMask, and the kernels.

Training layout (one row b of the batch; S context positions, N anchors, block size B):
  queries  q in [0, N*B)        block j = q // B, slot o = q % B, anchor a = anchors[b, j]
  keys     kv in [0, S)         context feature of position kv (the target's taps)
           kv in [S, S + N*B)   block token (kv - S): block (kv - S) // B, slot (kv - S) % B

Mask rules (a query may attend a key iff all that apply hold):
  1. Context is visible strictly before the anchor: kv < a. The anchor's own target hidden state
     is never available when drafting (the anchor is the token just verified), so training must
     not see it either.
  2. A block sees its own block and no other: (kv - S) // B == j.
  3. Layers are bidirectional inside the block (every slot sees every slot), unless causal:
     causal sliding-window layers (`MaskSpec.causal`, z-lab's older drafters) see (kv - S) % B <= o.
  4. Sliding-window layers see context only inside the window around the query's position
     a + o: kv >= a + o - (W - 1), i.e. |q_pos - k_pos| < W (the per-row origin of SpecForge and
     z-lab, not speculators' anchor - W). Inside the block |o - o'| < B <= W, so a non-causal
     window (the 2026 drafters: `is_causal: false`) never hides a block key.
  5. A padded block (keep[b, j] False) sees only its own block, never context. Its slots carry no
     loss and no other query can see them, so this cannot change any result; it keeps every
     query row non-empty, which avoids NaN rows in SDPA and in the dense reference.

Inference (spec 1.6): the B block queries see every cached context position and their own block;
rules 3 and 4 apply unchanged to sliding-window layers, with the context cache in place of kv < a.
With S <= W (every recipe on SmolLM2, max_len 320) a non-causal window changes nothing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

FULL = "full_attention"
SLIDING = "sliding_attention"
BACKENDS = ("flex", "sdpa", "dense")


@dataclass(frozen=True)
class MaskSpec:
    """What a mask depends on besides the anchors: the static layout of one training row."""

    context_len: int  # S
    block_size: int  # B
    num_anchors: int  # N
    sliding_window: int | None = None  # W for sliding_attention layers; None = full attention
    causal: bool = False  # causal inside the block (rule 3)

    @property
    def q_len(self) -> int:
        return self.num_anchors * self.block_size

    @property
    def kv_len(self) -> int:
        return self.context_len + self.q_len


class PersistentMasks:
    """Masks at fixed addresses, for CUDA graphs (train.compile_mode=reduce-overhead, bench/drafter_step.py
    --compile-mode reduce-overhead): a graph replays fixed addresses, and both the BlockMask's tile tensors and
    the tensors its mask_mod captures (each query's key intervals) are taken as static inputs, so
    new tensors each step force a re-recording (0.175 s/step, PERF.md 3.2). Passed to
    `build_training_masks`, it copies each step's values into the tensors of the first step of the
    same shape and returns those instead."""

    TILE_TENSORS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                    "q_indices", "full_q_num_blocks", "full_q_indices")

    def __init__(self):
        self.kept: dict = {}

    def intervals(self, fresh: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        buffers = self.kept.setdefault(tuple(t.shape for t in fresh), tuple(torch.empty_like(t) for t in fresh))
        for buffer, t in zip(buffers, fresh):
            buffer.copy_(t)
        return buffers

    def block_mask(self, fresh):
        first = self.kept.setdefault(("mask", fresh.shape), fresh)
        for name in self.TILE_TENSORS:
            if first is not fresh and getattr(fresh, name, None) is not None:
                getattr(first, name).copy_(getattr(fresh, name))
        return first


def mask_rule(spec: MaskSpec, anchors: torch.Tensor, keep: torch.Tensor, b, q, kv) -> torch.Tensor:
    """The rules of the module docstring as tensor ops on index tensors b, q, kv.

    Works elementwise for flex's `mask_mod(b, h, q, kv)` (scalar index tensors) and for the dense
    grid by broadcasting (b [n,1,1], q [1,Q,1], kv [1,1,KV]). anchors/keep: [batch, N].
    """
    S, B = spec.context_len, spec.block_size
    block = (q // B).clamp(max=spec.num_anchors - 1)  # flex may probe padded q past N*B
    slot = q % B
    anchor = anchors[b, block]
    kept = keep[b, block]
    is_ctx = kv < S
    # 0 for context keys keeps the index math valid. torch.where, not (kv - S).clamp(min=0): inductor
    # fails to compile `clamp(kv - S, min=0) // B` in create_block_mask ("vr must not be None", 2.13).
    blk_index = torch.where(is_ctx, 0, kv - S)
    same_block = (~is_ctx) & (blk_index // B == block)
    ctx_ok = is_ctx & (kv < anchor) & kept
    if spec.causal:
        same_block = same_block & (blk_index % B <= slot)
    if spec.sliding_window is not None:
        ctx_ok = ctx_ok & (kv >= anchor + slot - (spec.sliding_window - 1))
    return ctx_ok | same_block


def dense_mask(spec: MaskSpec, anchors: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Boolean mask [batch, 1, N*B, S+N*B] (True = attend), the reference and the SDPA input."""
    device = anchors.device
    b = torch.arange(anchors.shape[0], device=device)[:, None, None]
    q = torch.arange(spec.q_len, device=device)[None, :, None]
    kv = torch.arange(spec.kv_len, device=device)[None, None, :]
    return mask_rule(spec, anchors, keep, b, q, kv)[:, None]  # [b, 1, Q, KV]


@functools.lru_cache(maxsize=None)
def _compiled_create_block_mask():
    return torch.compile(create_block_mask)


def flex_block_mask(spec: MaskSpec, anchors: torch.Tensor, keep: torch.Tensor, compiled: bool = True,
                    analytic: bool = True, persistent: PersistentMasks | None = None):
    """flex_attention BlockMask for the rules above, head-independent (H=None).

    Built by `analytic_block_mask` (exact tile classes from the anchors, no compile) unless
    `analytic=False`: then `create_block_mask` evaluates `mask_rule`; `compiled=True` compiles it,
    which never materialises the dense Q x KV grid (the uncompiled builder does: 7 GB at
    24K x 28K, speculators #731) but costs ~2.5 min of cold compile on an H200.
    """
    if analytic:
        return analytic_block_mask(spec, anchors, keep, persistent=persistent)
    def mask_mod(b, h, q, kv):
        return mask_rule(spec, anchors, keep, b, q, kv)

    build = _compiled_create_block_mask() if compiled else create_block_mask
    return build(mask_mod, B=anchors.shape[0], H=None, Q_LEN=spec.q_len, KV_LEN=spec.kv_len,
                 device=anchors.device)


def _query_intervals(spec: MaskSpec, anchors: torch.Tensor, keep: torch.Tensor, rows: int
                     ) -> tuple[torch.Tensor, ...]:
    """Query q of block j, slot o sees two key intervals: context [ctx_lo, ctx_hi) with ctx_hi = a_j
    when kept, else 0 (rules 1, 5), and ctx_lo = a_j + o - (W - 1) under a window (rule 4), else 0;
    and its own block [own_lo, own_hi) with own_lo = S + j*B, own_hi = own_lo + B, or own_lo + o + 1
    when causal (rules 2, 3). Returns ctx_lo, ctx_hi [batch, rows] and own_lo, own_hi [rows] (int32)
    for the first `rows` queries; like mask_rule, rows past N*B (a tile's padding) count as the
    last block."""
    S, B = spec.context_len, spec.block_size
    q = torch.arange(rows, device=anchors.device)
    block = (q // B).clamp(max=spec.num_anchors - 1)  # [rows]
    slot = q % B
    ctx_hi = torch.where(keep, anchors.clamp(max=S), 0)[:, block]  # [b, rows]
    ctx_lo = torch.zeros_like(ctx_hi)
    if spec.sliding_window is not None:
        ctx_lo = (anchors[:, block] + slot - (spec.sliding_window - 1)).clamp(min=0).minimum(ctx_hi)
    own_lo = S + block * B
    own_hi = own_lo + (slot + 1 if spec.causal else B)
    return tuple(t.to(torch.int32) for t in (ctx_lo, ctx_hi, own_lo, own_hi))


def _visible_per_tile(spec: MaskSpec, intervals: tuple[torch.Tensor, ...], tile: int) -> torch.Tensor:
    """Visible (query, key) pairs per (query tile, key tile): [batch, Q tiles, KV tiles], the
    overlap of each query's two intervals (`_query_intervals`, padded to whole query tiles) with
    each key tile. [batch, Q, KV tiles] stays small (0.7M entries at the paper's shapes against
    92M for the dense grid). Keys past the end count as invisible, as in create_block_mask."""
    ctx_lo, ctx_hi, own_lo, own_hi = intervals
    q_tiles, kv_tiles = ctx_hi.shape[1] // tile, -(-spec.kv_len // tile)
    tile_lo = torch.arange(kv_tiles, device=ctx_hi.device) * tile
    tile_hi = (tile_lo + tile).clamp(max=spec.kv_len)  # [T]

    def overlap(lo, hi):  # [b|1, Qp] intervals against every tile -> [b|1, Qp, T]
        return (torch.minimum(hi[..., None], tile_hi) - torch.maximum(lo[..., None], tile_lo)).clamp(min=0)

    count = overlap(ctx_lo, ctx_hi) + overlap(own_lo[None], own_hi[None])
    return count.view(count.shape[0], q_tiles, tile, kv_tiles).sum(2)  # [b, Q tiles, T]


def analytic_block_mask(spec: MaskSpec, anchors: torch.Tensor, keep: torch.Tensor, tile: int = 128,
                        persistent: PersistentMasks | None = None):
    """The BlockMask straight from the anchors: a tile is full when every (query, key) pair in it
    is visible, partial when some are (mask_mod decides per element), skipped otherwise. Same
    tiles as `create_block_mask` (tests), with no compile and no dense grid, for every layer type
    (full, windowed, causal).

    Its mask_mod tests the two key intervals of `_query_intervals` (gathers and compares)
    instead of `mask_rule`: equal on every element (tests), 3 % faster fwd+bwd in the triton
    kernel, and free of the ops (clamp) that flex's CuteDSL backend cannot lower."""
    intervals = _query_intervals(spec, anchors, keep, -(-spec.q_len // tile) * tile)
    if persistent is not None:
        intervals = persistent.intervals(intervals)
    count = _visible_per_tile(spec, intervals, tile)  # [b, Qt, T]
    full = count == tile * tile
    partial = (count > 0) & ~full

    def listed(selected: torch.Tensor):  # [b, Qt, T] -> counts [b, 1, Qt], indices [b, 1, Qt, T]
        order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True)  # selected tiles first
        return selected.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    ctx_lo, ctx_hi, own_lo, own_hi = intervals

    def mask_mod(b, h, q, kv):
        return ((kv >= ctx_lo[b, q]) & (kv < ctx_hi[b, q])) | ((kv >= own_lo[q]) & (kv < own_hi[q]))

    kv_num, kv_idx = listed(partial)
    full_num, full_idx = listed(full)
    mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=mask_mod,
                                    seq_lengths=(spec.q_len, spec.kv_len))
    return persistent.block_mask(mask) if persistent is not None else mask


def build_training_masks(spec: MaskSpec, layer_types: tuple[str, ...], anchors: torch.Tensor,
                         keep: torch.Tensor, backend: str, compiled_builder: bool = True,
                         persistent: PersistentMasks | None = None) -> dict:
    """One mask per layer type in use: {"full_attention": m, "sliding_attention": m}; `spec`'s
    window and causality describe the sliding layers (full layers: no window, bidirectional)."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}: expected one of {BACKENDS}")
    masks = {}
    for layer_type in sorted(set(layer_types)):
        sliding = layer_type == SLIDING
        typed = MaskSpec(spec.context_len, spec.block_size, spec.num_anchors,
                         spec.sliding_window if sliding else None, spec.causal and sliding)
        if backend == "flex":
            masks[layer_type] = flex_block_mask(typed, anchors, keep, compiled=compiled_builder, persistent=persistent)
        else:
            masks[layer_type] = dense_mask(typed, anchors, keep)
    return masks


def inference_mask(context_len: int, block_size: int, sliding_window: int | None, device: torch.device,
                   causal: bool = False) -> torch.Tensor | None:
    """Mask [1, 1, B, ctx+B] for one drafted block after `context_len` cached positions (rules 3, 4).

    Full attention needs none (every cached position and the whole block are visible). The block's
    first slot sits at position `context_len` (the anchor), so slot o is at context_len + o.
    """
    if sliding_window is None and not causal:
        return None
    q = torch.arange(block_size, device=device)[:, None]
    kv = torch.arange(context_len + block_size, device=device)[None, :]
    pos_q = context_len + q
    visible = torch.ones(block_size, context_len + block_size, dtype=torch.bool, device=device)
    if causal:
        visible &= kv <= pos_q
    if sliding_window is not None:
        visible &= kv >= pos_q - (sliding_window - 1)
    return visible[None, None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, backend: str) -> torch.Tensor:
    """Scaled dot-product attention with GQA. q [b, Hq, Lq, d]; k, v [b, Hkv, Lk, d].

    mask: a BlockMask (flex), a boolean [b|1, 1, Lq, Lk] (sdpa, dense), or None (no mask).
    """
    if backend == "flex":
        # K/V repeated to the query heads instead of enable_gqa: flex's GQA backward walks the
        # group's query heads inside each dK/dV program; repeated, fwd+bwd at the paper's shapes
        # (32/8 heads) took 3.10 instead of 3.43 ms per layer (bench/flex_tune.py --expanded-kv)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [b, Hq, Lk, d]
        return flex_attention(q, k, v, block_mask=mask)
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    if backend == "dense":
        return dense_attention(q, k, v, mask)
    raise ValueError(f"attention backend {backend!r}: expected one of {BACKENDS}")


def dense_attention(q, k, v, mask) -> torch.Tensor:
    """Reference attention in float32 with an explicit softmax; the slow, obviously-right path."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).float()  # [b, Hq, Lk, d]
    v = v.repeat_interleave(groups, dim=1).float()
    scores = q.float() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # [b, Hq, Lq, Lk]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v).to(q.dtype)
