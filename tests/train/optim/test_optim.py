import math

import pytest
import torch

from dflash_train.config import OptimConfig
from dflash_train.train.optim.optimizer import (DECIDE_AFTER, MEASURE_AFTER, MasterWeightAdamW, TimeBudget,
                                                build_optimizer, full_precision_weights, lr_factor, param_dtype)
from dflash_train.train.parallel.parallelize import apply_precision
from dflash_train.train.step import clip_and_step


def test_cosine_ends_at_the_recorded_budget_decision():
    assert lr_factor(0, 100, 0.1, 0.0) == pytest.approx(0.1)  # warm-up over 10% of the configured total
    assert lr_factor(55, 100, 0.1, 0.0) == pytest.approx(0.5)  # progress 0.5 of the configured steps
    assert lr_factor(0, 100, 0.1, 0.0, steps=40) == pytest.approx(0.25)  # warm-up over 10% of the decided steps
    assert lr_factor(22, 100, 0.1, 0.0, steps=40) == pytest.approx(0.5)  # progress 0.5 of the decided steps
    assert lr_factor(39, 100, 0.1, 0.1, steps=40) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(35 / 36 * math.pi)))
    assert lr_factor(60, 100, 0.1, 0.1, steps=40) == pytest.approx(0.1)  # past the decision: the floor


def test_warm_up_is_a_share_of_the_run_a_budget_decides():
    """An epoch count that a budget cuts to 1/10 (the `gpu` recipe's case) warms up over 4 % of the
    decided steps, not of the nominal ones; before the decision the nominal warm-up applies, so the
    lr steps up once at the decision and rises monotonically through it."""
    nominal, decided, at = 13_000, 1_300, 30
    before = [lr_factor(s, nominal, 0.04, 0.0) for s in range(at)]
    after = [lr_factor(s, nominal, 0.04, 0.0, steps=decided) for s in range(at, 200)]
    assert after[52 - at - 1] == pytest.approx(1.0)  # warm-up ends at step 52 = 4 % of 1,300
    assert all(a < b for a, b in zip(before, before[1:])) and before[-1] < after[0]
    assert max(after) == pytest.approx(1.0) and after[-1] < 1.0  # then the cosine over the decided steps


