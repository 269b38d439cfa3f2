"""The short CPU version of bench/chaos.py: a 1 + 2 disaggregated job (gloo) whose target rank is
SIGKILLed mid-run ends non-zero with another rank naming the dead one, leaves no half-written
checkpoint; then its latest checkpoint is corrupted (4 KiB of 0xFF in trainer.pt) and the job is
resumed with one drafter rank instead of two: the damaged checkpoint is named, the one before is
taken, and the final weights equal the uninterrupted run's (another reduction order: rtol 1e-4).
The uninterrupted run is tests/train/conftest.py's, shared with watch/test_stop.py's trials.
bench/chaos.py runs the same checks over random signals, process kinds, steps and damage of the
5 + 3 layout (docs/LOG.md has its 20-trial run)."""

import re
import signal

import pytest

from bench.chaos import Fault, fault_and_resume

pytestmark = pytest.mark.slow


def test_a_killed_target_rank_then_a_corrupt_checkpoint_and_fewer_drafters_reach_the_same_weights(
        disaggregated_reference, tmp_path, capsys):
    layout, weights = disaggregated_reference
    fault = Fault(signal.SIGKILL, "target", at_step=4, damage="corrupt", part="trainer.pt", resume_drafters=1)
    problems = fault_and_resume("trial", tmp_path / "killed", layout, fault, weights)
    out = capsys.readouterr().out
    assert problems == [], "\n".join(problems) + out[-2000:]
    assert "exit=0" not in out and "RESULT trial_bit_exact" in out
    log = (tmp_path / "killed.log").read_text()  # the killed job's own output
    assert re.search(r"FAILED on rank [12]: rank 0 \(target, pid \d+ on .*\) ended while the job ran", log), log[-3000:]
