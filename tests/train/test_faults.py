"""The non-finite guard: a step whose loss or gradient norm is not finite is not applied.

What "not applied" means, exactly: the step consumes its data and its step number (the lr
schedule moves on), and leaves the drafter's weights and the optimizer's state (moments, step
counts) bit for bit as they were. The reference is a run whose same step is left out on the host
(`DFLASH_INJECT_FAULT=skip:...`: no optimizer call at all), so the injected run (a NaN in one tap
of one micro-batch, `nan:...`) must end with the same weights and optimizer state, bit for bit.
"""

import json
import subprocess

import pytest
import torch
from golden.loop_golden import golden_config
from safetensors.torch import load_file
from test_pipeline import env, train_cmd

from dflash_train.train.watch.health import BadStepGuard, FaultPlan, NonFiniteSteps
from dflash_train.train.loop import train
from dflash_train.train.optim.optimizer import MasterWeightAdamW
from dflash_train.train.step import clip_and_step, health_flags

STEPS, NAN_STEP = 6, 3




# --- the optimizers: a skipped step leaves weights and state exactly as they were ---------------

def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))


def _optimizer(kind, model):
    if kind == "master":
        opt = MasterWeightAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        for p in model.parameters():
            p.data = p.data.bfloat16()
        return opt
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                             fused=kind == "fused")


def _set_grads(model, seed, bad=False):
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        if bad:
            p.grad.view(-1)[0] = float("nan")


def _step(model, opt, seed, bad=False):
    _set_grads(model, seed, bad)
    params = list(model.parameters())
    norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in params]))
    clip_and_step(opt, params, 1.0, health_flags(torch.zeros(1), norm)[0])
    opt.zero_grad(set_to_none=True)


def _snapshot(model, opt):
    weights = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    return weights, state


def _assert_same(a, b):
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    for sx, sy in zip(a[1], b[1]):
        assert sx.keys() == sy.keys() and all(torch.equal(sx[k], sy[k]) for k in sx)


@pytest.mark.parametrize("kind", ["foreach", "fused", "master"])
@pytest.mark.parametrize("bad_first", [False, True])
def test_a_non_finite_step_leaves_weights_and_optimizer_state_untouched(kind, bad_first):
    """good, BAD, good, good == good, good, good with the same gradients, bit for bit (and a bad
    first step, before any state exists beyond the initial one)."""
    model, opt = _model(), None
    opt = _optimizer(kind, model)
    ref_model = _model()
    ref_opt = _optimizer(kind, ref_model)
    seeds = [1, 2, 3]
    if not bad_first:
        _step(model, opt, seeds[0])
        _step(ref_model, ref_opt, seeds[0])
    before = _snapshot(model, opt)
    _step(model, opt, 99, bad=True)
    after = _snapshot(model, opt)
    if bad_first and kind != "master":  # torch's AdamW creates its state on the first step: zeros, count 0
        before = (before[0], [{k: torch.zeros_like(v) for k, v in state.items()} for state in after[1]])
    _assert_same(after, before)  # nothing moved: weights, moments, step count
    for seed in seeds[0 if bad_first else 1:]:
        _step(model, opt, seed)
        _step(ref_model, ref_opt, seed)
    _assert_same(_snapshot(model, opt), _snapshot(ref_model, ref_opt))
    assert not torch.equal(_snapshot(model, opt)[0][0], before[0][0])  # the good steps did move them


def test_health_flags_name_the_bad_micro_batch_and_the_norm():
    assert health_flags(torch.tensor([1.0, 2.0]), torch.tensor(3.0)).tolist() == [0, 0, 0]
    assert health_flags(torch.tensor([1.0, float("nan")]), torch.tensor(3.0)).tolist() == [1, 0, 1]
    assert health_flags(torch.tensor([float("inf"), 1.0]), torch.tensor(3.0)).tolist() == [1, 1, 0]
    assert health_flags(torch.tensor([1.0, 2.0]), torch.tensor(float("inf"))).tolist() == [1, 0, 0]


