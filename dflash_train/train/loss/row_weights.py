"""Position weights of the drafted tokens (`loss.weighting`), computed where the rows' loss is.

Rows come in blocks of D drafted tokens (token i = 0..D-1 of each block); a row's weight w depends
on its position and, for D-PACE, on the drafter's confidences in its block (train/loss/objective.py's module
doc has the formulas). They are pure functions of the forward's own outputs, so the chunked loss
(`softmax_rows`) computes them chunk by chunk, inside its compiled function, and scales each row's
gradient logits by them before the lm_head's gradient matmul: the low-rank bias's weight gradient
(a sum over rows) is then final in the forward, and nothing is recomputed in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHTINGS = ("decay", "dpace")


@dataclass(frozen=True)
class RowWeights:
    """Static: how rows are weighted. kind "rows": w = valid (or 1), no blocks; "decay" and "dpace"
    weigh blocks of `drafted` rows (chunks then hold whole blocks)."""

    kind: str = "rows"
    drafted: int = 1
    gamma: float = 7.0
    alpha: float = 0.5

    @property
    def block(self) -> int:
        """Rows that must share a chunk (1: any split)."""
        return 1 if self.kind == "rows" else self.drafted


def slot_weights(drafted: int, gamma: float, device=None, dtype=torch.float32) -> torch.Tensor:
    """The decay w_i for drafted tokens 0..D-1: exp(-i/gamma), shape [D]."""
    i = torch.arange(drafted, device=device, dtype=torch.float64)
    return torch.exp(-i / gamma).to(dtype)


def dpace_weights(label_logprob: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE weights [..., D] (train/loss/objective.py's module doc) from log q of the data token and valid,
    both [..., D]; no gradient. Invalid slots get weight 0 and leave the products unchanged (q~ = 1)."""
    with torch.no_grad():
        q = label_logprob.detach().exp()
        q_tilde = torch.where(valid, (1 - alpha) * q + alpha, torch.ones_like(q))
        cum = torch.cumprod(q_tilde, dim=-1) * valid  # C_i valid_i
        tail = cum.flip(-1).cumsum(-1).flip(-1)  # sum_{m >= i} C_m valid_m
        return tail * valid


def position_weights(kind: str, label_logprob: torch.Tensor, valid: torch.Tensor, gamma: float = 7.0,
                     alpha: float = 0.5) -> torch.Tensor:
    """w * valid [..., D] of weighting `kind` in label_logprob's dtype, no gradient."""
    if kind == "dpace":
        return dpace_weights(label_logprob, valid, alpha).to(label_logprob.dtype)
    if kind != "decay":
        raise ValueError(f"loss.weighting={kind!r}: expected one of {', '.join(WEIGHTINGS)}")
    decay = slot_weights(valid.shape[-1], gamma, valid.device, label_logprob.dtype)
    return decay * valid.to(label_logprob.dtype)


def row_weights(spec: RowWeights, label_logprob: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """w [c] of c rows (whole blocks unless kind "rows"), from their log q of the data token [c] and
    valid [c] (None: all valid)."""
    if valid is None:
        valid = torch.ones_like(label_logprob, dtype=torch.bool)
    if spec.kind == "rows":
        return valid.to(label_logprob.dtype)
    blocks = label_logprob.view(-1, spec.drafted)  # [c/D, D]
    return position_weights(spec.kind, blocks, valid.view(-1, spec.drafted), spec.gamma, spec.alpha).reshape(-1)
