"""optim.name=muon (train/optim/muon.py): the split by name and shape; the update against torch.optim.Muon
and torch.optim.AdamW run on float32 parameters directly (the float32-master path included); a
skipped step leaves everything exactly as it was; exact resume; one schedule for both parts; a
whole training run resumed onto its uninterrupted trajectory."""

import inspect
import io
import os

import pytest
import torch
from torch import nn

from dflash_train.config import OptimConfig
from dflash_train.train.loop import train
from dflash_train.train.optim.muon import MuonAdamW, muon_split, uses_gram
from dflash_train.train.optim.optimizer import build_optimizer, full_precision_weights, lr_factor, param_dtype
from dflash_train.train.parallel.parallelize import apply_precision
from dflash_train.train.step import clip_and_step, health_flags, total_grad_norm
from tests.conftest import save_tiny_qwen3_dir
from tests.golden.loop_golden import CKPT_EVERY, STEPS, TARGET_INIT_STD, differences, golden_config, trajectory

LR, ADAMW_DECAY = 1e-2, 0.01


def test_the_split_by_name_and_shape():
    """speculators' rule, with the names DFlash 2 heads will add."""
    v, h, r = 50, 16, 4
    shapes = {
        "layers.0.self_attn.q_proj.weight": (h, h), "layers.0.mlp.down_proj.weight": (h, 2 * h),
        "fc.weight": (h, 3 * h), "kernel_projection.weight": (8, h), "hidden_projection.weight": (h, h),
        "candidate_selector.token_codebook": (v, r), "markov_w1.weight": (v, r), "markov_w2.weight": (v, r),
        "embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "base_kernel": (4, 8, 8),
        "layers.0.input_layernorm.weight": (h,), "fc.bias": (h,), "gate.weight": (1, h), "scale": (),
    }
    named = [(name, nn.Parameter(torch.zeros(shape))) for name, shape in shapes.items()]
    named.append(("frozen_proj.weight", nn.Parameter(torch.zeros(h, h), requires_grad=False)))
    muon, adamw = muon_split(named)
    assert [n for n, _ in muon] == ["layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight", "fc.weight",
                                    "kernel_projection.weight", "hidden_projection.weight"]
    assert [n for n, _ in adamw] == ["candidate_selector.token_codebook", "markov_w1.weight", "markov_w2.weight",
                                     "embed_tokens.weight", "lm_head.weight", "base_kernel",
                                     "layers.0.input_layernorm.weight", "fc.bias", "gate.weight", "scale"]