def test_fault_plan_parses_kinds_and_counts_and_refuses_typos(monkeypatch):
    monkeypatch.setenv("DFLASH_INJECT_FAULT", "nan:rank=2:step=3:count=2")
    plan = FaultPlan.from_env()
    assert (plan.kind, plan.rank, plan.step, plan.count) == ("nan", 2, 3, 2)
    assert [plan._hits("nan", s) for s in (2, 3, 4, 5)] == [False, True, True, False]
    for bad in ("nan:rank=x", "nap:rank=0:step=1", "nan:rnak=0:step=1"):
        monkeypatch.setenv("DFLASH_INJECT_FAULT", bad)
        with pytest.raises(ValueError, match="DFLASH_INJECT_FAULT"):
            FaultPlan.from_env()


def test_guard_counts_streaks_and_stops_at_the_limit():
    lines = []
    guard = BadStepGuard(rank=1, max_consecutive=2, log=lines.append)

    class MB:
        def __init__(self, ids):
            self.ids = ids

    guard.record(1, [MB(["a"]), MB(["b"])], torch.tensor([0.0, 0.0, 0.0]))
    guard.record(2, [MB(["c"]), MB(["d"])], torch.tensor([1.0, 0.0, 1.0]))
    guard.record(3, [MB(["e"]), MB(["f"])], torch.tensor([0.0, 0.0, 0.0]))
    assert guard.check() == 1 and guard.streak == 0 and guard.total == 1
    assert "step 2" in lines[0] and "rank 1" in lines[0] and "['d']" in lines[0]
    guard.record(4, [MB(["g"])], torch.tensor([1.0, 1.0]))
    guard.record(5, [MB(["h"])], torch.tensor([1.0, 0.0]))
    with pytest.raises(NonFiniteSteps, match="2 consecutive"):
        guard.check()


# --- the loop, colocated (this process) -----------------------------------------------------

def _cfg(target_dir, out, *extra):
    return golden_config(target_dir, out, f"train.max_steps={STEPS}", "train.ckpt_every=1", "train.keep_last=20",
                         "train.eval_every=100", "drafter.num_taps=3", *extra)


def _checkpoint(out, step):
    path = out / "checkpoints" / f"step_{step:08d}"
    weights = load_file(str(path / "drafter" / "model.safetensors"))
    trainer = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    return weights, trainer["optimizer"]["state"]


def _assert_checkpoints_equal(a, b):
    assert a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
    assert a[1].keys() == b[1].keys()
    for i in a[1]:
        assert all(torch.equal(a[1][i][k], b[1][i][k]) for k in a[1][i])


def _records(out):
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


def test_colocated_nan_step_is_skipped_and_equals_a_run_without_that_step(tiny_qwen3_dir, tmp_path, contained,
                                                                        capsys):
    injected, reference = tmp_path / "nan", tmp_path / "skip"
    contained.setenv("DFLASH_INJECT_FAULT", f"nan:rank=0:step={NAN_STEP}")
    train(_cfg(tiny_qwen3_dir, injected))
    log = capsys.readouterr().out
    contained.setenv("DFLASH_INJECT_FAULT", f"skip:rank=0:step={NAN_STEP}")
    train(_cfg(tiny_qwen3_dir, reference))
    assert f"step {NAN_STEP}: non-finite loss or gradient norm, update skipped (rank 0: micro-batch 0 samples" in log
    records = _records(injected)
    assert records[NAN_STEP]["loss"] != records[NAN_STEP]["loss"]  # NaN: the step really was non-finite
    assert records[NAN_STEP]["skipped_steps"] == 1 and records[STEPS]["skipped_steps"] == 1
    # the skipped step changed nothing; the steps after it trained
    _assert_checkpoints_equal(_checkpoint(injected, NAN_STEP - 1), _checkpoint(injected, NAN_STEP))
    after = _checkpoint(injected, NAN_STEP + 1)
    assert not all(torch.equal(after[0][k], v) for k, v in _checkpoint(injected, NAN_STEP)[0].items())
    # and the run ends where a run that left that step out ends, bit for bit
    _assert_checkpoints_equal(_checkpoint(injected, STEPS), _checkpoint(reference, STEPS))
    assert _records(reference)[STEPS]["loss"] == records[STEPS]["loss"]


