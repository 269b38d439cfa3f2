"""The doctor's target stage workload: load the target, time its tapped forward."""

from __future__ import annotations

import time
from typing import Callable

import torch

from dflash_train.model.target.taps import build_target_layer_ids

# (batch, sequence) per tapped forward: a quick smoke size, a CPU size, a training-like GPU size.
BATCHES = {"quick": (2, 128), "cpu": (4, 512), "cuda": (8, 3072)}


def _layer_ids(num_layers: int) -> list[int]:
    """The z-lab default taps; one middle layer for a target too shallow for them."""
    try:
        return build_target_layer_ids(num_layers, min(5, max(1, num_layers - 3)))
    except ValueError:
        return [num_layers // 2]


def target_throughput(load_target: Callable, model: str, device_name: str, quick: bool) -> dict:
    """tokens/s of `target.taps` on random ids, after one untimed warm-up forward."""
    device = torch.device(device_name)
    t0 = time.perf_counter()
    target = load_target(model, device=device)
    load_s = time.perf_counter() - t0
    layer_ids = _layer_ids(target.num_layers)
    batch, seq = BATCHES["quick" if quick else device.type if device.type == "cuda" else "cpu"]
    vocab = min(target.vocab_size, len(target.tokenizer)) if hasattr(target.tokenizer, "__len__") else target.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), device=device, generator=None)
    iters = 2 if quick else 5

    def forward() -> None:
        target.taps(ids, None, layer_ids)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    forward()
    t0 = time.perf_counter()
    for _ in range(iters):
        forward()
    seconds = (time.perf_counter() - t0) / iters
    return {"tokens_per_s": batch * seq / seconds, "batch": batch, "seq": seq, "layer_ids": layer_ids,
            "layers": target.num_layers, "hidden": target.hidden_size, "load_s": load_s}