class FakeClock:
    """perf_counter stand-in: the budget's decision is then exact arithmetic."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_time_budget_decides_the_steps_from_the_measured_rate(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("dflash_train.train.optim.optimizer.time.perf_counter", clock)
    budget = TimeBudget(1.0, total_steps=1000, decide_after=3)  # 60 s
    budget.start(step=0)
    proposals = []
    for step, seconds in zip(range(1, 6), (20.0, 2.0, 2.0, 2.0, 2.0)):  # step 1 compiles
        clock.now += seconds
        proposals.append(budget.propose(step))
    assert proposals[:2] == [None, None] and proposals[3:] == [None, None]  # decided once, at step 3
    assert proposals[2] == 3 + (60 - 24) // 2  # 2 s per step over steps 2-3, 36 s left
    budget.record(proposals[2])
    assert budget.propose(6) is None and budget.steps == 21
    assert not budget.spent()
    clock.now += 40.0
    assert budget.spent()  # the clock still ends the run


def test_time_budget_leaves_the_warm_up_steps_out_of_its_rate(monkeypatch):
    """A GPU run's first steps compile and autotune (seconds each): measured on an H200, deciding from
    them ended a 90-second budget after 26 seconds. The rate comes from the steps after MEASURE_AFTER."""
    clock = FakeClock()
    monkeypatch.setattr("dflash_train.train.optim.optimizer.time.perf_counter", clock)
    budget = TimeBudget(1.0, total_steps=10_000)  # 60 s, the default DECIDE_AFTER / MEASURE_AFTER
    budget.start(step=0)
    proposal = None
    for step in range(1, DECIDE_AFTER + 1):
        clock.now += 2.0 if step <= MEASURE_AFTER else 0.1
        proposal = budget.propose(step) or proposal
    spent = MEASURE_AFTER * 2.0 + (DECIDE_AFTER - MEASURE_AFTER) * 0.1
    assert abs(proposal - (DECIDE_AFTER + (60 - spent) / 0.1)) <= 1  # +-1: the floor of a float quotient


def test_time_budget_without_minutes_never_decides_and_never_runs_out():
    budget = TimeBudget(None, total_steps=10)
    budget.start(0)
    assert [budget.propose(s) for s in range(1, 11)] == [None] * 10 and not budget.spent()
    assert TimeBudget(1e-9, total_steps=10).spent()


def test_a_resumed_budget_keeps_its_decision_and_its_spent_seconds(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("dflash_train.train.optim.optimizer.time.perf_counter", clock)
    first = TimeBudget(10.0, total_steps=500)
    first.record(321)
    same, larger = TimeBudget(10.0, total_steps=500), TimeBudget(20.0, total_steps=500)
    same.load_state_dict(first.state_dict())
    larger.load_state_dict(first.state_dict())
    assert same.steps == 321 and larger.steps is None  # another budget decides again
    same.start(step=100, already_spent_s=450.0)
    assert not same.spent()
    clock.now += 151.0
    assert same.spent()
    assert same.propose(101) is None  # decided: no new measurement


def _budgeted_run(clock: FakeClock, budget: TimeBudget, revise: bool, eval_every: int = 50, eval_s: float = 5.0
                  ) -> tuple[int, int, int]:
    """The loop's order with a fake clock: 1 s steps, a held-out eval of `eval_s` every `eval_every`
    steps, then the revision (before the checkpoint). Returns (first decision, last plan, steps run)."""
    budget.start(step=0)
    step, first = 0, None
    while budget.steps is None or step < budget.steps:
        step += 1
        clock.now += 1.0
        decided = budget.propose(step)
        if decided is not None:
            budget.record(decided)
            first = decided
        if budget.spent():
            break
        if step % eval_every == 0:
            clock.now += eval_s
            revised = budget.revise(step) if revise else None
            if revised is not None:
                budget.record(revised)
    return first, budget.steps, step


def test_a_revised_budget_ends_its_cosine_where_the_clock_ends_the_run(monkeypatch):
    """Steps 11-30 hold no held-out eval, so the decision at step 30 plans more steps than the clock
    allows and the cosine is cut (the `gpu` recipe on an H100: 4,552 of 5,255): the revisions at the
    evals bring the plan down to the steps the budget really holds, at or just before the clock's end."""
    clock = FakeClock()
    monkeypatch.setattr("dflash_train.train.optim.optimizer.time.perf_counter", clock)
    first, plan, ran = _budgeted_run(clock, TimeBudget(200 / 60, total_steps=10_000), revise=False)
    assert first == plan == 200 and ran == 186  # 15 s of evals: the clock stopped it at 93 % of its cosine
    first, plan, ran = _budgeted_run(clock, TimeBudget(200 / 60, total_steps=10_000), revise=True)
    assert first == 200 and ran == plan and 0.95 * 186 <= plan <= 186  # the cosine ran its whole length