class Mixed(nn.Module):
    """Two hidden matrices (Muon) and a norm, a bias and a table (AdamW)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.up_proj = nn.Parameter(torch.randn(40, 24, generator=gen) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(24, 40, generator=gen) * 0.2)
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(24, generator=gen))
        self.bias = nn.Parameter(0.1 * torch.randn(40, generator=gen))
        self.markov_w1 = nn.Parameter(0.1 * torch.randn(10, 6, generator=gen))


MUON_NAMES = ("up_proj", "down_proj")


def _ours(master: bool, seed: int = 0, total_steps: int = 100, **cfg):
    model = Mixed(seed)
    settings = dict(name="muon", lr=LR, weight_decay=ADAMW_DECAY, warmup_ratio=0.0) | cfg
    opt, sched = build_optimizer(model.named_parameters(), OptimConfig(**settings), total_steps, master_weights=master)
    apply_precision(model, param_dtype(opt))
    return model, opt, sched


def _grads(step: int, model: nn.Module, bad: bool = False) -> list[torch.Tensor]:
    """bf16-valued gradients (both sides see the same numbers), large and small steps alternating."""
    gen = torch.Generator().manual_seed(100 + step)
    grads = [(torch.randn(p.shape, generator=gen) * (3.0 if step % 2 else 1e-3)).bfloat16() for p in model.parameters()]
    if bad:
        grads[0].view(-1)[0] = float("nan")
    return grads


def _our_step(model, opt, step: int, bad: bool = False) -> None:
    for p, g in zip(model.parameters(), _grads(step, model, bad)):
        p.grad = g.to(p.dtype)
    params = list(model.parameters())
    norm = total_grad_norm([p.grad for p in params])
    clip_and_step(opt, params, 1.0, health_flags(torch.zeros(1), norm)[0], norm)
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("master", [True, False])
def test_the_update_is_torch_muon_and_adamw_on_float32_parameters(master):
    """The reference: torch.optim.Muon (match_rms_adamw, decay 0.1) and torch.optim.AdamW on a
    float32 copy, fed the same clipped gradients, the lr changed every step through our
    param_groups. Muon's part is equal bit for bit (the float32 masters are the reference's
    parameters); AdamW's to MasterWeightAdamW's rounding; the bf16 weights are the masters rounded."""
    lrs = [1e-2, 5e-3, 2e-2, 1e-3, 1e-2, 3e-3]
    model, opt = _ours(master, muon_iteration="newton_schulz")[:2]
    ref = Mixed()
    ref_muon = torch.optim.Muon([ref.up_proj, ref.down_proj], lr=LR, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    ref_adamw = torch.optim.AdamW([ref.norm, ref.bias, ref.markov_w1], lr=LR, betas=(0.9, 0.95),
                                  weight_decay=ADAMW_DECAY)
    for step, lr in enumerate(lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        _our_step(model, opt, step)
        grads = _grads(step, model)
        divisor = ((total_grad_norm(grads) + 1e-6) / 1.0).clamp(min=1.0)
        for p, g in zip(ref.parameters(), grads):
            p.grad = g.float() / divisor
        for ref_opt in (ref_muon, ref_adamw):
            ref_opt.param_groups[0]["lr"] = lr
            ref_opt.step()
    with full_precision_weights(opt):
        ours = dict(model.named_parameters())
        for name, want in ref.named_parameters():
            if name in MUON_NAMES:
                assert torch.equal(ours[name], want), name
            else:
                torch.testing.assert_close(ours[name], want, rtol=1e-5, atol=1e-6)
            assert ours[name].dtype == torch.float32 and (ours[name] - Mixed().get_parameter(name)).abs().max() > 1e-3
    for name, p in model.named_parameters():
        assert p.dtype == (torch.bfloat16 if master else torch.float32)
    if master:
        for p, master_weight in zip(opt.params, opt.masters):
            assert torch.equal(p, master_weight.bfloat16())
    for p, q in zip(opt.muon.param_groups[0]["params"], ref_muon.param_groups[0]["params"]):
        assert torch.equal(opt.muon.state[p]["momentum_buffer"], ref_muon.state[q]["momentum_buffer"])


def _snapshot(model, opt) -> list[torch.Tensor]:
    """Every number the optimizer keeps: weights, masters, Muon's momentum, AdamW's moments and steps."""
    tensors = [p.detach().clone() for p in model.parameters()] + [m.clone() for m in opt.masters or []]
    for part in (opt.muon, opt.adamw):
        for state in part.state.values():
            tensors += [v.clone() for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    return tensors


@pytest.mark.parametrize("master", [True, False])
@pytest.mark.parametrize("bad_first", [False, True])
def test_a_non_finite_step_leaves_weights_and_all_state_untouched(master, bad_first):
    """good, BAD, good, good == good, good, good with the same gradients, bit for bit, momentum
    buffers included (and a bad first step, before any state exists)."""
    model, opt = _ours(master)[:2]
    ref_model, ref_opt = _ours(master)[:2]
    good = [1, 2, 3]
    if not bad_first:
        _our_step(model, opt, good[0])
        _our_step(ref_model, ref_opt, good[0])
    before = _snapshot(model, opt)
    _our_step(model, opt, 99, bad=True)
    after = _snapshot(model, opt)
    if bad_first and not master:  # torch's AdamW creates its state (zeros, count 0) on its first call
        after = after[:len(before)]
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    for step in good[0 if bad_first else 1:]:
        _our_step(model, opt, step)
        _our_step(ref_model, ref_opt, step)
    got, want = _snapshot(model, opt), _snapshot(ref_model, ref_opt)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(got[0], before[0])  # the good steps did move the weights


@pytest.mark.parametrize("master", [True, False])
@pytest.mark.parametrize("iteration", ["gram", "gram_symmetric", "newton_schulz"])
def test_resume_equals_the_uninterrupted_run(master, iteration):
    """6 steps against 3, a checkpoint (the float32 weights, the optimizer and scheduler states
    through torch.save / torch.load(weights_only=True), as the Checkpointer stores them) into a
    fresh model of other weights, then 3 more: equal bit for bit, for the Gram form (Mixed's [40, 24]
    matrices take it), its symmetric products (optim.muon_gram_blocks' default) and the standard form. The warm-up moves the lr every step, so a loaded Muon part
    that stopped following the scheduler would differ."""
    settings = dict(total_steps=12, warmup_ratio=0.5, muon_iteration=iteration)
    whole, opt_whole, sched_whole = _ours(master, **settings)
    for step in range(6):
        _our_step(whole, opt_whole, step)
        sched_whole.step()
    first, opt_first, sched_first = _ours(master, **settings)
    for step in range(3):
        _our_step(first, opt_first, step)
        sched_first.step()
    with full_precision_weights(opt_first):
        saved_weights = {k: v.clone() for k, v in first.state_dict().items()}
    buffer = io.BytesIO()
    torch.save({"optimizer": opt_first.state_dict(), "scheduler": sched_first.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    second, opt_second, sched_second = _ours(master, seed=1, **settings)
    with full_precision_weights(opt_second):
        second.load_state_dict(saved_weights)
    opt_second.load_state_dict(saved["optimizer"])
    sched_second.load_state_dict(saved["scheduler"])
    for step in range(3, 6):
        _our_step(second, opt_second, step)
        sched_second.step()
    got, want = _snapshot(second, opt_second), _snapshot(whole, opt_whole)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert opt_second.muon.gram == iteration.startswith("gram") and uses_gram(24, 40, 5)
    assert opt_second.muon.blocks == (OptimConfig().muon_gram_blocks if iteration == "gram_symmetric" else 1)
    assert [g["lr"] for g in opt_second.muon.param_groups + opt_second.adamw.param_groups] == \
        [g["lr"] for g in opt_whole.param_groups]


def test_one_schedule_scales_both_parts_and_the_settings_are_the_recipes():
    model, opt, sched = _ours(True, total_steps=10, warmup_ratio=0.5, muon_weight_decay=0.05)
    assert isinstance(opt, MuonAdamW) and param_dtype(opt) == torch.bfloat16
    for step in range(3):
        want = LR * lr_factor(step, 10, 0.5, 0.0)
        assert opt.muon.param_groups[0]["lr"] == pytest.approx(want)
        assert opt.adamw.param_groups[0]["lr"] == pytest.approx(want)
        _our_step(model, opt, step)
        sched.step()
    group = opt.muon.param_groups[0]
    assert (group["adjust_lr_fn"], group["nesterov"], group["momentum"], group["ns_steps"], group["weight_decay"]) == \
        ("match_rms_adamw", True, 0.95, 5, 0.05)
    assert opt.adamw.param_groups[0]["weight_decay"] == ADAMW_DECAY
    assert {"lr", "weight_decay", "momentum", "nesterov", "ns_steps", "adjust_lr_fn"} <= \
        set(inspect.signature(torch.optim.Muon).parameters)  # what train/optim/muon.py passes, on this torch


def test_an_adamw_checkpoint_is_refused_by_name_and_unnamed_parameters_too():
    model, opt = _ours(False)[:2]
    adamw_state = torch.optim.AdamW(Mixed().parameters()).state_dict()
    with pytest.raises(ValueError, match="optim.name=muon cannot resume"):
        opt.load_state_dict(adamw_state)
    with pytest.raises(ValueError, match="named_parameters"):
        build_optimizer(Mixed().parameters(), OptimConfig(name="muon"), 10)


# --- a whole training run --------------------------------------------------------------------------

@pytest.fixture
def target_dir(smollm2_tokenizer, tmp_path_factory):
    return save_tiny_qwen3_dir(tmp_path_factory.mktemp("muon_target"), smollm2_tokenizer, init_std=TARGET_INIT_STD)


def test_a_muon_run_resumes_onto_its_uninterrupted_trajectory(target_dir, tmp_path, contained, capsys):
    """The golden run's configuration with optim.name=muon: it trains (the loss moves), logs the split
    once, and a run stopped after its first checkpoint resumes onto the uninterrupted trajectory."""
    whole = tmp_path / "whole"
    result = train(golden_config(target_dir, whole, "optim.name=muon"))
    want = trajectory(whole, result)
    out = capsys.readouterr().out
    assert out.count("optim: Muon  8 tensors") == 1 and "optim: AdamW 6 tensors" in out
    assert out.count("optim: Muon orthogonalises 8 matrices a step: ") == 1
    losses = [r["loss"] for r in want["train"].values()]
    assert losses[-1] < losses[0] - 0.5
    cut = tmp_path / "cut"
    contained.setenv("DFLASH_INJECT_FAULT", f"raise:rank=0:step={CKPT_EVERY + 1}")
    with pytest.raises(RuntimeError, match="injected fault"):
        train(golden_config(target_dir, cut, "optim.name=muon"))
    contained.delenv("DFLASH_INJECT_FAULT")
    assert "DFLASH_INJECT_FAULT" not in os.environ
    resumed = train(golden_config(target_dir, cut, "optim.name=muon", "train.resume=true"))
    assert resumed["steps"] == STEPS
    problems = differences(trajectory(cut, resumed), want)
    assert not problems, "\n".join(problems[:20])
