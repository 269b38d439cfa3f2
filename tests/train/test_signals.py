"""Signals a user sends a running command (issue 39, defect 7: `kill -USR1 <pid>`, the documented
stack dump, killed a training process: only the doctor installed its handler). A real
`dflash-train train` process: SIGUSR1 prints every thread's stack and the run goes on to its OK."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))


def _train(target_dir, out, *extra):
    return [sys.executable, "-m", "dflash_train", "train", "--recipe", "tiny", f"target.model={target_dir}",
            "data.train=chitchat", "data.regenerate=false", "data.max_samples=48", "train.epochs=8",
            "eval.num_prompts=0", "train.compile=off", "train.eval_every=1000", "drafter.num_taps=3",
            f"train.out_dir={out}", *extra]


def _wait_for_step(out: Path, proc, step: int, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and metrics.read_text().count('"step"') >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"the run did not reach step {step} (exit {proc.poll()})")


def test_sigusr1_dumps_a_training_processs_stacks_and_the_run_goes_on(tiny_target_dir, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(_train(tiny_target_dir, out, "train.max_steps=12"), env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_for_step(out, proc, 2)
    os.kill(proc.pid, signal.SIGUSR1)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-2000:]
    assert "dflash-train train: OK" in stdout
    assert "most recent call first" in stderr and "dflash_train" in stderr  # faulthandler's dump of every thread
