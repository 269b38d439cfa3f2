"""One run per run directory (issue 39, defect 3: two `train` runs into one train.out_dir both
ended OK, the first run's metrics dropped and its checkpoints overwritten). A real second process
holds the lock; the run fails at once naming it; a lock left by a killed process is taken over."""

import os
import signal
import socket
import subprocess
import sys
import time

from dflash_train import cli
from dflash_train.train.state import run_lock

HOLDER = ("import sys, time; from dflash_train.train.state import run_lock; "
          "lock = run_lock.held(sys.argv[1]); lock.__enter__(); print('held', flush=True); time.sleep(120)")


def _holder(out_dir):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_train_into_a_held_run_directory_fails_at_once_naming_the_holder(tiny_target_dir, tmp_path, capsys,
                                                                                  contained):
    run = tmp_path / "run"
    holder = _holder(run)
    try:
        t0 = time.monotonic()
        code = cli.main(["train", "--recipe", "tiny", f"target.model={tiny_target_dir}", f"train.out_dir={run}"])
        took = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait()
    out = capsys.readouterr().out
    assert code == 1 and "FAILED" in out and f"pid {holder.pid} on {socket.gethostname()}" in out
    assert "in use by another run" in out and took < 30  # before the target is loaded or data read
    assert not (run / "metrics.jsonl").exists() and not (run / "data").exists()


def test_a_lock_left_by_a_killed_run_is_taken_over_and_said(tmp_path):
    holder = _holder(tmp_path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    said = []
    with run_lock.held(tmp_path, log=said.append):
        fd = os.open(tmp_path / run_lock.LOCK_NAME, os.O_RDONLY)
        assert f"pid {os.getpid()}" in run_lock._who(run_lock._read(fd))
        os.close(fd)
    assert len(said) == 1 and "taking over" in said[0] and f"pid {holder.pid}" in said[0]
    said.clear()
    with run_lock.held(tmp_path, log=said.append):  # released normally: nobody to take over from
        pass
    assert said == []
