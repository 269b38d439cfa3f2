"""train.profile_steps (train/watch/profile.py). The golden run (tests/golden/loop_golden.py) with two
profiled steps writes the trace and both summaries, logs one line, and trains exactly as the stored
unprofiled run; the profiler's own failures are one line each and never stop the loop."""

import contextlib
import gzip
import io
import json
import signal

import pytest
import torch

from dflash_train import recipes
from dflash_train.config import RunConfig
from dflash_train.overrides import apply_overrides
from dflash_train.train.loop import train
from dflash_train.train.watch import profile as profile_mod
from dflash_train.train.watch.profile import StepProfiler
from dflash_train.validate import config_problems
from tests.conftest import save_tiny_qwen3_dir
from tests.golden.loop_golden import TARGET_INIT_STD, differences, golden_config, load_golden, trajectory


@pytest.fixture(scope="module")
def profiled_run(smollm2_tokenizer, tmp_path_factory):
    """The golden run with train.profile_steps=2 (steps 4 and 5): its output directory, result and stdout.
    Contained as tests/train/conftest.py `contained` does (inductor's cache, the signal handlers)."""
    root = tmp_path_factory.mktemp("profiled")
    target = save_tiny_qwen3_dir(root / "target", smollm2_tokenizer, init_std=TARGET_INIT_STD)
    out, printed = root / "run", io.StringIO()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
            for var in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE"):
                mp.setenv(var, str(root / "inductor") if var.endswith("DIR") else "1")
            result = train(golden_config(target, out, "train.profile_steps=2"))
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return out, result, printed.getvalue()


def test_the_profiled_steps_are_written_as_a_trace_and_two_summaries(profiled_run):
    out, _, _ = profiled_run
    summary = json.loads((out / "profile" / "summary.json").read_text())
    assert (summary["steps"], summary["first_step"], summary["last_step"]) == (2, 4, 5)
    assert summary["wall_ms_per_step"] > 0 and summary["device"] == "cpu"
    assert summary["device_busy_ms_per_step"] is None and summary["device_idle_share"] is None
    host = summary["host_ms_per_step"]
    assert host["taps"] > 0 and host["train_step"] > host["optimizer"] > 0  # the optimizer runs inside the step
    assert host["forward"] > host["drafter_forward"] > 0 and host["backward"] > 0  # train/step.py's ranges
    assert host["forward"] + host["backward"] + host["optimizer"] <= host["train_step"] * 1.01
    assert host["taps"] + host["train_step"] <= summary["wall_ms_per_step"] * 1.01
    costs = [op["ms_per_step"] for op in summary["top_ops"]]
    assert len(costs) == profile_mod.TOP_OPS and costs == sorted(costs, reverse=True) and costs[0] > 0
    assert not {op["name"] for op in summary["top_ops"]} & {"step 4", "taps", "train_step"}  # ops, not ranges
    assert summary["top_host_ops"] == summary["top_ops"] and summary["device_ops_per_step"] is None  # CPU: the same
    trace = json.loads(gzip.decompress((out / "profile" / "trace.json.gz").read_bytes()))
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"step 4", "step 5", "taps", "train_step"} <= names and "step 6" not in names
    assert "Self CPU" in (out / "profile" / "summary.txt").read_text()


def test_one_readable_line_says_where_the_time_went(profiled_run):
    out, _, printed = profiled_run
    lines = [line for line in printed.splitlines() if line.startswith("profile:")]
    assert len(lines) == 1, printed[-2000:]
    assert lines[0].startswith("profile: steps 4-5: ") and "ms/step wall, device busy n/a (CPU)" in lines[0]
    assert lines[0].endswith(str(out / "profile" / "summary.txt"))


def test_profiling_changes_no_figure_of_the_training(profiled_run):
    """Every step's loss, accuracies, grad norm and lr and the held-out tau equal the stored unprofiled run's."""
    out, result, _ = profiled_run
    want = {k: load_golden()[k] for k in ("train", "held_out", "steps", "tokens")}
    problems = differences(trajectory(out, result), want)
    assert not problems, "\n".join(problems[:20])


