"""The DFlash training objective: position-weighted losses of the drafted tokens.

Block j with anchor a_j drafts D tokens, a_j + 1 .. a_j + D (DFlash: D = B - 1 from slots 1..B-1,
slot 0 being the anchor; a head that samples from the anchor (DSpark) drafts D = B from every
slot: `Drafter.drafted`). For drafted token i (0-based) with per-row loss l[j,i]
(`softmax_rows.LossMix`: data-token CE, teacher-argmax CE, KL at T, TV) the objective is
    loss = sum_{j,i} w[j,i] * valid[j,i] * (l[j,i] + e[j,i]) / sum_{j,i} w[j,i] * valid[j,i]
with e the head's own term (`extra_loss`: DFlash 2's selector CE, DSpark's confidence BCE; 0 for DFlash) and
position weights w (`loss.weighting`):
- decay (the paper's eq. 4): w_i = exp(-i / gamma);
- dpace (D-PACE, arXiv 2605.18810): per block, from the drafter's probability q_i of the data
  token (exp(-CE), under no_grad) and alpha: q~_i = (1 - alpha) q_i + alpha where valid, 1 where
  not; C_i = prod_{m <= i} q~_m; w_i = sum_{m >= i} C_m valid_m. Sum_i C_i is a surrogate of the
  expected accepted length; its gradient weighs each slot's log q_i by exactly w_i.
Normalisation: by the weight sum, for both weightings, so the loss is a weighted mean of per-row
losses whatever the weighting and the learning rate keeps its meaning (D-PACE's raw weights grow
from ~1 towards D/2 as the drafter improves; normalising by the slot count, as speculators does,
would let the effective lr grow with them). The weight sum is over the *global* batch (every
micro-batch of every drafter rank), which the step divides by, so a step's gradient does not depend
on how the batch is split.

Accuracy and simulated tau always compare the drafter's greedy choice (the head's, with the data's
previous tokens as predecessors: exactly the acceptance of a leading run) with the DATA token: that
is acceptance under greedy verification, and on regenerated data the target's greedy token is the
data token. The lm_head and the softmax run in chunks (`softmax_rows`): no full logits.

With `loss.train_vocab` (train/loss/vocab.py) the softmaxes, the KL and the teacher's argmax run over
the subset's rows only: the teacher is renormalised over the subset. An approximation wherever the
target puts mass outside the subset (that mass is neither matched nor pushed down); held-out
simulated tau always uses the full vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, fields

import torch

from dflash_train.model.drafter.backbone import LossTerms
from dflash_train.train.loss.row_weights import (WEIGHTINGS, RowWeights, dpace_weights,  # noqa: F401 - re-exported
                                                 position_weights, slot_weights)
from dflash_train.train.loss.softmax_rows import CE, LossMix, RowsSpec, linear_softmax_loss  # noqa: F401 - re-exported


@dataclass(frozen=True)
class Objective:
    """The static settings of the loss: what a row's loss is, and how rows are weighted."""

    spec: RowsSpec = RowsSpec()
    weighting: str = "decay"
    gamma: float = 7.0
    alpha: float = 0.5
    chunk_tokens: int = 2048
    compiled: bool = False
    head_weight: float = 1.0  # the architecture's own term (DFlash 2's selector CE, DSpark's confidence BCE)

    @property
    def mix(self) -> LossMix:
        return self.spec.mix


def teacher_hidden_at(final_hidden: torch.Tensor, anchors: torch.Tensor, drafted: int) -> torch.Tensor:
    """The target's final hidden state for every drafted token: [b, S, H], anchors [b, N] -> [b, N, D, H].

    Drafted token i of anchor a is token a + i + 1, which the target predicts from position a + i.
    Positions past the sequence (never valid) are clamped in range.
    """
    b, seq_len, hdim = final_hidden.shape
    offsets = torch.arange(drafted, device=anchors.device)
    positions = (anchors[:, :, None] + offsets).clamp(0, seq_len - 1).view(b, -1)  # [b, N*D]
    picked = torch.gather(final_hidden, 1, positions[:, :, None].expand(-1, -1, hdim))  # [b, N*D, H]
    return picked.view(b, anchors.shape[1], drafted, hdim)


@dataclass
class LossStats:
    """Sums and counts of one batch; reduced across ranks by summing, divided only at the end.

    Per-slot tensors have D entries, one per drafted token.
    """

    loss_sum: torch.Tensor  # sum of w * (loss + head term) over valid slots (the objective's numerator)
    weight_sum: torch.Tensor  # sum of w over valid slots (its denominator)
    slot_loss_sum: torch.Tensor  # [D] unweighted per-slot loss (the mix) summed per slot
    slot_correct: torch.Tensor  # [D] greedy choice == label, valid slots
    slot_count: torch.Tensor  # [D] valid slots
    accepted_sum: torch.Tensor  # sum over blocks of leading correct slots (greedy acceptance)
    block_count: torch.Tensor  # blocks with at least their first drafted token valid

    def __add__(self, other: "LossStats") -> "LossStats":
        return LossStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def detach(self) -> "LossStats":
        return LossStats(**{f.name: getattr(self, f.name).detach() for f in fields(self)})

    def flat(self) -> torch.Tensor:
        return torch.cat([getattr(self, f.name).float().reshape(-1) for f in fields(self)])

    @classmethod
    def from_flat(cls, flat: torch.Tensor, drafted: int) -> "LossStats":
        values, offset = {}, 0
        for f in fields(cls):
            size = drafted if f.name.startswith("slot_") else 1
            part = flat[offset: offset + size]
            values[f.name] = part if f.name.startswith("slot_") else part.reshape(())
            offset += size
        return cls(**values)