def test_consecutive_non_finite_steps_stop_the_run_before_another_checkpoint(tiny_qwen3_dir, tmp_path, contained):
    out = tmp_path / "run"
    contained.setenv("DFLASH_INJECT_FAULT", f"nan:rank=0:step={NAN_STEP}:count=10")
    with pytest.raises(NonFiniteSteps, match="2 consecutive non-finite steps .*step_00000003"):
        train(_cfg(tiny_qwen3_dir, out, "train.max_bad_steps=2"))
    steps = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert steps[-1] == f"step_{NAN_STEP:08d}"  # the first bad step's checkpoint holds good weights; no later one
    _assert_checkpoints_equal(_checkpoint(out, NAN_STEP - 1), _checkpoint(out, NAN_STEP))


# --- disaggregated: 1 target rank + 2 drafter ranks (DDP, gloo) ----------------------------------

def _run(nproc, target, out, fault):
    args = ["--recipe", "tiny", f"target.model={target}", "data.train=chitchat", "data.regenerate=false",
            "data.max_samples=80", "data.max_len=128", f"train.max_steps={STEPS}", "train.seqs_per_step=4",
            "train.ckpt_every=100", "train.eval_every=100", "train.log_every=2", "drafter.num_taps=3",
            "topology.mode=disaggregated",
            "topology.target_ranks=1", "eval.num_prompts=0", f"train.out_dir={out}"]
    return subprocess.run(train_cmd(nproc) + args, env=env(DFLASH_INJECT_FAULT=fault), timeout=400,
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def skipped_reference(tiny_qwen3_dir, tmp_path_factory):
    """The disaggregated run that leaves step NAN_STEP out on the host: both tests below end on it."""
    reference = tmp_path_factory.mktemp("skip")
    ref = _run(3, tiny_qwen3_dir, reference, f"skip:rank=0:step={NAN_STEP}")
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    return reference


@pytest.mark.slow
def test_disaggregated_nan_sent_by_the_target_rank_is_caught_and_skipped(tiny_qwen3_dir, skipped_reference, tmp_path):
    """Target rank 0 serves every micro-batch; its first one of the step goes to drafter rank 1."""
    injected = tmp_path / "nan"
    proc = _run(3, tiny_qwen3_dir, injected, f"nan:rank=0:step={NAN_STEP}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"step {NAN_STEP}: non-finite loss or gradient norm, update skipped (rank 1: micro-batch" in proc.stdout
    _assert_checkpoints_equal(_checkpoint(injected, STEPS), _checkpoint(skipped_reference, STEPS))


@pytest.mark.slow
def test_disaggregated_nan_on_one_drafter_rank_is_skipped_by_all(tiny_qwen3_dir, skipped_reference, tmp_path):
    injected = tmp_path / "nan"
    proc = _run(3, tiny_qwen3_dir, injected, f"nan:rank=2:step={NAN_STEP}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"[rank 2] step {NAN_STEP}: non-finite loss or gradient norm, update skipped (rank 2: micro-batch" \
        in proc.stdout
    assert f"step {NAN_STEP}: non-finite loss or gradient norm, update skipped (rank 1: a finite loss here" \
        in proc.stdout  # the other drafter rank skipped the same step
    _assert_checkpoints_equal(_checkpoint(injected, STEPS), _checkpoint(skipped_reference, STEPS))