def test_a_budget_revises_only_after_its_decision_and_never_below_the_next_step(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("dflash_train.train.optim.optimizer.time.perf_counter", clock)
    assert TimeBudget(None, total_steps=10).revise(50) is None
    budget = TimeBudget(1.0, total_steps=1000)
    budget.start(step=0)
    for step in range(1, DECIDE_AFTER + 1):
        clock.now += 1.0
        assert budget.revise(step) is None  # nothing decided yet
        decided = budget.propose(step)
    budget.record(decided)
    clock.now += 100.0  # out of time
    assert budget.revise(DECIDE_AFTER + 1) == DECIDE_AFTER + 2
    resumed = TimeBudget(1.0, total_steps=1000)
    resumed.load_state_dict(budget.state_dict())
    resumed.start(step=500, already_spent_s=30.0)
    assert resumed.revise(505) is None  # the resumed process has not measured its rate yet
    for step in range(501, 541):
        clock.now += 0.5
        resumed.propose(step)
    assert resumed.revise(540) == 540 + 20  # 0.5 s per step since step 510; 30 + 20 s spent, 10 s left


def test_a_budget_says_when_the_epochs_not_the_minutes_end_the_run(monkeypatch):
    """Session 29's 20-minute run on 30,000 prompts: its 30 epochs were done at 19.0 of its 20 minutes, and the
    line said only "allows 26580 steps". The epochs' cap is now named with the steps the clock would allow."""
    clock = FakeClock()
    monkeypatch.setattr("dflash_train.train.optim.optimizer.time.perf_counter", clock)
    capped = TimeBudget(1.0, total_steps=40, decide_after=3)  # 60 s at 1 s a step: the clock allows 60 steps
    clocked = TimeBudget(1.0, total_steps=400, decide_after=3)
    for budget in (capped, clocked):
        budget.start(step=0)
        assert budget.epochs_cap() == ""  # nothing decided yet
        for step in range(1, 4):
            clock.now += 1.0
            decided = budget.propose(step)
        budget.record(decided)
    assert capped.steps == 40 and "train.epochs caps it (the minutes would allow 60)" in capped.epochs_cap()
    assert "~67% of its minutes" in capped.epochs_cap()
    assert clocked.steps == 60 and clocked.epochs_cap() == ""  # the clock sets this one
    capped.record(30)  # another drafter rank proposed fewer: the clock, not the epochs, set the agreed count
    assert capped.epochs_cap() == ""


# --- MasterWeightAdamW: bf16 parameters, float32 masters -----------------------------------------

def _float32_module(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.SiLU(), torch.nn.Linear(40, 6))


def _master_adamw(module: torch.nn.Module, compiled: bool = False) -> MasterWeightAdamW:
    """The optimizer on the float32 module, then the module cast to its param dtype, as the
    trainer does (build_optimizer, then parallelize)."""
    opt = MasterWeightAdamW(module.parameters(), lr=1.0, betas=(0.9, 0.95), weight_decay=0.1, compiled=compiled)
    apply_precision(module, param_dtype(opt))
    return opt


def _bf16_grads(step: int, shapes) -> list[torch.Tensor]:
    """The gradients a bf16 module would produce: bf16 values (both optimizers see the same ones)."""
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=g) * (3.0 if step % 2 else 1e-3)).bfloat16() for s in shapes]


def _run_reference(steps: int, lrs) -> list[torch.Tensor]:
    """torch.optim.AdamW on float32 weights fed the same (bf16-valued) gradients, clip 1.0."""
    model = _float32_module()
    opt = torch.optim.AdamW(model.parameters(), lr=1.0, betas=(0.9, 0.95), weight_decay=0.1)
    for step in range(steps):
        for p, g in zip(model.parameters(), _bf16_grads(step, [p.shape for p in model.parameters()])):
            p.grad = g.float()
        opt.param_groups[0]["lr"] = lrs[step]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _run_master(model, opt, steps: range, lrs=None) -> None:
    """Steps with the same gradients as the reference; lrs=None leaves the lr to a scheduler."""
    for step in steps:
        for p, g in zip(model.parameters(), _bf16_grads(step, [p.shape for p in model.parameters()])):
            p.grad = g
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[step]
        clip_and_step(opt, list(model.parameters()), 1.0)


def test_master_weight_adamw_follows_float32_adamw_and_holds_bf16_weights():
    lrs = [1e-2, 5e-3, 2e-2, 1e-3, 1e-2, 3e-3]
    ref = _run_reference(len(lrs), lrs)
    model = _float32_module()
    opt = _master_adamw(model)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    _run_master(model, opt, range(len(lrs)), lrs)
    start = list(_float32_module().parameters())
    for p, r, s in zip(model.parameters(), ref, start):
        master = opt.state[p]["master"]
        assert master.dtype == torch.float32 and p.dtype == torch.bfloat16
        torch.testing.assert_close(master, r, rtol=1e-5, atol=1e-6)  # the float32 trajectory
        assert torch.equal(p, master.bfloat16())  # the module holds the masters rounded
        assert (r - s).abs().max() > 1e-2  # the steps moved the weights: not a comparison of no-ops


