"""Running the HF target over prompts: left-padded batches, their positions, the KV cache."""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import DynamicCache


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows right-aligned into (ids, attention mask), each (b, W) long, W the longest row:
    every row's next token then sits in the same column, as batched generation needs."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


def mask_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids (b, S) that count only unmasked tokens, so a left-padded row gets the positions
    of the same row unpadded (pads get 0; they are masked out anyway)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@functools.lru_cache(maxsize=None)
def cache_kwarg(model_cls: type) -> str:
    """Name of the KV-cache argument: `cache` in newer transformers, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


def new_cache() -> DynamicCache:
    """A config-less DynamicCache: every layer a plain full layer, so `crop` works for any target
    (sliding-window layers are still masked by the model; only memory is not trimmed)."""
    return DynamicCache()
