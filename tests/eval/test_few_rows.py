"""The CPU's few-row linear route (eval/few_rows.py): the routed product against F.linear, and the decision timed on
the model's own forward."""

import pytest
import torch
from eval_helpers import tiny_target

from dflash_train.eval import few_rows


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
def test_few_row_linear_routes_only_few_rows_and_matches_linear(rows):
    """Inside `few_row_linear`, nn.Linear on 2..4 rows equals `few_row_matmul` (+ bias) bit for bit
    and F.linear to rounding; any other row count runs F.linear itself, untouched."""
    g = torch.Generator().manual_seed(rows)
    layer = torch.nn.Linear(24, 40, bias=True)
    x = torch.randn(1, rows, 24, generator=g)
    with torch.no_grad():
        plain = layer(x)
        with few_rows.few_row_linear() as mode:
            routed = layer(x)
        few = few_rows.few_row_matmul(x[0], layer.weight) + layer.bias
    assert routed.shape == plain.shape and routed.is_contiguous()
    torch.testing.assert_close(routed, plain, rtol=1e-5, atol=1e-5)
    if few_rows.FEW_ROWS[0] <= rows <= few_rows.FEW_ROWS[1]:
        assert mode.routed == 1 and torch.equal(routed[0], few)
    else:
        assert mode.routed == 0 and torch.equal(routed, plain)


def test_few_row_route_is_decided_on_the_models_own_forward_once(monkeypatch):
    """`few_rows_pay_model` times the model's few-token forward both ways (the routed one really routed) and
    keeps the faster, once per model; where the widest matmul alone already loses, it runs no forward."""
    model = tiny_target(dtype=torch.float32)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(isinstance(torch.overrides._get_current_function_mode(),
                                                                   few_rows.few_row_linear)))
    monkeypatch.setattr(few_rows, "few_rows_pay", lambda *a, **k: False)
    assert few_rows.few_rows_pay_model(model) is False and calls == []
    few_rows._MODEL_VERDICTS.clear()
    monkeypatch.setattr(few_rows, "few_rows_pay", lambda *a, **k: True)
    verdict = few_rows.few_rows_pay_model(model, reps=3)
    assert calls == [True, False] * 4  # one warm-up round and 3 timed, each routed then as is
    assert few_rows.few_rows_pay_model(model, reps=3) is verdict and len(calls) == 8  # remembered
    mode = few_rows.few_row_mode(model, torch.device("cpu"))
    assert isinstance(mode, few_rows.few_row_linear) == verdict


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("pays", [False, True])
def test_project_is_the_product_in_whichever_order_pays(rows, pays, monkeypatch):
    """`project` (the drafter's lm_head rows) equals x @ weight.T to rounding; it takes the routed order only for
    2..4 rows where `few_rows_pay` says that order is faster, bit for bit `few_row_matmul` then."""
    monkeypatch.setattr(few_rows, "few_rows_pay", lambda *a, **k: pays)
    g = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 24, generator=g), torch.randn(40, 24, generator=g)
    out = few_rows.project(x, weight)
    torch.testing.assert_close(out, x @ weight.T, rtol=1e-5, atol=1e-5)
    routed = pays and few_rows.FEW_ROWS[0] <= rows <= few_rows.FEW_ROWS[1]
    assert torch.equal(out, few_rows.few_row_matmul(x, weight) if routed else x @ weight.T)
