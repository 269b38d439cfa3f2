"""The short CPU version of bench/chaos.py: a 2 + 2 disaggregated job (gloo) whose target rank is
SIGKILLed mid-run ends non-zero naming the dead rank, leaves no half-written checkpoint, and
resumes to the uninterrupted run's final weights (float32 CPU: bit for bit; the check allows
rtol 1e-5). bench/chaos.py runs the same check over random ranks, signals and steps of the 5 + 3
layout (docs/LOG.md has its 20-trial run)."""

import signal
import subprocess

import pytest

from bench.chaos import Layout, env, fault_and_resume, final_weights, job

pytestmark = pytest.mark.slow


def test_a_killed_target_rank_ends_the_job_and_resume_reaches_the_same_weights(tmp_path, capsys):
    layout = Layout(targets=2, drafters=2, steps=8)
    ref = subprocess.run(job(tmp_path / "reference", layout), env=env(), capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    problems = fault_and_resume("trial", tmp_path / "killed", layout, rank=1, sig=signal.SIGKILL, at_step=4,
                                reference=final_weights(tmp_path / "reference"))
    assert problems == []
    out = capsys.readouterr().out
    assert "RESULT trial_bit_exact=True" in out and "exit=0" not in out