def test_master_weight_adamw_resumes_exactly_and_checkpoints_the_masters():
    lrs = [1e-2, 5e-3, 2e-2, 1e-3, 1e-2, 3e-3]
    whole = _float32_module()
    opt_whole = _master_adamw(whole)
    _run_master(whole, opt_whole, range(6), lrs)

    first = _float32_module()
    opt_first = _master_adamw(first)
    _run_master(first, opt_first, range(3), lrs)
    with full_precision_weights(opt_first):  # what the trainer's checkpoint stores
        weights = {k: v.clone() for k, v in first.state_dict().items()}
    assert all(v.dtype == torch.float32 for v in weights.values())
    assert all(p.dtype == torch.bfloat16 for p in first.parameters())  # restored after the block
    saved = opt_first.state_dict()

    assert all("master" not in s for s in saved["state"].values())  # the weights carry the masters
    second = _float32_module(seed=1)  # other weights: everything must come from the checkpoint
    opt_second = _master_adamw(second)
    with full_precision_weights(opt_second):  # as train/loop.py restores
        second.load_state_dict(weights)
    opt_second.load_state_dict(saved)
    _run_master(second, opt_second, range(3, 6), lrs)
    for p, q in zip(second.parameters(), whole.parameters()):
        assert torch.equal(opt_second.state[p]["master"], opt_whole.state[q]["master"])
        assert opt_second.state[p]["exp_avg_sq"].dtype == torch.float32
        assert torch.equal(p, q)


def test_master_weight_adamw_and_torch_adamw_resume_from_each_other():
    """A run started on the CPU (torch AdamW, float32 weights) can continue on a GPU (master
    weights) and back: same state layout, moments kept in float32."""
    lrs = [1e-2, 5e-3, 2e-2, 1e-3]
    ref = _float32_module()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1.0, betas=(0.9, 0.95), weight_decay=0.1)
    for step in range(2):
        for p, g in zip(ref.parameters(), _bf16_grads(step, [p.shape for p in ref.parameters()])):
            p.grad = g.float()
        opt_ref.param_groups[0]["lr"] = lrs[step]
        clip_and_step(opt_ref, list(ref.parameters()), 1.0)
    moved = _float32_module(seed=2)
    opt = _master_adamw(moved)
    with full_precision_weights(opt):
        moved.load_state_dict(ref.state_dict())
    opt.load_state_dict(opt_ref.state_dict())
    for p, q in zip(moved.parameters(), ref.parameters()):
        assert torch.equal(opt.state[p]["master"], q) and torch.equal(p, q.bfloat16())
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt_ref.state[q]["exp_avg_sq"])
    back = torch.optim.AdamW(_float32_module().parameters(), lr=1.0, betas=(0.9, 0.95), weight_decay=0.1)
    back.load_state_dict(opt.state_dict())
    assert float(back.state_dict()["state"][0]["step"]) == 2.0


def test_build_optimizer_picks_master_weights_and_the_scheduler_drives_its_lr():
    model = _float32_module()
    opt, sched = build_optimizer(model.parameters(), OptimConfig(lr=1e-3, warmup_ratio=0.5), 10, master_weights=True)
    assert isinstance(opt, MasterWeightAdamW) and param_dtype(opt) == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the optimizer leaves the module's dtype
    apply_precision(model, param_dtype(opt))
    cpu_default, _ = build_optimizer(_float32_module().parameters(), OptimConfig(), 10)
    assert type(cpu_default) is torch.optim.AdamW  # CPU training stays float32 whatever the setting
    assert param_dtype(cpu_default) is None
    lrs = []
    for step in range(3):
        lrs.append(opt.param_groups[0]["lr"])
        _run_master(model, opt, [step])
        sched.step()
    assert lrs == pytest.approx([2e-4, 4e-4, 6e-4])  # linear warm-up over 5 steps


def test_compiled_master_update_matches_eager_without_recompiling_as_the_lr_moves():
    """The update the GPU runs (compiled) against the eager loop; the lr changes every step and
    lives in a tensor, so one graph serves them all (~15 s of CPU compile)."""
    lrs = [1e-2, 5e-3, 2e-2, 1e-3]
    eager, compiled = _float32_module(), _float32_module()
    opt_eager = _master_adamw(eager)
    opt_compiled = _master_adamw(compiled, compiled=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    _run_master(eager, opt_eager, range(4), lrs)
    _run_master(compiled, opt_compiled, range(4), lrs)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1
    for p, q in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(opt_compiled.state[q]["master"], opt_eager.state[p]["master"], rtol=1e-6, atol=1e-7)
        assert torch.equal(p, q)
