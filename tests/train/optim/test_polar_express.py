"""Polar Express schedules made for any iteration count (train/optim/polar_express.py), checked against the
published schedule, a brute-force search for the minimax quintic, the scalar map on a grid and the matrix
iteration of both of Muon's forms."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_train.config import OptimConfig, RunConfig
from dflash_train.train.optim.muon import TORCH_COEFFICIENTS, gram_orthogonalise, ns_schedule, orthogonalise
from dflash_train.train.optim.polar_express import (PUBLISHED_SCHEDULE, apply, final_band, minimax_quintic,
                                                    polar_express_schedule)
from dflash_train.validate import config_problems


def _max_error(coefficients, lo: float, hi: float, points: int = 4001) -> float:
    return max(abs(1 - apply(coefficients, lo + (hi - lo) * k / (points - 1))) for k in range(points))


def test_five_iterations_from_1e_3_are_the_published_schedule():
    made = polar_express_schedule(5)
    for ours, published in zip(made, PUBLISHED_SCHEDULE, strict=True):
        assert ours == pytest.approx(published, rel=1e-12)


@pytest.mark.parametrize("lo, hi", [(0.02, 1.0), (0.13, 1.87), (0.42, 1.58), (0.003, 1.0)])
def test_the_quintic_is_the_minimax_fit_no_nearby_quintic_beats(lo, hi):
    """Remez's answer against brute force: no random perturbation of its coefficients (relative 1e-1..1e-4)
    has a smaller largest |1 - p| on the interval, and its error equioscillates (4 extrema of equal size)."""
    best = minimax_quintic(lo, hi)
    error = _max_error(best, lo, hi)
    rng = random.Random(0)
    for _ in range(300):
        scale = 10 ** rng.uniform(-4, -1)
        other = tuple(x * (1 + scale * rng.gauss(0, 1)) for x in best)
        assert _max_error(other, lo, hi) >= error * (1 - 1e-9)
    grid = [lo + (hi - lo) * k / 4000 for k in range(4001)]
    errors = [1 - apply(best, s) for s in grid]
    extremes = [e for i, e in enumerate(errors) if i in (0, len(errors) - 1)
                or (abs(e) >= abs(errors[i - 1]) and abs(e) >= abs(errors[i + 1]))]
    assert len(extremes) >= 4 and all(abs(abs(e) - error) < 1e-6 for e in (extremes[0], extremes[-1]))


def test_a_four_iteration_schedule_brings_every_singular_value_above_its_bound_nearer_one_than_torchs_five():
    """4 iterations made from 3e-3: every normalised singular value >= 3e-3 ends in [0.77, 1.23], where torch's
    quintic needs 5 iterations for [0.68, 1.21] and the published 5-step schedule cut to 4 leaves [0.42, 1.58]."""
    made = polar_express_schedule(4, 3e-3)
    low, high = final_band(made, 3e-3)
    torch_low, torch_high = final_band((TORCH_COEFFICIENTS,) * 5, 3e-3)
    cut_low, cut_high = final_band(PUBLISHED_SCHEDULE[:4], 3e-3)
    assert 0.77 < low < 0.79 and 1.21 < high < 1.23
    assert torch_low < 0.69 < low and high - torch_high < 0.03
    assert cut_low < 0.43 and cut_high > 1.57
    for steps, lower in ((3, 1e-2), (5, 1e-3), (6, 1e-4)):  # every schedule's band is symmetric about 1
        low, high = final_band(polar_express_schedule(steps, lower), lower)
        assert abs((low + high) / 2 - 1) < 1e-6 and low > 0.5


def _with_spectrum(m: int, n: int, top_to_bottom: float, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, m, generator=gen, dtype=torch.float64))
    return (u * torch.logspace(0, -top_to_bottom, m, dtype=torch.float64)) @ v.T  # [m, n]


@pytest.mark.parametrize("gram", [False, True])
def test_both_forms_run_a_made_schedule_as_its_scalar_map_predicts(gram):
    """A [48, 160] matrix whose normalised singular values all lie above 3e-3 (its Frobenius norm is ~2x its
    top): 4 iterations of the 3e-3 schedule leave every singular value in the scalar map's band, in the standard
    form (bf16) and the Gram form (float32 on the CPU), within rounding."""
    x = _with_spectrum(48, 160, 1.2)
    schedule, safety = ns_schedule("polar_express", 4, 3e-3)
    if gram:
        out = gram_orthogonalise(x[None].float(), schedule, safety, dtype=torch.float32)[0]
    else:
        out = orthogonalise(x[None], schedule, safety)[0]
    s = torch.linalg.svdvals(out.double())
    smallest = torch.linalg.svdvals(x).min() / (torch.linalg.matrix_norm(x) * safety)
    assert smallest > 3e-3
    low, high = final_band(schedule, float(smallest))
    slack = 0.03 if gram else 0.06  # bf16's rounding over 4 iterations
    assert low - slack < float(s.min()) and float(s.max()) < high + slack


def test_the_config_takes_polar_express_at_any_iteration_count_and_checks_its_bound():
    assert config_problems(RunConfig(optim=OptimConfig(muon_coefficients="polar_express", muon_ns_steps=4,
                                                       muon_polar_lower=3e-3))) == []
    problems = config_problems(RunConfig(optim=OptimConfig(muon_coefficients="polar_express", muon_polar_lower=1.0)))
    assert any("optim.muon_polar_lower=1.0" in p for p in problems)
    with pytest.raises(ValueError, match="steps >= 1"):
        polar_express_schedule(0)
