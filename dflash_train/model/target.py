"""The frozen target: loading, and taps of its hidden states.

Tap ids use z-lab semantics: id i is the output of decoder layer i, which is HF
`output_hidden_states[i + 1]` (index 0 is the embedding output). vLLM's aux ids are these + 1.
"""

from __future__ import annotations


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
