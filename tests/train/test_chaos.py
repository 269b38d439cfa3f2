"""The short CPU version of bench/chaos.py: a 2 + 2 disaggregated job (gloo) whose target rank is
SIGKILLed mid-run ends non-zero with another rank naming the dead one, leaves no half-written
checkpoint; then its latest checkpoint is corrupted (4 KiB of 0xFF in trainer.pt) and the job is
resumed with one drafter rank instead of two: the damaged checkpoint is named, the one before is
taken, and the final weights equal the uninterrupted run's (another reduction order: rtol 1e-4).
bench/chaos.py runs the same checks over random signals, process kinds, steps and damage of the
5 + 3 layout (docs/LOG.md has its 20-trial run)."""

import signal
import subprocess

import pytest

from bench.chaos import Fault, Layout, env, fault_and_resume, final_weights, job

pytestmark = pytest.mark.slow


def test_a_killed_target_rank_then_a_corrupt_checkpoint_and_fewer_drafters_reach_the_same_weights(
        tiny_target_dir, tmp_path, capsys):
    layout = Layout(targets=2, drafters=2, steps=8, target=str(tiny_target_dir),
                    extra=("drafter.num_taps=3", "data.max_len=128"))
    ref = subprocess.run(job(tmp_path / "reference", layout), env=env(), capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    fault = Fault(signal.SIGKILL, "target", at_step=4, damage="corrupt", part="trainer.pt", resume_drafters=1)
    problems = fault_and_resume("trial", tmp_path / "killed", layout, fault, final_weights(tmp_path / "reference"))
    out = capsys.readouterr().out
    assert problems == [], "\n".join(problems) + out[-2000:]
    assert "exit=0" not in out and "RESULT trial_bit_exact" in out