def _drive(profiler: StepProfiler, passes: int) -> list[float]:
    """A small training loop instrumented as train/loop.py instruments its own; its losses."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(1, passes + 1):
        profiler.before_step(step)
        with profiler.phase("taps"):
            x = torch.randn(4, 8)
        with profiler.phase("train_step"):
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        profiler.after_step(step)
    profiler.close()
    return losses


def test_a_profiler_that_fails_to_start_is_one_line_and_the_loop_trains_on(tmp_path, monkeypatch):
    unprofiled = _drive(StepProfiler(0, torch.device("cpu"), tmp_path, print), 7)

    def broken(**kwargs):
        raise RuntimeError("kineto is not available\nsecond line")

    monkeypatch.setattr(profile_mod, "profile", broken)
    lines = []
    assert _drive(StepProfiler(2, torch.device("cpu"), tmp_path, lines.append), 7) == unprofiled
    assert lines == ["profile: failed while starting (RuntimeError: kineto is not available); training goes on "
                     "without it"]
    assert not (tmp_path / "profile").exists()


def test_a_profile_that_cannot_be_written_is_one_line_and_leaves_no_profiler_running(tmp_path):
    (tmp_path / "profile").write_text("a file where the directory would go")
    lines = []
    _drive(StepProfiler(2, torch.device("cpu"), tmp_path, lines.append), 7)
    assert len(lines) == 1 and lines[0].startswith("profile: failed while writing (")
    again = []  # the failed one was stopped: a new profiler starts
    _drive(StepProfiler(1, torch.device("cpu"), tmp_path / "again", again.append), 5)
    assert again[0].startswith("profile: steps 4-4: ")


def test_a_run_that_ends_early_writes_what_it_profiled_or_says_it_profiled_nothing(tmp_path):
    lines = []
    _drive(StepProfiler(5, torch.device("cpu"), tmp_path / "short", lines.append), 3)
    assert lines == ["profile: the run ended after 3 steps of this process, before the profile's window "
                     "(it starts after 3): nothing written"]
    lines.clear()
    _drive(StepProfiler(5, torch.device("cpu"), tmp_path / "cut", lines.append), 5)  # steps 4 and 5 of 5 asked
    assert len(lines) == 1 and lines[0].startswith("profile: steps 4-5: ")
    assert json.loads((tmp_path / "cut" / "profile" / "summary.json").read_text())["steps"] == 2


def test_with_a_time_budget_still_to_decide_the_window_waits_for_its_measurement(tmp_path):
    """train.max_minutes measures the step rate over steps 11-30: profiled (slower) steps there would shorten
    the run, so the window opens after the decision; a decided budget (a resume) does not wait."""
    lines = []
    _drive(StepProfiler(2, torch.device("cpu"), tmp_path / "waits", lines.append, budget_undecided=True), 30)
    assert lines == ["profile: the run ended after 30 steps of this process, before the profile's window "
                     "(it starts after 30): nothing written"]
    lines.clear()
    _drive(StepProfiler(2, torch.device("cpu"), tmp_path / "waits2", lines.append, budget_undecided=True), 40)
    assert len(lines) == 1 and lines[0].startswith("profile: steps 31-32: ")
    assert StepProfiler(2, torch.device("cpu"), tmp_path, print).start_after == profile_mod.START_AFTER


def test_profiling_is_off_unless_asked_and_a_negative_count_is_a_config_error():
    assert RunConfig().train.profile_steps == 0
    assert all(recipe().train.profile_steps == 0 for recipe in recipes.RECIPES.values())
    cfg = apply_overrides(recipes.get("tiny"), ["train.profile_steps=-1"])
    assert "train.profile_steps=-1: must be >= 0" in config_problems(cfg)


def test_the_union_of_device_intervals_counts_overlaps_once():
    assert profile_mod._union_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert profile_mod._union_us([]) == 0


def _figures(idle: float) -> dict:
    host_ops = [{"name": "aten::copy_", "ms_per_step": 4.0, "calls_per_step": 470.0},
                {"name": "aten::mm", "ms_per_step": 3.0, "calls_per_step": 179.0}]
    return {"first_step": 31, "last_step": 40, "wall_ms_per_step": 56.9, "device_busy_ms_per_step": 56.9 * (1 - idle),
            "device_idle_share": idle, "device_ops_per_step": 1900.0, "host_ms_per_step": {"taps": 7.4},
            "top_ops_by": "self device time", "top_ops": host_ops[1:], "top_host_ops": host_ops}


def test_the_line_says_host_bound_when_the_device_idles_most_of_the_step(tmp_path):
    """The H100 profile of the `gpu` recipe (docs/PERF.md 8): the device busy 39 % of the step."""
    bound = profile_mod._line(_figures(0.61), tmp_path / "summary.txt")
    assert "device busy 22.2 ms (39%; 1900 kernels and copies)" in bound
    assert "host-bound: the device idles 61% of the step" in bound and "aten::copy_ x470" in bound
    assert "host-bound" not in profile_mod._line(_figures(0.2), tmp_path / "summary.txt")

