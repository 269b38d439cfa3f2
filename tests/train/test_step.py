"""clip_and_step against the reference (clip_grad_norm_ then a plain optimizer step); what a whole
train_step changes and what it leaves alone."""

import pytest
import torch

from dflash_train.model.drafter.config import drafter_config_from_target
from dflash_train.model.drafter.backbone import DFlashDrafter
from dflash_train.model.target.target import Target
from dflash_train.train.feed.batching import MicroBatch
from dflash_train.train.step import StepContext, clip_and_step, train_step
from tests.conftest import tiny_qwen3


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


def test_a_step_trains_every_drafter_parameter_and_leaves_the_frozen_target_untouched():
    """train_step with the target's own embedding and lm_head (frozen, as `load_target` returns
    them) in the StepContext: every drafter parameter moves; the target's weights are bit-identical
    afterwards and hold no gradient."""
    target = Target(model=tiny_qwen3(vocab_size=97, seed=4), tokenizer=None, name="tiny")
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    dcfg = drafter_config_from_target(target.config, num_layers=1, block_size=4, mask_token_id=96, num_taps=3)
    drafter = DFlashDrafter(dcfg)
    drafter.reset_parameters(generator=torch.Generator().manual_seed(0))
    start = [p.detach().clone() for p in drafter.parameters()]
    ctx = StepContext(embed_weight=target.embed_weight, lm_head_weight=target.lm_head_weight, drafter=dcfg,
                      gamma=2.0, chunk_tokens=16, backend="sdpa", device=torch.device("cpu"), autocast_dtype=None)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, 24), generator=gen)
    mb = MicroBatch(["a", "b"], ids, torch.ones_like(ids), torch.ones_like(ids), torch.tensor([[2, 9], [5, 15]]),
                    torch.ones(2, 2, dtype=torch.bool), {"taps": torch.randn(2, 24, 3 * 64, generator=gen)})
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for _ in range(2):
        train_step(drafter, optimizer, scheduler, [mb], ctx, grad_clip=1.0)
    for name, value in target.model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(p.grad is None for p in target.model.parameters())
    assert all(not torch.equal(p, p0) for p, p0 in zip(drafter.parameters(), start))
