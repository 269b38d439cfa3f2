"""The confidence head's calibration (eval/calibration.py) against naive loops and synthetic heads whose
calibration is known."""

import math

import pytest
import torch

from dflash_train.eval.calibration import Calibration, expected_calibration_error, fitted_temperature, plot, reliability


def _naive_bins(p: list[float], y: list[float], bins: int = 10) -> list[list[float]]:
    rows = []
    for b in range(bins):
        inside = [(pi, yi) for pi, yi in zip(p, y) if min(int(pi * bins), bins - 1) == b]
        if inside:
            rows.append([b / bins, (b + 1) / bins, len(inside), sum(pi for pi, _ in inside) / len(inside),
                         sum(yi for _, yi in inside) / len(inside)])
    return rows


def test_bins_and_ece_against_a_naive_loop():
    gen = torch.Generator().manual_seed(0)
    p = torch.cat([torch.rand(500, generator=gen, dtype=torch.float64), torch.tensor([0.0, 1.0], dtype=torch.float64)])
    y = (torch.rand(p.shape, generator=gen, dtype=torch.float64) < p ** 2).double()  # over-confident
    got, want = reliability(p, y), _naive_bins(p.tolist(), y.tolist())
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g[:3] == w[:3] and g[3:] == pytest.approx(w[3:])
    naive_ece = sum(r[2] * abs(r[3] - r[4]) for r in want) / len(p)
    assert expected_calibration_error(got) == pytest.approx(naive_ece) and naive_ece > 0.1


@pytest.mark.parametrize("true_t", [1.0, 0.5, 2.5])
def test_the_fitted_temperature_recovers_the_one_the_outcomes_were_drawn_with(true_t):
    """Outcomes drawn from sigmoid(z / T): T is recovered within 10 %; at T = 1 the head is calibrated (small ECE)."""
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(40_000, generator=gen, dtype=torch.float64) * 3
    y = (torch.rand(z.shape, generator=gen, dtype=torch.float64) < torch.sigmoid(z / true_t)).double()
    assert fitted_temperature(z, y) == pytest.approx(true_t, rel=0.1)
    cal = Calibration()
    cal.add(z.view(-1, 8), y.view(-1, 8), torch.ones(z.numel() // 8, 8, dtype=torch.bool))
    summary = cal.summary()
    assert (summary["ece"] < 0.02) == (true_t == 1.0)
    assert summary["temperature"] == pytest.approx(true_t, rel=0.1)


def test_only_valid_slots_count_and_each_slot_is_summarised():
    logits = torch.tensor([[0.0, 2.0, -2.0], [1.0, 1.0, 1.0]])
    accepted = torch.tensor([[True, True, False], [False, True, True]])
    valid = torch.tensor([[True, True, False], [True, False, False]])
    cal = Calibration()
    cal.add(logits, accepted, valid)
    s = cal.summary()
    assert s["pairs"] == 3 and s["accept_rate"] == pytest.approx(2 / 3)
    sig = torch.sigmoid(torch.tensor([0.0, 1.0, 2.0])).tolist()
    assert s["mean_predicted"] == pytest.approx(sum(sig) / 3)
    assert s["per_slot"] == [[pytest.approx((sig[0] + sig[1]) / 2), 0.5, 2], [pytest.approx(sig[2]), 1.0, 1]]
    assert s["brier"] == pytest.approx(((sig[0] - 1) ** 2 + sig[1] ** 2 + (sig[2] - 1) ** 2) / 3)
    assert Calibration().summary() is None
    empty = Calibration()
    empty.add(logits, accepted, torch.zeros_like(valid))
    assert empty.summary() is None


def test_the_reliability_diagram_is_written(tmp_path):
    cal = Calibration()
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(64, 4, generator=gen)
    cal.add(z, torch.rand(64, 4, generator=gen) < 0.5, torch.ones(64, 4, dtype=torch.bool))
    path = tmp_path / "r.png"
    assert plot({"a": {"confidence": cal.summary()}, "b": {}}, path) and path.stat().st_size > 1000
    assert not plot({"b": {}}, tmp_path / "none.png") and not (tmp_path / "none.png").exists()
    assert math.isfinite(cal.summary()["temperature"])
