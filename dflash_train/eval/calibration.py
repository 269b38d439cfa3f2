"""How well a drafter's confidence head predicts acceptance, measured on the eval's own text.

DSpark's confidence head gives each drafted slot a logit z of its acceptance probability; engines that stop a
draft early (or weigh drafts) read it, some through a temperature (SGLang's `sts_temperatures`). The eval's
train/serve check (`train/watch/simulate.py`) runs the drafter teacher-forced on every anchor of the text it
decoded: there each slot is accepted when its greedy draft equals the text's token, given the text's tokens
before it, which is the event the head predicts. `Calibration` collects (z, accepted, slot) over a prompt set;
`summary` gives the reliability of sigmoid(z) in equal-width bins, the expected calibration error (ECE: the
count-weighted mean |predicted - accepted| over the bins), the Brier score, each slot's mean prediction against
its acceptance, and the temperature T for which sigmoid(z / T) fits the outcomes best (the least binary
cross-entropy). The head trains on 1 - TV(target, drafter) when the loss has a TV term (the acceptance
probability of speculative sampling), which greedy acceptance need not equal: the summary says what it reads.
"""

from __future__ import annotations

import math

import torch

BINS = 10
T_RANGE = (0.05, 20.0)  # the temperatures searched (log-spaced golden section)
T_ITERATIONS = 60


class Calibration:
    """Accumulates (logit, accepted, slot) triples; `summary()` reduces them (None when empty)."""

    def __init__(self):
        self.logits: list[torch.Tensor] = []
        self.accepted: list[torch.Tensor] = []
        self.slots: list[torch.Tensor] = []

    def add(self, logits: torch.Tensor, accepted: torch.Tensor, valid: torch.Tensor) -> None:
        """logits, accepted, valid [..., D] (the last dimension the drafted slot); only valid slots count."""
        slot = torch.arange(logits.shape[-1], device=logits.device).expand(logits.shape)
        keep = valid.bool()
        self.logits.append(logits[keep].detach().double().cpu())
        self.accepted.append(accepted[keep].detach().double().cpu())
        self.slots.append(slot[keep].cpu())

    def summary(self) -> dict | None:
        if not self.logits or not sum(t.numel() for t in self.logits):
            return None
        z, y, slot = torch.cat(self.logits), torch.cat(self.accepted), torch.cat(self.slots)
        p = torch.sigmoid(z)
        bins = reliability(p, y)
        return {
            "pairs": int(z.numel()),
            "mean_predicted": float(p.mean()),
            "accept_rate": float(y.mean()),
            "ece": expected_calibration_error(bins),
            "brier": float(((p - y) ** 2).mean()),
            "temperature": fitted_temperature(z, y),
            "bins": bins,  # [lo, hi, count, mean predicted, accepted rate]
            "per_slot": [[float(p[slot == s].mean()), float(y[slot == s].mean()), int((slot == s).sum())]
                         for s in range(int(slot.max()) + 1) if bool((slot == s).any())],
        }


def reliability(p: torch.Tensor, y: torch.Tensor, bins: int = BINS) -> list[list[float]]:
    """[lo, hi, count, mean p, mean y] of each non-empty equal-width bin of p in [0, 1] (1.0 in the last)."""
    index = (p * bins).long().clamp(max=bins - 1)
    rows = []
    for b in range(bins):
        inside = index == b
        n = int(inside.sum())
        if n:
            rows.append([b / bins, (b + 1) / bins, n, float(p[inside].mean()), float(y[inside].mean())])
    return rows


def expected_calibration_error(bins: list[list[float]]) -> float:
    total = sum(row[2] for row in bins)
    return sum(row[2] * abs(row[3] - row[4]) for row in bins) / total if total else float("nan")


def _bce(z: torch.Tensor, y: torch.Tensor, temperature: float) -> float:
    return float(torch.nn.functional.binary_cross_entropy_with_logits(z / temperature, y))


def fitted_temperature(z: torch.Tensor, y: torch.Tensor) -> float:
    """argmin over T in T_RANGE of the mean BCE of sigmoid(z / T) against y: a golden-section search on log T
    (the loss is convex in 1 / T, so unimodal in log T)."""
    lo, hi = math.log(T_RANGE[0]), math.log(T_RANGE[1])
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = _bce(z, y, math.exp(a)), _bce(z, y, math.exp(b))
    for _ in range(T_ITERATIONS):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = _bce(z, y, math.exp(a))
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = _bce(z, y, math.exp(b))
    return math.exp((lo + hi) / 2)


def describe(c: dict) -> str:
    """One line of a set's calibration."""
    slots = " ".join(f"{p:.2f}/{y:.2f}" for p, y, _ in c["per_slot"][:4])
    at_end = any(abs(math.log(c["temperature"] / end)) < 0.01 for end in T_RANGE)
    bound = f" (an end of the range searched, {T_RANGE[0]}-{T_RANGE[1]}: all or none accepted?)" if at_end else ""
    return (f"confidence head: predicts {c['mean_predicted']:.2f} where {c['accept_rate']:.2f} of "
            f"{c['pairs']} drafted tokens are accepted (greedy, teacher-forced on the output), ECE "
            f"{c['ece']:.3f}, Brier {c['brier']:.3f}; slots 1-4 predicted/accepted {slots}; sigmoid(z / "
            f"{c['temperature']:.2f}) fits it best{bound}")


RELIABILITY_PNG = "confidence_reliability.png"


def plot(sets: dict[str, dict], path) -> bool:
    """A reliability diagram of every set with a `confidence` summary, written to `path` (PNG); False when
    there is none."""
    have = {name: s["confidence"] for name, s in sets.items() if s.get("confidence")}
    if not have:
        return False
    import matplotlib  # local: a heavy import only the plots need (as eval/report.py's)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="calibrated")
    for name, c in have.items():
        xs, ys = [row[3] for row in c["bins"]], [row[4] for row in c["bins"]]
        ax.plot(xs, ys, marker="o", label=f"{name} (ECE {c['ece']:.3f}, T {c['temperature']:.2f})")
    ax.set(xlabel="predicted acceptance (confidence head)", ylabel="accepted (greedy, teacher-forced)",
           xlim=(0, 1), ylim=(0, 1), title="Confidence head reliability")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
