"""clip_and_step against the reference: clip_grad_norm_ then a plain optimizer step."""

import pytest
import torch

from dflash_train.train.step import clip_and_step


def _model_and_grads(seed: int, scale: float):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 8))
    x = torch.randn(16, 32)
    (model(x).pow(2).sum() * scale).backward()
    return model


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("scale", [1e-4, 100.0])  # below and above the clip threshold
def test_clip_and_step_equals_clip_grad_norm_then_step(fused, scale):
    ours, ref = _model_and_grads(0, scale), _model_and_grads(0, scale)  # deepcopy would drop .grad
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    for step in range(3):
        if step:  # fresh gradients of the same scale on both copies
            for model in (ours, ref):
                model.zero_grad()
                torch.manual_seed(step)
                (model(torch.randn(16, 32)).pow(2).sum() * scale).backward()
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt_ref.step()
        norm = clip_and_step(opt_ours, list(ours.parameters()), 1.0)
        torch.testing.assert_close(norm, norm_ref, rtol=1e-6, atol=0)
        for p, q in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    moved = max(float((p - q).abs().max()) for p, q in zip(ours.parameters(), _model_and_grads(0, scale).parameters()))
    assert moved > 1e-3  # the steps changed the weights: the comparison is not between two no-ops
