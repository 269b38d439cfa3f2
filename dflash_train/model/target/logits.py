"""The target's output transform on logits, as the engines apply it to a drafter's logits.

Some targets scale or soft-cap their logits after the lm_head (Gemma 2: `final_logit_softcapping`;
Granite/Cohere-style multipliers). A drafter that shares the target's lm_head must train on, and
draft from, the logits the engines compute: `z = s * tanh(m * (h @ W.T) / s)` (multiplier m, cap s;
the reference `dflash` package's `compute_logits`: multiplier first, then the cap).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitTransform:
    multiplier: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, drafter_config) -> "LogitTransform":
        """The transform a drafter config records (identity for configs without the fields)."""
        cap = getattr(drafter_config, "final_logit_softcapping", None)
        return cls(float(getattr(drafter_config, "output_multiplier", 1.0) or 1.0), float(cap) if cap else None)

    @property
    def identity(self) -> bool:
        return self.multiplier == 1.0 and not self.softcap

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        z = raw * self.multiplier if self.multiplier != 1.0 else raw
        return torch.tanh(z / self.softcap) * self.softcap if self.softcap else z

    def derivative(self, z: torch.Tensor) -> torch.Tensor | None:
        """dz/draw from the transformed logits z (None for the identity): m * (1 - (z/s)^2) under a cap."""
        if self.identity:
            return None
        if not self.softcap:
            return torch.full_like(z, self.multiplier)
        return (1 - (z / self.softcap) ** 2) * self.multiplier
