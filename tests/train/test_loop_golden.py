"""`train(cfg)` in this process, against a stored trajectory: the per-step loss, accuracies, grad
norm and lr and the held-out simulated tau of a small real run (tests/golden/loop_golden.py) must
match tests/golden/train_loop.json. Any change to the step, the data order, the schedule, the
sources of taps or resume shows here as a named step and figure. Regenerate the file only for an
intended change: `python tests/golden/regenerate.py`.

Sensitivity, measured by hand (2026-12-01, scratch runs through `differences`): optim.lr +1% moved
15 of 16 losses, by up to 2.9e-4 relative, and every grad norm by up to 8e-3; optim.betas
(0.9, 0.95) -> (0.9, 0.96) moved 13 losses by up to 1.2e-4: 10x-30x the tolerance (RTOL 1e-5).
"""

import json
import os
import time

import pytest

from dflash_train.train.loop import train
from dflash_train.train.state import checkpoint
from tests.conftest import save_tiny_qwen3_dir
from tests.golden.loop_golden import (CKPT_EVERY, STEPS, TARGET_INIT_STD, differences, golden_config, load_golden,
                                      trajectory)

KEPT = ("train", "held_out", "steps", "tokens")


@pytest.fixture(autouse=True)
def _contained(contained):
    """Every golden run is contained (tests/train/conftest.py)."""
    yield


@pytest.fixture(scope="module")
def target_dir(smollm2_tokenizer, tmp_path_factory):
    return save_tiny_qwen3_dir(tmp_path_factory.mktemp("golden_target"), smollm2_tokenizer, init_std=TARGET_INIT_STD)


def golden() -> dict:
    stored = load_golden()
    return {k: stored[k] for k in KEPT}


def assert_matches_golden(got: dict) -> None:
    want = golden()
    assert len({r["loss"] for r in want["train"].values()}) > 1  # the loss moves: the comparison is not vacuous
    problems = differences(got, want)
    assert not problems, "trajectory differs from tests/golden/train_loop.json:\n" + "\n".join(problems[:20])


def test_training_reproduces_the_golden_trajectory(target_dir, tmp_path):
    out = tmp_path / "run"
    result = train(golden_config(target_dir, out))
    assert result["steps"] == STEPS and (out / "drafter" / "config.json").is_file()
    assert_matches_golden(trajectory(out, result))
    assert_best_is_an_evaluated_checkpoint(out, result)


def assert_best_is_an_evaluated_checkpoint(out, result: dict) -> None:
    """A checkpoint carries the held-out tau of its own weights or none (step 2 * CKPT_EVERY = 12 is saved
    between the evals of steps 8 and 16), so `best` can only point at an evaluated step."""
    root = out / "checkpoints"
    meta = {int(p.name.split("_")[1]): json.loads((p / "meta.json").read_text()) for p in root.glob("step_*")}
    held_out = trajectory(out, result)["held_out"]
    assert 2 * CKPT_EVERY in meta and all(meta[step]["sim_tau"] is None for step in meta if step != STEPS)
    assert meta[STEPS]["sim_tau"] == pytest.approx(held_out[str(STEPS)]["sim_tau"])
    assert (root / "best").resolve().name == f"step_{STEPS:08d}"


def test_a_run_stopped_after_a_checkpoint_resumes_onto_the_golden_trajectory(target_dir, tmp_path, monkeypatch):
    """A failure one step after the first checkpoint, then `train.resume=true`: the metrics file
    (cut back to the checkpoint on resume) reads as the uninterrupted golden run. The checkpoint is written
    beside the training and slowed to ~1 s here: the error waits for it, so the resume finds it whole."""
    out = tmp_path / "run"
    monkeypatch.setenv("DFLASH_INJECT_FAULT", f"raise:rank=0:step={CKPT_EVERY + 1}")
    real = checkpoint.save_trainer
    monkeypatch.setattr(checkpoint, "save_trainer", lambda *args: (time.sleep(1.0), real(*args)))
    with pytest.raises(RuntimeError, match="injected fault"):
        train(golden_config(target_dir, out))
    assert (out / "checkpoints" / f"step_{CKPT_EVERY:08d}").is_dir()
    monkeypatch.setattr(checkpoint, "save_trainer", real)
    monkeypatch.delenv("DFLASH_INJECT_FAULT")
    assert "DFLASH_INJECT_FAULT" not in os.environ
    result = train(golden_config(target_dir, out, "train.resume=true"))
    assert_matches_golden(trajectory(out, result))
