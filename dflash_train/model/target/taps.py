"""Tap layer ids and their indexing, for every route that taps the target.

Ids use z-lab semantics: id i is the output of decoder layer i, which is HF
`output_hidden_states[i + 1]` (index 0 is the embedding output); vLLM's aux ids are these + 1.
HF's last entry, `hidden_states[L]`, is taken after the final norm, so a tap of id L-1 is normed
too (the z-lab defaults stop at L-3 and never hit that case).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch


def build_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """z-lab default taps: `num_taps` ids spread uniformly over [1, L-3] (a single tap: L // 2).

    Identical to `build_target_layer_ids` in z-lab, SpecForge and SGLang; for Qwen3-8B (36 layers,
    5 taps) it gives [1, 9, 17, 25, 33].
    """
    if num_taps < 1:
        raise ValueError(f"num_taps must be >= 1, got {num_taps}")
    if num_taps == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(f"target has {num_target_layers} layers: too few for {num_taps} taps in [1, L-3]")
    return [round(start + i * (end - start) / (num_taps - 1)) for i in range(num_taps)]


def check_layer_ids(layer_ids: Iterable[int], num_layers: int) -> list[int]:
    """The ids as ints; an error unless they are non-empty and each names a decoder layer."""
    ids = [int(i) for i in layer_ids]
    if not ids or any(not 0 <= i < num_layers for i in ids):
        raise ValueError(f"tap layer ids {ids}: must be non-empty, in [0, {num_layers})")
    return ids


def hidden_state_index(layer_id: int) -> int:
    """Index in HF `hidden_states` of decoder layer `layer_id`'s output."""
    return layer_id + 1


def select_taps(hidden_states: Sequence[torch.Tensor] | Mapping[int, torch.Tensor],
                layer_ids: Iterable[int]) -> torch.Tensor:
    """Taps of `layer_ids`, concatenated in that order: (..., S, K*H).

    `hidden_states` is HF's `output_hidden_states` tuple, or a mapping holding the same entries
    under the same indices (a hooked forward that records only the tapped layers)."""
    return torch.cat([hidden_states[hidden_state_index(i)] for i in layer_ids], dim=-1)
