"""Record types shared by the data, training and evaluation layers.

They live at the bottom of the package (no import of anything above `data/`), so `data/` builds
them and `train/` and `eval/` consume them without either side importing the other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Conversation:
    """A list of `{"role", "content"}` messages: an optional system message first, then user and
    assistant alternating, starting with user; it may end with a user turn (a prompt)."""

    id: str
    messages: list[dict]


@dataclass
class TokenizedSample:
    """A conversation tokenized with the target's chat template, before the held-out split."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 on supervised (assistant) tokens


@dataclass(frozen=True)
class Sample:
    """A training or held-out sample as the sampler and batcher see it (immutable, hashable)."""

    id: str
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.input_ids)
