"""DSpark (arXiv 2607.05147): the DFlash backbone drafting from the anchor's slot too, with a Markov
logit bias on the previous token and a confidence head.

Layout (`sample_from_anchor`): the block is still [anchor, MASK x (B-1)], but slot s drafts token
anchor + s + 1, so a block drafts B tokens (DFlash: B - 1). Slot s's logits are
    z_s = T(lm_head(h_s) + W2 W1[x_s])
with x_s the token before the one it drafts (the anchor for slot 0, then the drafted tokens:
drafting is a short sequential walk over the block; training teacher-forces the data's tokens).
The confidence head predicts each slot's acceptance probability from [h_s; W1[x_s]]; it learns
1 - TV(target, drafter) when the loss carries the target's distribution (the acceptance
probability of speculative sampling), else the drafter's probability of the data token.

Initialisation: W2 = 0, so a fresh DSpark's logits are DFlash's (the bias starts at zero).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dflash_train.model.config import DrafterConfig
from dflash_train.model.drafter import DFlashDrafter


class MarkovHead(nn.Module):
    """The low-rank bias W2 @ W1[previous token]: W1 an embedding [V, r], W2 a linear r -> V."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
        self.markov_w2 = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.hidden_size + cfg.markov_rank, 1)


class DSparkDrafter(DFlashDrafter):
    drafted_offset = 0

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        self.markov_head = MarkovHead(cfg)
        self.confidence_head = ConfidenceHead(cfg)

    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        super().reset_parameters(std, generator)
        w1 = self.markov_head.markov_w1.weight
        with torch.no_grad():
            w1.copy_(torch.randn(w1.shape, generator=generator) * std)
            self.markov_head.markov_w2.weight.zero_()

    def _prev_embedding(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_head.markov_w1(prev)  # [T, r]

    def logit_bias(self, prev, vocab_ids):
        weight = self.markov_head.markov_w2.weight  # [V, r]
        return self._prev_embedding(prev), weight if vocab_ids is None else weight[vocab_ids]

    def confidence_logits(self, rows: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """[T] logits of each drafted token's acceptance probability."""
        features = torch.cat([rows, self._prev_embedding(prev).to(rows.dtype)], dim=-1)
        return self.confidence_head.proj(features.to(self.confidence_head.proj.weight.dtype)).squeeze(-1)

    def extra_loss(self, rows, out, labels, prev, vocab_ids, weight: float, has_tv: bool):
        """The confidence head's binary cross-entropy against the acceptance probability (module doc)."""
        target = (1 - out.tv) if has_tv else out.label_logprob.exp()
        logits = self.confidence_logits(rows, prev)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return weight * F.binary_cross_entropy_with_logits(logits, target.detach().to(logits.dtype).clamp(0, 1),
                                                            reduction="none"), None

    def _bias(self, prev: torch.Tensor) -> torch.Tensor:
        emb = self._prev_embedding(prev)
        return self.markov_head.markov_w2(emb.to(self.markov_head.markov_w2.weight.dtype))  # [T, V]

    def greedy(self, rows, prev, logits_fn):
        """logits_fn(rows, bias) adds the bias [T, V] before the target's logit scaling (`DraftHead`)."""
        return logits_fn(rows, bias=self._bias(prev)).argmax(-1)

    def propose(self, rows, anchor: int, logits_fn, temperature: float, generator=None):
        """Slot by slot: the bias of the token just drafted (the anchor first) on the slot's logits."""
        prev = torch.tensor([anchor], device=rows.device)
        tokens, qs = [], []
        for i in range(rows.shape[0]):
            z = logits_fn(rows[i:i + 1], bias=self._bias(prev))[0]
            if temperature <= 0:
                token = z.argmax().reshape(1)
            else:
                q = torch.softmax(z.double() / temperature, dim=-1)
                token = torch.multinomial(q, 1, generator=generator)
                qs.append(q)
            tokens.append(token)
            prev = token.to(rows.device)
        return torch.cat(tokens), (torch.stack(qs) if qs else None)