@functools.lru_cache(maxsize=None)
def rows_spec(objective: Objective, drafted: int) -> RowsSpec:
    """The objective's RowsSpec with its position weights over blocks of `drafted` rows; one object per
    value (the compiled chunk guards on it: a new object per step would recompile)."""
    weights = RowWeights(objective.weighting, drafted, objective.gamma, objective.alpha)
    if objective.weighting not in WEIGHTINGS:
        raise ValueError(f"loss.weighting={objective.weighting!r}: expected one of {', '.join(WEIGHTINGS)}")
    return dataclasses.replace(objective.spec, weights=weights)


def block_loss(rows: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
               objective: Objective = Objective(), teacher: torch.Tensor | None = None,
               prev: torch.Tensor | None = None, head=None, fp8=None, vocab_ids: torch.Tensor | None = None,
               embed=None, progress: float = 1.0) -> LossStats:
    """Loss sums for drafted tokens' hidden states rows [b, N, D, H] against data labels / valid [b, N, D].

    teacher [b, N, D, H] (`teacher_hidden_at`) feeds the mix's teacher terms; prev [b, N, D] are the
    tokens before each label (the data's: teacher forcing) for a head that conditions on them;
    `head` (the drafter, `model.drafter.DFlashDrafter` or a subclass) adds its logit bias and own
    term; vocab_ids [V'] map the rows of a training-vocabulary lm_head back to token ids; `embed(ids)`
    the target's input embeddings (for a head that reads the previous tokens' embeddings); `progress`
    the share of training done (for a head whose own term follows the schedule)."""
    b, n, d = labels.shape
    hdim = rows.shape[-1]
    flat = rows.reshape(-1, hdim)  # [b*N*D, H]
    flat_prev = None if prev is None else prev.reshape(-1)
    flat_teacher = None if teacher is None else teacher.reshape(-1, hdim)
    blocks_prev = None if prev is None else prev.reshape(b * n, d)
    bias = head.logit_bias(blocks_prev, vocab_ids, rows.reshape(b * n, d, hdim), embed) if head is not None else None

    def rows_loss(with_bias):
        return linear_softmax_loss(flat, lm_head_weight, labels.reshape(-1), flat_teacher, objective.chunk_tokens,
                                   objective.compiled, rows_spec(objective, d), fp8, with_bias, valid.reshape(-1))

    out = rows_loss(bias)
    losses, w = out.losses.view(b, n, d), out.weights.view(b, n, d)
    terms = LossTerms(progress, unbiased=lambda: rows_loss(None))
    extra, predicted = (head.extra_loss(flat, out, labels.reshape(-1), flat_prev, vocab_ids, objective.head_weight,
                                        objective.mix.tv > 0, terms) if head is not None else (None, None))
    loss_sum = out.loss_sum
    if extra is not None:  # per row [T], weighted like the rows' loss; or a sum over the rows already ([])
        loss_sum = loss_sum + (extra if extra.dim() == 0 else (w * extra.view(b, n, d).to(w.dtype)).sum())
    predicted = (out.argmax if predicted is None else predicted).view(b, n, d)
    okf = valid.to(losses.dtype)
    correct = (predicted == labels) & valid  # against the data token: greedy acceptance
    accepted = torch.cumprod(correct.long(), dim=-1).sum(-1)  # [b, N] leading correct slots
    return LossStats(
        loss_sum=loss_sum,
        weight_sum=w.sum(),
        slot_loss_sum=(losses * okf).sum((0, 1)).detach(),
        slot_correct=correct.sum((0, 1)).float(),
        slot_count=okf.sum((0, 1)),
        accepted_sum=accepted.sum().float(),
        block_count=valid[:, :, 0].sum().float(),
    )


def summarize(stats: LossStats) -> dict:
    """Python floats from (reduced) sums: loss, per-slot accuracy, simulated tau. One host sync."""
    flat = stats.flat().tolist()
    s = LossStats.from_flat(torch.tensor(flat), stats.slot_count.numel())
    count = s.slot_count.clamp(min=1)
    acc = (s.slot_correct / count).tolist()
    return {
        "loss": float(s.loss_sum / max(float(s.weight_sum), 1e-9)),
        "acc": acc,
        "ce": (s.slot_loss_sum / count).tolist(),
        "sim_tau": 1.0 + float(s.accepted_sum) / max(float(s.block_count), 1.0),
        "eal": 1.0 + sum(math.prod(acc[: i + 1]) for i in range(len(acc))),
        "blocks": float(s.block_count),
    }
