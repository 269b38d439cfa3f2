"""Polar Express schedules (Amsel, Persson, Musco and Gower 2025, arXiv 2505.16932), made for any iteration count.

Muon maps each singular value s of a normalised update through an odd quintic p(s) = a s + b s^3 + c s^5 per
iteration; the ideal map sends every s in (0, 1] to 1. Polar Express chooses the iterations greedily: with the
singular values known to lie in [l, u] (l the `lower` bound, u = 1 after normalisation), iteration t's quintic is
the one closest to 1 on [l, u] in the max norm (`minimax_quintic`, found by Remez exchange: the error 1 - p
equioscillates at l, p's two critical points and u), so the next interval is [p(l), p(u)] = [1 - E, 1 + E].
Two published refinements keep it stable in bf16 (`polar_express_schedule`): the fit is made on
[max(l, cushion u), u], then rescaled so that p(l) and p(u) are again centred on 1; and every iteration but the
last is divided by a safety factor (a / f, b / f^3, c / f^5, f = 1 + safety), so rounding that pushes a
singular value a little past u is still pulled back. With lower 1e-3, cushion 0.02 and safety 0.02, the
5-iteration schedule is modded-nanogpt's published one to ~1e-12 (tests/train/optim/test_polar_express.py).

Why make it here: the published schedule is for 5 iterations; its first 4 alone leave singular values anywhere
in [0.42, 1.57], not a schedule for 4. The same construction run for 4 iterations, with a lower bound raised to
where 4 quintics reach, gives one: e.g. 4 iterations with lower 3e-3 map every s >= 3e-3 into [0.78, 1.21] where
torch's quintic at 5 iterations gives [0.68, 1.20] (and s >= 1e-3 into [0.28, 1.21] against torch's [0.47, 1.20]):
one iteration fewer, 4/5 of the Newton-Schulz FLOPs (docs/PERF.md 3.7).
"""

from __future__ import annotations

import math

import torch

Quintic = tuple[float, float, float]
PUBLISHED_LOWER, CUSHION, SAFETY = 1e-3, 0.02, 0.02  # modded-nanogpt's schedule's settings (module doc)
PUBLISHED_SCHEDULE = (  # modded-nanogpt's 5-step schedule: what `polar_express_schedule(5)` must reproduce
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def apply(coefficients: Quintic, s):
    """p(s) for a float or a tensor of singular values."""
    a, b, c = coefficients
    return a * s + b * s ** 3 + c * s ** 5


def _critical_points(coefficients: Quintic, lo: float, hi: float) -> list[float]:
    """The s in (lo, hi) where p'(s) = a + 3 b s^2 + 5 c s^4 = 0, ascending."""
    a, b, c = coefficients
    disc = 9 * b * b - 20 * a * c
    if c == 0 or disc < 0:
        return []
    roots = [(-3 * b + sign * math.sqrt(disc)) / (10 * c) for sign in (-1, 1)]  # s^2
    return sorted(math.sqrt(y) for y in roots if y > 0 and lo < math.sqrt(y) < hi)


def minimax_quintic(lo: float, hi: float, iterations: int = 100) -> Quintic:
    """The odd quintic p minimising max |1 - p(s)| over s in [lo, hi] (0 < lo < hi), by Remez exchange."""
    if not 0 < lo < hi:
        raise ValueError(f"minimax_quintic needs 0 < lo < hi, got [{lo}, {hi}]")
    points = [lo + (hi - lo) * k / 3 for k in range(4)]
    coefficients = (0.0, 0.0, 0.0)
    for _ in range(iterations):
        rows = torch.tensor([[s, s ** 3, s ** 5, (-1.0) ** k] for k, s in enumerate(points)], dtype=torch.float64)
        a, b, c, _error = torch.linalg.solve(rows, torch.ones(4, dtype=torch.float64)).tolist()  # p(s_k) + (-1)^k E = 1
        coefficients = (a, b, c)
        inner = _critical_points(coefficients, lo, hi)
        if len(inner) != 2:  # the exchange left the interval: keep the last solve (never seen at Muon's intervals)
            break
        new = [lo, *inner, hi]
        if max(abs(x - y) for x, y in zip(new, points)) < 1e-15:
            break
        points = new
    return coefficients


def polar_express_schedule(steps: int, lower: float = PUBLISHED_LOWER, cushion: float = CUSHION,
                           safety: float = SAFETY) -> tuple[Quintic, ...]:
    """`steps` quintics (a, b, c), greedy minimax from singular values in [lower, 1] (module doc)."""
    if steps < 1 or not 0 < lower < 1:
        raise ValueError(f"a Polar Express schedule needs steps >= 1 and 0 < lower < 1, got {steps}, {lower}")
    lo, hi, schedule = lower, 1.0, []
    for t in range(steps):
        a, b, c = minimax_quintic(max(lo, cushion * hi), hi)
        centre = 2 / (apply((a, b, c), lo) + apply((a, b, c), hi))  # p(lo) and p(hi) centred on 1 again
        a, b, c = a * centre, b * centre, c * centre
        if t + 1 < steps:
            f = 1 + safety
            a, b, c = a / f, b / f ** 3, c / f ** 5
        schedule.append((a, b, c))
        lo = apply((a, b, c), lo)
        hi = 2 - lo
    return tuple(schedule)


def final_band(schedule, lower: float, points: int = 20001) -> tuple[float, float]:
    """(min, max) of the schedule's map over singular values in [lower, 1], log-spaced (float64)."""
    s = torch.logspace(math.log10(lower), 0, points, dtype=torch.float64)
    for coefficients in schedule:
        s = apply(coefficients, s)
    return float(s.min()), float(s.max())
