"""A training-only restriction of the CE softmax to a subset of the vocabulary (`loss.train_vocab`).

On a CPU the drafter step is dominated by the frozen lm_head: every predicted slot costs a
[V, H] matmul forward and another for the gradient, and the drafter layers are cheap beside it.
The regenerated data of a small run uses few distinct tokens (SmolLM2 quickstart: ~3K of 49K),
so a softmax over every token the data contains, topped up with the lowest ids (special tokens
and the first BPE merges, the most frequent pieces), keeps nearly all the probability mass the
loss sees at a fraction of the cost. Tokens outside the subset are never pushed down, which is
the risk; it is measured by the held-out simulated tau, which always uses the full lm_head, as do
the real eval and inference. The checkpoint does not change.

The restriction is exact where it covers every token with non-negligible probability: the CE
over the subset equals the full CE (`tests/train/loss/test_loss.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VocabSubset:
    ids: torch.Tensor  # [V'] sorted token ids kept in the training softmax
    index: torch.Tensor  # [V] position of each token id in `ids`, -1 where absent (training device)
    host_index: torch.Tensor | None = None  # the same on the CPU, for the host-side loss normaliser

    def to(self, device) -> "VocabSubset":
        """On the training device once, so `map_labels` copies nothing per micro-batch (a [V]
        host-to-device copy each time, which on a GPU would also wait for the stream); a CPU copy
        stays for the loss normaliser, which is summed on the host."""
        return VocabSubset(self.ids.to(device), self.index.to(device), self.index.cpu())

    def restrict(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """The [V', H] rows of the lm_head that the training softmax runs over (a copy, contiguous)."""
        return lm_head_weight[self.ids.to(lm_head_weight.device)].contiguous()

    def map_labels(self, labels: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Labels as positions in the subset; a label outside it (never one of the training data's
        tokens) is dropped from the loss rather than mapped to a wrong token."""
        index = self.index
        if index.device != labels.device and self.host_index is not None and labels.device.type == "cpu":
            index = self.host_index
        mapped = index.to(labels.device)[labels]
        return mapped.clamp(min=0), valid & (mapped >= 0)


def vocab_subset(token_lists, vocab_size: int, size: int, multiple: int = 1) -> VocabSubset:
    """Every token in `token_lists`, then the lowest ids until `size` tokens (or more, when the data
    alone has more distinct tokens than `size`), rounded up to a multiple of `multiple` (16 in
    training: float8 matmuls of the restricted lm_head need it, train.fp8_lm_head)."""
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    for tokens in token_lists:
        seen[torch.as_tensor(list(tokens), dtype=torch.long)] = True
    wanted = min(vocab_size, -(-max(size, int(seen.sum())) // multiple) * multiple)
    fill = max(0, wanted - int(seen.sum()))
    if fill:
        free = torch.nonzero(~seen).flatten()[:fill]
        seen[free] = True
    ids = torch.nonzero(seen).flatten()
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[ids] = torch.arange(ids.numel())
    return VocabSubset(ids, index)
